"""Tap modes side by side: taps that end a prefill pass (split) against taps captured inside it.

``--hybrid-tap-mode split`` ends a prefill pass at every exact tap; ``zero-split`` captures taps on
the pass's 64-token grid inside the pass (sgl-kernel-ext issue), so only off-grid tails still
split. The question is what the extra passes cost: forward passes per request, and the modelled
prefill time (the replay's clock: a fixed cost per pass plus per-token and per-pair work).

Contract:
- ``compare(traffics)``: ``traffics`` is a list of ``(traffic, split, zero_split, chunk)`` with
  ``report.json`` documents (``report.to_json``) of one trace and the same budgets: ``split`` ran
  ``hybrid`` and the reference cache ``REFERENCE`` with ``--tap-mode split``, ``zero_split`` ran
  ``hybrid`` with ``--tap-mode zero-split`` (capture anywhere: the CPU workers, SGLang's GPU
  worker under ``gdn_taps``), ``chunk`` (may be None) the same with ``--capture-grid chunk``
  (captures on each pass's 64-token grid only: zero-split without the off-grid recompute).
  The reference cache takes no taps: one run of it.
  Returns per traffic and budget: requests, prefill passes, passes per request, prefill tokens,
  modelled prefill seconds and TTFT of each, the ratio of each hybrid variant's prefill passes
  to the reference's (``TARGET_PASSES``: at most 1.1) and its prefill tokens against split's
  (``within_target``, per zero-split variant: passes at most the target and tokens no worse than
  split, 0.5 % slack for the scheduling noise of a different pass sequence).
- ``markdown(doc)`` / ``write(out_dir, doc, header)``: ``tap_modes.md`` and ``tap_modes.json``.
Mismatched reports (other traces or budgets) raise ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import write_comparison

REFERENCE = "no_buffer"
TARGET_PASSES = 1.1  # hybrid's prefill passes at most 1.1x the reference's (the target)
TOKEN_SLACK = 0.005  # zero-split may compute 0.5 % more prefill tokens than split and pass


def _runs(doc: dict[str, Any]) -> dict[tuple[float, str], dict[str, Any]]:
    return {(float(p["device_gib"]), r["cache"]): r for p in doc["points"] for r in p["runs"]}


def _side(run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    n = max(1, s["requests"])
    return {
        "requests": s["requests"],
        "extend_passes": run["extend_passes"],
        "passes_per_request": run["extend_passes"] / n,
        "prefill_tokens": s["prefill_tokens"],
        "reused_tokens": s["reused_tokens"],
        "prefill_s": run.get("prefill_s"),
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_mean_s": s["ttft_mean_s"],
        "taps_in_pass": (run.get("cache_stats") or {}).get("taps_in_pass"),
    }


VARIANTS = (("split", "hybrid split"), ("zero_split", "hybrid zero-split"))
CHUNK_VARIANT = ("zero_split_chunk", "hybrid zero-split, chunk grid")


def compare(
    traffics: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any] | None]],
) -> dict[str, Any]:
    """The comparison document (see the module contract)."""
    rows = []
    for traffic, split, zero, chunk in traffics:
        docs = {"split": _runs(split), "zero_split": _runs(zero)}
        if chunk is not None:
            docs[CHUNK_VARIANT[0]] = _runs(chunk)
        budgets = sorted({g for g, c in docs["split"] if c == "hybrid"})
        for name, runs in docs.items():
            if sorted({g for g, c in runs if c == "hybrid"}) != budgets:
                raise ValueError(f"{traffic}: the {name} run has other budgets than split")
        for g in budgets:
            if (g, REFERENCE) not in docs["split"]:
                raise ValueError(f"{traffic} {g:g} GiB: the split run has no {REFERENCE} run")
            ref = _side(docs["split"][g, REFERENCE])
            sides = {name: _side(runs[g, "hybrid"]) for name, runs in docs.items()}
            if len({x["requests"] for x in sides.values()}) != 1:
                raise ValueError(f"{traffic} {g:g} GiB: not the same trace (requests differ)")
            row: dict[str, Any] = {"traffic": traffic, "device_gib": g, REFERENCE: ref, **sides}
            for name, x in sides.items():
                ratio = x["extend_passes"] / ref["extend_passes"] if ref["extend_passes"] else None
                tokens = x["prefill_tokens"] / sides["split"]["prefill_tokens"]
                row[f"{name}_passes_vs_reference"] = ratio
                row[f"{name}_tokens_vs_split"] = tokens
                if name != "split":
                    row[f"{name}_within_target"] = (
                        ratio is not None and ratio <= TARGET_PASSES and tokens <= 1 + TOKEN_SLACK
                    )
            rows.append(row)
    return {
        "target": (
            f"zero-split hybrid at most {TARGET_PASSES}x {REFERENCE}'s prefill passes, its "
            f"prefill tokens no worse than split's (+{TOKEN_SLACK:.1%} slack)"
        ),
        "commands": {
            t: {
                "split": s.get("command"),
                "zero_split": z.get("command"),
                CHUNK_VARIANT[0]: None if c is None else c.get("command"),
            }
            for t, s, z, c in traffics
        },
        "clock": {t: s.get("clock") for t, s, *_ in traffics},
        "rows": rows,
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "| traffic | budget | cache | prefill passes | per request | prefill tokens "
        "| modelled prefill (s) | TTFT p50 / mean (s) | taps in pass |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = [*VARIANTS, CHUNK_VARIANT, (REFERENCE, REFERENCE)]
    for r in doc["rows"]:
        for key, name in names:
            if key not in r:
                continue
            x = r[key]
            taps = "-" if x["taps_in_pass"] is None else f"{x['taps_in_pass']:,}"
            lines.append(
                f"| {r['traffic']} | {r['device_gib']:g} GiB | {name} | {x['extend_passes']:,} "
                f"| {x['passes_per_request']:.2f} | {x['prefill_tokens']:,} | {_s(x['prefill_s'])} "
                f"| {x['ttft_p50_s']:.2f} / {x['ttft_mean_s']:.2f} | {taps} |"
            )
    lines += [
        "",
        f"| traffic | budget | cache | passes / {REFERENCE}'s | prefill tokens / split's "
        "| within target |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in doc["rows"]:
        for key, name in (*VARIANTS, CHUNK_VARIANT):
            if key not in r:
                continue
            ok = r.get(f"{key}_within_target")
            lines.append(
                f"| {r['traffic']} | {r['device_gib']:g} GiB | {name} "
                f"| {r[f'{key}_passes_vs_reference']:.2f} | {r[f'{key}_tokens_vs_split']:.4f} "
                f"| {'-' if ok is None else 'yes' if ok else 'no'} |"
            )
    return "\n".join(lines)


def write(out_dir: str | os.PathLike[str], doc: dict[str, Any], header: str = "") -> Path:
    """``tap_modes.json`` and ``tap_modes.md`` (``header`` first) in ``out_dir``."""
    return write_comparison(out_dir, "tap_modes", doc, markdown(doc), header)
