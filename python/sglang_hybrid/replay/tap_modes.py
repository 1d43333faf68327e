"""Tap modes side by side: taps that end a prefill pass against taps captured inside it.

An exact tap the model worker cannot capture inside a pass ends the pass there (``split``): one
more forward pass, its launch and weight read and scheduler round. The question is what those
extra passes cost and what capturing instead buys: forward passes per request, prefill tokens,
modelled prefill seconds and TTFT (the replay's clock), on the same trace and budgets.

Variants (each a ``report.json`` of ``replay run``, ``report.to_json``), by key:

- ``split``: every exact tap splits (``--tap-mode split --split-threshold 0``, the behaviour
  before issue #36); optional;
- ``auto``: the replay's default, what ``--hybrid-tap-mode auto`` resolves to on an H200 with
  SGLang's default arguments (``sglang/inpass.py``; today: split, only where the split pays);
- ``chunk``: in-pass capture at each request's 64-token grid from its pass start only (SGLang's
  own prefill tracking and ``gdn_taps``' gathers of the other grid taps, without the off-grid
  recompute), the other exact taps splitting where it pays: what the recompute is worth;
- ``zero_split``: in-pass capture anywhere ("zero-split everywhere"): the CPU workers, and
  SGLang's GPU worker with the FlashInfer prefill and the Triton recompute, what ``auto``
  resolves to on an H200 once the GPU check's stage I has verified that path.

The reference cache ``REFERENCE`` (no_buffer) takes no taps: it runs once, in whichever variant's
command lists it. Contract:

- ``compare(traffics)``: ``traffics`` is a list of ``(traffic, {variant: report})`` of one trace
  and the same budgets each. Returns per traffic and budget, per variant: requests, prefill
  passes (and per request), prefill tokens, modelled prefill seconds, TTFT p50 / p95 / mean,
  taps captured in the pass, splits declined; and for each hybrid variant its passes against
  the reference's, its prefill tokens against ``zero_split``'s, its TTFT p50 and p95 against
  the reference's, and ``within_target`` (``TARGET_PASSES``, ``TOKEN_SLACK``, TTFT no worse).
- ``markdown(doc)`` / ``write(out_dir, doc, header)``: ``tap_modes.md`` and ``tap_modes.json``.

Mismatched reports (other traces or budgets, no reference run) raise ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import write_comparison

REFERENCE = "no_buffer"
TARGET_PASSES = 1.1  # prefill passes at most 1.1x the reference's (issue #36)
TOKEN_SLACK = 0.01  # prefill tokens within 1 % of zero-split everywhere (issue #36)
BEST = "zero_split"  # the token yardstick
LABELS = {
    "split": "hybrid, every exact tap splits",
    "auto": "hybrid, auto on an H200 today",
    "chunk": "hybrid, in-pass on the 64-token grid",
    "zero_split": "hybrid, in-pass anywhere",
}


def _runs(doc: dict[str, Any]) -> dict[tuple[float, str], dict[str, Any]]:
    return {(float(p["device_gib"]), r["cache"]): r for p in doc["points"] for r in p["runs"]}


def _side(run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    n = max(1, s["requests"])
    stats = run.get("cache_stats") or {}
    return {
        "requests": s["requests"],
        "extend_passes": run["extend_passes"],
        "passes_per_request": run["extend_passes"] / n,
        "prefill_tokens": s["prefill_tokens"],
        "reused_tokens": s["reused_tokens"],
        "prefill_s": run.get("prefill_s"),
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p95_s": s["ttft_p95_s"],
        "ttft_mean_s": s["ttft_mean_s"],
        "taps_in_pass": stats.get("taps_in_pass"),
        "split_declined": stats.get("split_declined"),
    }


def compare(traffics: list[tuple[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """The comparison document (see the module contract)."""
    rows = []
    for traffic, reports in traffics:
        unknown = sorted(set(reports) - set(LABELS))
        if unknown:
            raise ValueError(f"{traffic}: unknown variants {unknown}; known: {sorted(LABELS)}")
        if BEST not in reports:
            raise ValueError(f"{traffic}: no {BEST} run (the prefill-token yardstick)")
        docs = {name: _runs(doc) for name, doc in reports.items()}
        budgets = sorted({g for g, c in docs[BEST] if c == "hybrid"})
        for name, runs in docs.items():
            if sorted({g for g, c in runs if c == "hybrid"}) != budgets:
                raise ValueError(f"{traffic}: the {name} run has other budgets than {BEST}")
        for g in budgets:
            refs = [runs[g, REFERENCE] for runs in docs.values() if (g, REFERENCE) in runs]
            if not refs:
                raise ValueError(f"{traffic} {g:g} GiB: no {REFERENCE} run")
            ref = _side(refs[0])
            sides = {name: _side(runs[g, "hybrid"]) for name, runs in docs.items()}
            if len({x["requests"] for x in (ref, *sides.values())}) != 1:
                raise ValueError(f"{traffic} {g:g} GiB: not the same trace (requests differ)")
            row: dict[str, Any] = {"traffic": traffic, "device_gib": g, REFERENCE: ref, **sides}
            best = sides[BEST]["prefill_tokens"]
            for name, x in sides.items():
                passes = x["extend_passes"] / ref["extend_passes"] if ref["extend_passes"] else None
                tokens = x["prefill_tokens"] / best if best else None
                p50 = x["ttft_p50_s"] <= ref["ttft_p50_s"]
                p95 = x["ttft_p95_s"] <= ref["ttft_p95_s"]
                row[f"{name}_passes_vs_reference"] = passes
                row[f"{name}_tokens_vs_best"] = tokens
                row[f"{name}_ttft_ok"] = p50 and p95
                row[f"{name}_within_target"] = (
                    passes is not None
                    and passes <= TARGET_PASSES
                    and tokens is not None
                    and tokens <= 1 + TOKEN_SLACK
                    and p50
                    and p95
                )
            rows.append(row)
    return {
        "target": (
            f"at most {TARGET_PASSES}x {REFERENCE}'s prefill passes, prefill tokens within "
            f"{TOKEN_SLACK:.0%} of in-pass capture anywhere, modelled TTFT p50 and p95 no worse "
            f"than {REFERENCE}'s"
        ),
        "variants": {k: v for k, v in LABELS.items() if any(k in r for _, r in traffics)},
        "commands": {t: {k: d.get("command") for k, d in r.items()} for t, r in traffics},
        "tap_mode": {t: {k: d.get("tap mode") for k, d in r.items()} for t, r in traffics},
        "clock": {t: next(iter(r.values())).get("clock") for t, r in traffics},
        "rows": rows,
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "| traffic | budget | cache | prefill passes | per request | prefill tokens "
        "| modelled prefill (s) | TTFT p50 / p95 (s) | taps in pass | splits declined |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = [*LABELS.items(), (REFERENCE, REFERENCE)]
    for r in doc["rows"]:
        for key, name in names:
            if key not in r:
                continue
            x = r[key]
            lines.append(
                f"| {r['traffic']} | {r['device_gib']:g} GiB | {name} | {x['extend_passes']:,} "
                f"| {x['passes_per_request']:.2f} | {x['prefill_tokens']:,} | {_s(x['prefill_s'])} "
                f"| {x['ttft_p50_s']:.2f} / {x['ttft_p95_s']:.2f} | {_n(x['taps_in_pass'])} "
                f"| {_n(x['split_declined'])} |"
            )
    lines += [
        "",
        f"| traffic | budget | cache | passes / {REFERENCE}'s | prefill tokens / anywhere's "
        f"| TTFT p50, p95 <= {REFERENCE}'s | within target |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for r in doc["rows"]:
        for key, name in LABELS.items():
            if key not in r:
                continue
            passes = r[f"{key}_passes_vs_reference"]
            lines.append(
                f"| {r['traffic']} | {r['device_gib']:g} GiB | {name} "
                f"| {'-' if passes is None else f'{passes:.2f}'} "
                f"| {r[f'{key}_tokens_vs_best']:.4f} | {'yes' if r[f'{key}_ttft_ok'] else 'no'} "
                f"| {'yes' if r[f'{key}_within_target'] else 'no'} |"
            )
    return "\n".join(lines)


def write(out_dir: str | os.PathLike[str], doc: dict[str, Any], header: str = "") -> Path:
    """``tap_modes.json`` and ``tap_modes.md`` (``header`` first) in ``out_dir``."""
    return write_comparison(out_dir, "tap_modes", doc, markdown(doc), header)
