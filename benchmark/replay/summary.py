"""Every recorded replay at a glance: hinted and hint-less traffic, ``hybrid`` against SGLang.

Usage (from the repository root, after ``bench_replay.py`` wrote the runs it reads):
  python benchmark/replay/summary.py [--results docs/results/replay] [--out DIR]

Reads the ``report.json`` of the canonical runs of ``bench_replay.py`` (``ROWS``: each run with
all four caches side by side, so every ratio below comes from one run) and writes
``summary.md`` (the table ``docs/benchmarks.md`` shows under "At a glance"), ``summary.json``
and ``summary.png`` (prefill computed by each cache relative to the better of SGLang's two
placements, one bar group per row) into ``--out`` (default: the results folder). A run that is
missing is reported and skipped, never guessed. Prints the markdown.

"hinted" traffic reaches the cache with the chat template's tap hints (``sglang/hints.py``);
"hint-less" traffic is token ids only (Mooncake's trace; ``--drop-hints``; bench_serving's
generated prompts carry no template either). SGLang's caches read no hints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

RESULTS = Path("docs/results/replay")
CACHES = ("hybrid", "no_buffer", "extra_buffer", "oracle")


class Row(NamedTuple):
    run: str  # a bench_replay.py name, docs/results/replay/RUN/report.json
    traffic: str
    hints: str


ROWS: tuple[Row, ...] = (
    Row("agent", "agent workload (24 sessions, 27B)", "hinted"),
    Row("agent-host", "agent workload, host tier", "hinted"),
    Row("agent-hintless", "agent workload (24 sessions, 27B)", "hint-less"),
    Row("shared-prefix", "bench_serving shared prefix (27B)", "hint-less"),
    Row("mooncake-x4", "Mooncake, 1/4 load (80B)", "hint-less"),
    Row("mooncake-host", "Mooncake, 1/4 load, host tier", "hint-less"),
    Row("mooncake", "Mooncake, own arrivals (80B)", "hint-less"),
)


def _budget(point: dict[str, Any]) -> str:
    dev, host = point["device_gib"], point.get("host_gib") or 0
    if host:
        return f"{dev:g} + {host:g} host (SGLang: {dev + host:g})"
    return f"{dev:g}"


def collect(results: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One record per (row, budget point); the runs not found."""
    records: list[dict[str, Any]] = []
    missing: list[str] = []
    for row in ROWS:
        path = results / row.run / "report.json"
        if not path.exists():
            missing.append(row.run)
            continue
        report = json.loads(path.read_text())
        for point in report["points"]:
            computed = {r["cache"]: r["summary"]["prefill_tokens"] for r in point["runs"]}
            reused = {r["cache"]: r["summary"]["reuse_fraction"] for r in point["runs"]}
            sglang = [computed[c] for c in ("no_buffer", "extra_buffer") if c in computed]
            best = min(sglang) if sglang else None
            records.append(
                {
                    "run": row.run,
                    "traffic": row.traffic,
                    "hints": row.hints,
                    "budget": _budget(point),
                    "date": report.get("date"),
                    "computed": computed,
                    "reused": reused,
                    "hybrid_vs_best_sglang": (
                        computed["hybrid"] / best if best and "hybrid" in computed else None
                    ),
                }
            )
    return records, missing


def markdown(records: list[dict[str, Any]]) -> str:
    head = (
        "| traffic | hints | budget (GiB) | "
        + " | ".join(CACHES)
        + " | hybrid / better of SGLang's |"
    )
    lines = [head, "|---|---|---|" + "---:|" * (len(CACHES) + 1)]
    for r in records:
        cells = []
        for c in CACHES:
            if c in r["computed"]:
                cells.append(f"{r['computed'][c]:,} ({r['reused'][c] * 100:.1f} %)")
            else:
                cells.append("")
        ratio = r["hybrid_vs_best_sglang"]
        shown = "" if ratio is None else f"**{ratio:.3f}**" if ratio <= 1 else f"{ratio:.3f}"
        lines.append(
            f"| {r['traffic']} | {r['hints']} | {r['budget']} | "
            + " | ".join(cells)
            + f" | {shown} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Prefill computed relative to the better of SGLang's placements, per row and cache."""
    from matplotlib.figure import Figure

    labels = [f"{r['run']} {r['budget'].split(' (')[0]}" for r in records]
    fig = Figure(figsize=(10, 0.45 * len(records) + 1.5))
    ax = fig.subplots()
    height = 0.8 / len(CACHES)
    for k, cache in enumerate(CACHES):
        ys, xs = [], []
        for i, r in enumerate(records):
            sglang = [r["computed"][c] for c in ("no_buffer", "extra_buffer") if c in r["computed"]]
            if cache in r["computed"] and sglang:
                ys.append(i + (k - (len(CACHES) - 1) / 2) * height)
                xs.append(r["computed"][cache] / min(sglang))
        ax.barh(ys, xs, height=height, label=cache)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(records)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("prefill tokens computed / the better of no_buffer and extra_buffer")
    ax.legend(loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or args.results
    records, missing = collect(args.results)
    for run in missing:
        print(
            f"missing: {args.results / run / 'report.json'} (bench_replay.py {run})",
            file=sys.stderr,
        )
    if not records:
        print("no runs found", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(records)
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(
        json.dumps({"rows": records, "missing": missing}, indent=2) + "\n"
    )
    plot(records, out / "summary.png")
    print(md, end="")
    print(f"wrote {out / 'summary.md'}, summary.json, summary.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
