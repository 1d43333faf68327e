"""Reports of a replay sweep: JSON, a markdown table and PNG plots.

Contract: ``write_report(sweep, out_dir, meta) -> ReportFiles`` writes

- ``report.json``: the metadata (title, exact command, date, machine, trace, settings), and for
  every budget point and cache the pool plan, the summary (prompt, reused and computed prefill
  tokens, host bytes restored, modelled TTFT p50/p95/mean, makespan), a per-tag breakdown and
  loop counters;
- ``report.md``: the pool mapping and a results table per budget, with each cache's computed
  prefill relative to SGLang's built-in cache (``no_buffer``) and to the oracle; the skipped
  opportunities of caches that count them (``hybrid``: ``sglang/skips.py`` kinds, also in
  ``cache_stats`` of ``report.json``); and, after an unrelated warm-up (``warmup.py``), how full
  it left each cache's pools (``warmup`` of ``report.json``);
- ``reuse_vs_budget.png`` (prefill tokens computed and reuse fraction against the device budget,
  one line per cache; with one budget, a labelled bar per cache) and ``ttft_cdf.png`` (modelled
  TTFT CDFs, one panel per budget).

``markdown(sweep, meta)`` returns the markdown text alone. Figures are drawn with
``matplotlib.figure.Figure`` (no pyplot state).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

from sglang_hybrid.sglang.skips import KINDS as SKIP_KINDS

from .results import CacheSummary, ReplayResult

# The columns of the skipped-opportunities table: the backend's kinds, then the tokens prefilled
# where a tier held a state, then the index's count of taps refused a slot (endpoints included).
SKIP_COLUMNS: tuple[str, ...] = (*SKIP_KINDS, "recomputed_tokens", "skipped_no_slot")


class SweepPoint(NamedTuple):
    device_gib: float
    host_gib: float
    results: dict[str, ReplayResult]  # by cache, in run order


class ReportFiles(NamedTuple):
    json: Path
    markdown: Path
    reuse_plot: Path
    ttft_plot: Path


def _num(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def _summary_dict(s: CacheSummary) -> dict[str, Any]:
    d = {k: _num(v) for k, v in s._asdict().items()}
    d["reuse_fraction"] = s.reuse_fraction
    return d


def to_json(sweep: list[SweepPoint], meta: dict[str, Any]) -> dict[str, Any]:
    points = []
    for p in sweep:
        runs = []
        for cache, r in p.results.items():
            runs.append(
                {
                    "cache": cache,
                    "plan": r.plan._asdict(),
                    "summary": _summary_dict(r.summary()),
                    "by_tag": {t: _summary_dict(s) for t, s in r.by_tag().items()},
                    "wall_s": r.wall_s,
                    "passes": r.passes,
                    "extend_passes": r.extend_passes,
                    "decode_passes": r.decode_passes,
                    "prefill_s": r.prefill_s,
                    "mean_in_flight": r.mean_in_flight(),
                    "cache_stats": r.cache_stats,
                    "skips": {k: r.cache_stats[k] for k in SKIP_COLUMNS if k in r.cache_stats},
                    "warmup": r.warmup,
                    "l3": r.l3,
                    "notes": r.notes,
                }
            )
        points.append({"device_gib": p.device_gib, "host_gib": p.host_gib, "runs": runs})
    clock = next((r.clock for p in sweep for r in p.results.values()), {})
    return {**meta, "clock": clock, "points": points}


def _ratio(a: int, b: int | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def _fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def markdown(sweep: list[SweepPoint], meta: dict[str, Any]) -> str:
    lines = [f"### {meta.get('title', 'Replay')}", ""]
    if meta.get("command"):
        lines += ["```", str(meta["command"]), "```", ""]
    facts = [
        f"{k}: {meta[k]}"
        for k in ("date", "machine", "trace", "tap mode", "warmup", "overlap")
        if meta.get(k)
    ]
    if facts:
        lines += ["; ".join(facts), ""]
    for p in sweep:
        host = f" + {p.host_gib:g} GiB host" if p.host_gib else ""
        lines += [f"#### Budget {p.device_gib:g} GiB device{host}", ""]
        lines += ["| cache | KV tokens | state slots | max running | snapshot slots |"]
        lines += ["|---|---:|---:|---:|---:|"]
        for cache, r in p.results.items():
            pl = r.plan
            snap = str(pl.snapshot_slots) if pl.cache == "hybrid" else "-"
            lines.append(
                f"| {cache} | {pl.kv_tokens:,} | {pl.state_slots} | {pl.max_running} | {snap} |"
            )
        lines += [""]
        sums = {c: r.summary() for c, r in p.results.items()}
        base = sums.get("no_buffer")
        oracle = sums.get("oracle")
        lines += [
            "| cache | prompt tokens | reused | prefill computed | vs no_buffer | vs oracle "
            "| host bytes restored | TTFT p50 (s) | TTFT p95 (s) | wall (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for cache, s in sums.items():
            lines.append(
                f"| {cache} | {s.prompt_tokens:,} | {s.reused_tokens:,} "
                f"({s.reuse_fraction:.1%}) | {s.prefill_tokens:,} "
                f"| {_ratio(s.prefill_tokens, base.prefill_tokens if base else None)} "
                f"| {_ratio(s.prefill_tokens, oracle.prefill_tokens if oracle else None)} "
                f"| {s.host_bytes_restored:,} | {_fmt_s(s.ttft_p50_s)} | {_fmt_s(s.ttft_p95_s)} "
                f"| {p.results[cache].wall_s:.0f} |"
            )
        lines += _skips_table(p) + _l3_table(p) + _warmup_table(p)
        notes = [f"- {c}: {n}" for c, r in p.results.items() for n in r.notes[:5]]
        lines += ["", *notes, ""] if notes else [""]
    return "\n".join(lines)


def _skips_table(p: SweepPoint) -> list[str]:
    """Skipped opportunities of the caches that count them (measured requests only)."""
    rows = {c: r.cache_stats for c, r in p.results.items() if SKIP_KINDS[0] in r.cache_stats}
    if not rows:
        return []
    out = [
        "",
        "Skipped opportunities (`sglang/skips.py`; `skipped_no_slot`: the index's count):",
        "",
        "| cache | " + " | ".join(SKIP_COLUMNS) + " |",
        "|---|" + "---:|" * len(SKIP_COLUMNS),
    ]
    for cache, st in rows.items():
        out.append(f"| {cache} | " + " | ".join(f"{st.get(k, 0):,}" for k in SKIP_COLUMNS) + " |")
    return out


def _l3_table(p: SweepPoint) -> list[str]:
    """What the L3 variants' store did (``l3_model.py``): lookups, hits, fetched prefix tokens,
    bytes over the link and its busy time (the geometry's bytes), what eviction-time writes
    would have written instead of write-through."""
    rows = {c: r for c, r in p.results.items() if r.l3}
    if not rows:
        return []
    out = [
        "",
        "L3 (`l3_model.py`; bytes of the modelled geometry; link busy time in modelled s):",
        "",
        "| cache | link GB/s | lookups | hits | fetched tokens | read GiB (s) | written GiB (s) "
        "| written at host eviction instead, GiB | store evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gib = float(1 << 30)
    for cache, r in rows.items():
        st, x = r.cache_stats, r.l3
        out.append(
            f"| {cache} | {x['link_bytes_per_s'] / 1e9:.2f} | {st.get('l3_lookups', 0):,} "
            f"| {st.get('l3_lookup_hits', 0):,} | {st.get('l3_fetched_tokens', 0):,} "
            f"| {x['read_bytes'] / gib:,.1f} ({x['read_s']:,.1f}) "
            f"| {x['write_bytes'] / gib:,.1f} ({x['write_s']:,.1f}) "
            f"| {x['eviction_write_bytes'] / gib:,.1f} | {x['store_evicted']:,} |"
        )
    return out


def _warmup_table(p: SweepPoint) -> list[str]:
    """What the unrelated warm-up was and how full it left each cache's pools."""
    runs = {c: r.warmup for c, r in p.results.items() if r.warmup}
    if not runs:
        return []
    out = [
        "",
        "Unrelated warm-up before the measured requests (not counted above); pools at its end:",
        "",
        "| cache | warm-up requests | warm-up prompt tokens | KV tokens in use | evictable "
        "| state slots held by the cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cache, w in runs.items():
        if "snapshot_slots" in w:
            held = f"{w['snapshot_slots_used']} of {w['snapshot_slots']} snapshot slots"
        else:
            held = f"{w.get('state_slots_used', 0)} of {w['state_slots']}"
        out.append(
            f"| {cache} | {w['requests']:,} | {w['prompt_tokens']:,} "
            f"| {w['kv_used']:,} of {w['kv_tokens']:,} ({w['kv_used'] / w['kv_tokens']:.0%}) "
            f"| {w['kv_evictable']:,} | {held} |"
        )
    return out


def _reuse_plot(sweep: list[SweepPoint], path: Path) -> None:
    reuse_figure(sweep).savefig(path, dpi=110)


def reuse_figure(sweep: list[SweepPoint]) -> Any:
    """Prefill tokens computed and the share of prompt tokens reused, per cache: lines against
    the device budget when the sweep has several, bars with their values for one (a line of one
    point per cache was a dot on an axis zoomed to its own value, issue #38). Both axes start at
    0, so a 2 % difference looks like one."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    caches = list(dict.fromkeys(c for p in sweep for c in p.results))
    panels = (
        (ax1, "prefill tokens computed (M)", lambda s: s.prefill_tokens / 1e6, "{:.3g}"),
        (ax2, "prompt tokens reused (%)", lambda s: s.reuse_fraction * 100, "{:.1f}"),
    )
    for ax, label, value, fmt in panels:
        if len(sweep) == 1:
            p = sweep[0]
            got = [(c, value(p.results[c].summary())) for c in caches if c in p.results]
            bars = ax.bar(
                range(len(got)), [v for _, v in got], color=[f"C{i}" for i in range(len(got))]
            )
            ax.bar_label(bars, labels=[fmt.format(v) for _, v in got], padding=2)
            ax.set_xticks(range(len(got)), [c for c, _ in got])
            top = max((v for _, v in got), default=0.0)
            ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
        else:
            for cache in caches:
                xs = [p.device_gib for p in sweep if cache in p.results]
                ys = [value(p.results[cache].summary()) for p in sweep if cache in p.results]
                ax.plot(xs, ys, marker="o", label=cache)
            ax.set_xlabel("device budget (GiB, modelled geometry)")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.legend()
        if "%" in label:
            ax.set_ylim(0, 105)  # room for a bar's label at 100 %
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    if len(sweep) == 1:
        p = sweep[0]
        host = f" + {p.host_gib:g} GiB host" if p.host_gib else ""
        fig.suptitle(f"device budget {p.device_gib:g} GiB{host} (modelled geometry)")
    fig.tight_layout()
    return fig


def _ttft_plot(sweep: list[SweepPoint], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5 * len(sweep), 4))
    axes = fig.subplots(1, len(sweep), squeeze=False)[0]
    for ax, p in zip(axes, sweep):
        for cache, r in p.results.items():
            t = sorted(x for rec in r.records if (x := rec.ttft_s) is not None)
            if t:
                ax.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=cache)
        ax.set_xscale("log")
        ax.set_xlabel("modelled TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(
            f"{p.device_gib:g} GiB" + (f" + {p.host_gib:g} GiB host" if p.host_gib else "")
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(
    sweep: list[SweepPoint], out_dir: str | os.PathLike[str], meta: dict[str, Any]
) -> ReportFiles:
    if not sweep:
        raise ValueError("nothing to report: the sweep is empty")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(
        out / "report.json", out / "report.md", out / "reuse_vs_budget.png", out / "ttft_cdf.png"
    )
    files.json.write_text(json.dumps(to_json(sweep, meta), indent=1, sort_keys=False) + "\n")
    files.markdown.write_text(markdown(sweep, meta) + "\n")
    _reuse_plot(sweep, files.reuse_plot)
    _ttft_plot(sweep, files.ttft_plot)
    return files


def write_comparison(
    out_dir: str | os.PathLike[str], stem: str, doc: dict[str, Any], body: str, header: str = ""
) -> Path:
    """``STEM.json`` (``doc``) and ``STEM.md`` (``header``, then ``body``) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = out / f"{stem}.md"
    md.write_text((header + "\n\n" if header else "") + body + "\n")
    return md
