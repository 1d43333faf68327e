"""Tap modes side by side: taps that end a prefill pass (split) against taps captured inside it.

``--hybrid-tap-mode split`` ends a prefill pass at every exact tap; ``zero-split`` captures taps on
the pass's 64-token grid inside the pass (sgl-kernel-ext issue), so only off-grid tails still
split. The question is what the extra passes cost: forward passes per request, and the modelled
prefill time (the replay's clock: a fixed cost per pass plus per-token and per-pair work).

Contract:
- ``compare(traffics)``: ``traffics`` is a list of ``(traffic, split, zero_split)`` with two
  ``report.json`` documents (``report.to_json``) of one trace and the same budgets: ``split`` ran
  ``hybrid`` and the reference cache ``REFERENCE`` with ``--tap-mode split``, ``zero_split`` ran
  ``hybrid`` with ``--tap-mode zero-split`` (the reference cache takes no taps: one run of it).
  Returns per traffic and budget: requests, prefill passes, passes per request, prefill tokens,
  modelled prefill seconds and TTFT of the three, the ratio of hybrid's prefill passes to the
  reference's (``TARGET_PASSES``: at most 1.1) and zero-split's prefill tokens against split's
  (``within_target``: passes at most the target and tokens no worse than split, 0.5 % slack
  for the scheduling noise of a different pass sequence).
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


def compare(traffics: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The comparison document (see the module contract)."""
    rows = []
    for traffic, split, zero in traffics:
        a, b = _runs(split), _runs(zero)
        budgets = sorted({g for g, c in a if c == "hybrid"})
        if budgets != sorted({g for g, c in b if c == "hybrid"}):
            raise ValueError(f"{traffic}: the split and zero-split runs have other budgets")
        for g in budgets:
            if (g, REFERENCE) not in a:
                raise ValueError(f"{traffic} {g:g} GiB: the split run has no {REFERENCE} run")
            s, z, ref = _side(a[g, "hybrid"]), _side(b[g, "hybrid"]), _side(a[g, REFERENCE])
            if s["requests"] != z["requests"]:
                raise ValueError(f"{traffic} {g:g} GiB: not the same trace (requests differ)")
            ratio = z["extend_passes"] / ref["extend_passes"] if ref["extend_passes"] else None
            tokens = z["prefill_tokens"] / s["prefill_tokens"] if s["prefill_tokens"] else None
            rows.append(
                {
                    "traffic": traffic,
                    "device_gib": g,
                    "split": s,
                    "zero_split": z,
                    REFERENCE: ref,
                    "split_passes_vs_reference": (
                        s["extend_passes"] / ref["extend_passes"] if ref["extend_passes"] else None
                    ),
                    "zero_split_passes_vs_reference": ratio,
                    "zero_split_tokens_vs_split": tokens,
                    "within_target": ratio is not None
                    and ratio <= TARGET_PASSES
                    and tokens is not None
                    and tokens <= 1 + TOKEN_SLACK,
                }
            )
    return {
        "target": (
            f"zero-split hybrid at most {TARGET_PASSES}x {REFERENCE}'s prefill passes, its "
            f"prefill tokens no worse than split's (+{TOKEN_SLACK:.1%} slack)"
        ),
        "commands": {
            t: {"split": s.get("command"), "zero_split": z.get("command")} for t, s, z in traffics
        },
        "clock": {t: s.get("clock") for t, s, _ in traffics},
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
    for r in doc["rows"]:
        for name, key in (("hybrid split", "split"), ("hybrid zero-split", "zero_split")) + (
            (REFERENCE, REFERENCE),
        ):
            x = r[key]
            taps = "-" if x["taps_in_pass"] is None else f"{x['taps_in_pass']:,}"
            lines.append(
                f"| {r['traffic']} | {r['device_gib']:g} GiB | {name} | {x['extend_passes']:,} "
                f"| {x['passes_per_request']:.2f} | {x['prefill_tokens']:,} | {_s(x['prefill_s'])} "
                f"| {x['ttft_p50_s']:.2f} / {x['ttft_mean_s']:.2f} "
                f"| {taps} |"
            )
    lines += [
        "",
        "| traffic | budget | split / "
        + REFERENCE
        + " passes | zero-split / "
        + REFERENCE
        + " passes | zero-split / split prefill tokens | within target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        sp, zp, tk = (
            r["split_passes_vs_reference"],
            r["zero_split_passes_vs_reference"],
            r["zero_split_tokens_vs_split"],
        )
        lines.append(
            f"| {r['traffic']} | {r['device_gib']:g} GiB | {sp:.2f} | {zp:.2f} | {tk:.4f} "
            f"| {'yes' if r['within_target'] else 'no'} |"
        )
    return "\n".join(lines)


def write(out_dir: str | os.PathLike[str], doc: dict[str, Any], header: str = "") -> Path:
    """``tap_modes.json`` and ``tap_modes.md`` (``header`` first) in ``out_dir``."""
    return write_comparison(out_dir, "tap_modes", doc, markdown(doc), header)
