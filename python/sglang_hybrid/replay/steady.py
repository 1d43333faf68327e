"""Steady state: the same replay from flushed pools and from pools pre-filled by unrelated traffic.

A pre-filled run (``replay run --prefill-pool``: a warm-up of unrelated requests filled the KV
pool with evictable cache and the state slots with snapshots first; ``warmup.py``) is compared
with the flushed run of the same trace, budgets and caches. The question is whether a cache
keeps its reuse when it has to win room from stale entries instead of taking free memory.

Contract:
- ``compare(variants)``: ``variants`` is a list of ``(traffic, flushed, prefilled)`` with the two
  ``report.json`` documents (``report.to_json``) of one traffic; returns the comparison as a JSON
  document: per traffic, budget and cache the flushed and pre-filled prompt, reused and computed
  tokens, the relative change of each (``(prefilled - flushed) / flushed``), the mean number of
  measured requests in flight, the skip and eviction counters of both runs (caches that count
  them) and how full the warm-up left the pools. ``TARGET`` is the tolerated loss of reused
  tokens; ``within_target`` says whether a row meets it.
- ``markdown(doc)``: the side-by-side table, the skip counters table and the warm-up's fill.
- ``write(out_dir, doc)`` writes ``steady_state.json`` and ``steady_state.md``.
Mismatched reports (other traces, budgets or prompt tokens) raise ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import write_comparison

TARGET = 0.02  # a pre-filled run may reuse at most 2 % fewer prompt tokens than a flushed one
COUNTERS: tuple[str, ...] = (
    "tap_no_slot",
    "tap_no_tail_page",
    "tap_over_budget",
    "recomputed_held",
    "recomputed_tokens",
    "skipped_no_slot",
    "taps_published",
    "endpoints_published",
    "device_evicted_unbacked",
    "device_evicted_dead",
)


def _runs(doc: dict[str, Any]) -> dict[tuple[float, str], dict[str, Any]]:
    return {
        (float(p["device_gib"]), r["cache"]): {**r, "host_gib": p["host_gib"]}
        for p in doc["points"]
        for r in p["runs"]
    }


def _change(after: int, before: int) -> float | None:
    return (after - before) / before if before else None


def compare(variants: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The comparison document (see the module contract)."""
    rows = []
    for traffic, flushed, prefilled in variants:
        a, b = _runs(flushed), _runs(prefilled)
        if set(a) != set(b):
            raise ValueError(f"{traffic}: the runs differ: {sorted(a)} against {sorted(b)}")
        for key in a:
            fa, fb = a[key], b[key]
            sa, sb = fa["summary"], fb["summary"]
            if sa["prompt_tokens"] != sb["prompt_tokens"]:
                raise ValueError(f"{traffic} {key}: not the same trace (prompt tokens differ)")
            if not fb.get("warmup"):
                raise ValueError(f"{traffic} {key}: the pre-filled run ran no warm-up")
            reused = _change(sb["reused_tokens"], sa["reused_tokens"])
            rows.append(
                {
                    "traffic": traffic,
                    "device_gib": key[0],
                    "host_gib": fa["host_gib"],
                    "cache": key[1],
                    "plan": fa["plan"],
                    "prompt_tokens": sa["prompt_tokens"],
                    "flushed": _side(fa),
                    "prefilled": _side(fb),
                    "reused_change": reused,
                    "computed_change": _change(sb["prefill_tokens"], sa["prefill_tokens"]),
                    "within_target": reused is not None and reused >= -TARGET,
                    "warmup": fb["warmup"],
                }
            )
    return {
        "target": f"pre-filled reuses at most {TARGET:.0%} fewer prompt tokens than flushed",
        "commands": {
            traffic: {"flushed": f.get("command"), "prefilled": p.get("command")}
            for traffic, f, p in variants
        },
        "rows": rows,
    }


def _side(run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    stats = run.get("cache_stats") or {}
    return {
        "reused_tokens": s["reused_tokens"],
        "prefill_tokens": s["prefill_tokens"],
        "reuse_fraction": s["reuse_fraction"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p95_s": s["ttft_p95_s"],
        "mean_in_flight": run.get("mean_in_flight"),
        "wall_s": run.get("wall_s"),
        "counters": {k: stats[k] for k in COUNTERS if k in stats},
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "| traffic | budget | cache | prompt tokens | flushed: reused | computed "
        "| pre-filled: reused | computed | reused, pre-filled vs flushed | computed, pre-filled "
        "vs flushed | requests in flight (mean) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        f, p = r["flushed"], r["prefilled"]
        host = f" + {r['host_gib']:g} host" if r["host_gib"] else ""
        lines.append(
            f"| {r['traffic']} | {r['device_gib']:g} GiB{host} | {r['cache']} "
            f"| {r['prompt_tokens']:,} "
            f"| {f['reused_tokens']:,} ({f['reuse_fraction']:.1%}) | {f['prefill_tokens']:,} "
            f"| {p['reused_tokens']:,} ({p['reuse_fraction']:.1%}) | {p['prefill_tokens']:,} "
            f"| {_pct(r['reused_change'])} | {_pct(r['computed_change'])} "
            f"| {f['mean_in_flight'] or 0:.1f} / {p['mean_in_flight'] or 0:.1f} |"
        )
    counted = [r for r in doc["rows"] if r["flushed"]["counters"]]
    if counted:
        keys = [k for k in COUNTERS if any(k in r["flushed"]["counters"] for r in counted)]
        lines += [
            "",
            "Counters of the measured requests, flushed / pre-filled (`HybridRadixCache.stats()`):",
            "",
            "| traffic | budget | cache | " + " | ".join(keys) + " |",
            "|---|---|---|" + "---:|" * len(keys),
        ]
        for r in counted:
            f, p = r["flushed"]["counters"], r["prefilled"]["counters"]
            cells = " | ".join(f"{f.get(k, 0):,} / {p.get(k, 0):,}" for k in keys)
            lines.append(f"| {r['traffic']} | {r['device_gib']:g} GiB | {r['cache']} | {cells} |")
    lines += [
        "",
        "Pools after the unrelated warm-up (pre-filled runs):",
        "",
        "| traffic | budget | cache | warm-up requests | warm-up prompt tokens "
        "| KV tokens in use | state slots held by the cache |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        w = r["warmup"]
        if "snapshot_slots" in w:
            held = f"{w['snapshot_slots_used']} of {w['snapshot_slots']} snapshot slots"
        else:
            held = f"{w.get('state_slots_used', 0)} of {w['state_slots']}"
        lines.append(
            f"| {r['traffic']} | {r['device_gib']:g} GiB | {r['cache']} | {w['requests']:,} "
            f"| {w['prompt_tokens']:,} | {w['kv_used']:,} of {w['kv_tokens']:,} "
            f"({w['kv_used'] / w['kv_tokens']:.0%}) | {held} |"
        )
    return "\n".join(lines)


def write(out_dir: str | os.PathLike[str], doc: dict[str, Any], header: str = "") -> Path:
    """``steady_state.json`` and ``steady_state.md`` (``header`` first) in ``out_dir``."""
    return write_comparison(out_dir, "steady_state", doc, markdown(doc), header)
