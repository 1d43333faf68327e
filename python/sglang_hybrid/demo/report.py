"""What ``make demo`` prints and writes: per-request rows, totals, ratios, identity, a plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_hybrid.replay.live import LiveResult, summarize


@dataclass(slots=True)
class CacheRun:
    name: str  # "hybrid", "built-in", "uncached"
    results: list[LiveResult]
    argv: list[str]  # the server command line ([] for a server started elsewhere)
    startup_s: float


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1000 * x:.0f}"


def table(runs: list[CacheRun]) -> str:
    """One row per request: prompt tokens, then reused / prefilled / TTFT for each cache."""
    head = f"{'request':<16} {'what':<36} {'prompt':>6}"
    sub = f"{'':<16} {'':<36} {'':>6}"
    for run in runs:
        head += f" | {run.name:^23}"
        sub += f" | {'reused':>7} {'prefill':>7} {'ttft ms':>7}"
    lines = [head, sub, "-" * len(sub)]
    for i, first in enumerate(runs[0].results):
        row = f"{first.rid:<16} {first.tag[:36]:<36} {first.prompt_tokens:>6}"
        for run in runs:
            r = run.results[i]
            if r.error:
                row += f" | {'error':>23}"
            else:
                row += f" | {r.cached_tokens:>7} {r.prefilled_tokens:>7} {_ms(r.ttft_s):>7}"
        lines.append(row)
    return "\n".join(lines)


def totals(runs: list[CacheRun]) -> dict[str, dict[str, Any]]:
    return {run.name: summarize(run.results) for run in runs}


def ratios(tot: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Prefilled tokens and summed TTFT of every other cache over ``hybrid``'s."""
    out: dict[str, float] = {}
    ours = tot.get("hybrid")
    if not ours:
        return out
    for name, t in tot.items():
        if name == "hybrid":
            continue
        if ours["prefilled_tokens"]:
            out[f"prefilled {name} / hybrid"] = t["prefilled_tokens"] / ours["prefilled_tokens"]
        if ours["ttft_total_s"]:
            out[f"ttft {name} / hybrid"] = t["ttft_total_s"] / ours["ttft_total_s"]
    return out


def mismatches(runs: list[CacheRun]) -> list[str]:
    """Requests whose generated output differs between any two caches (or failed anywhere)."""
    bad = []
    for i, first in enumerate(runs[0].results):
        outs = {(r.output, r.completion_tokens) for r in (run.results[i] for run in runs)}
        if len(outs) != 1 or any(run.results[i].error for run in runs):
            bad.append(first.rid)
    return bad


def write_json(path: Path, runs: list[CacheRun], meta: dict[str, Any]) -> None:
    tot = totals(runs)
    doc = {
        "meta": meta,
        "totals": tot,
        "ratios": ratios(tot),
        "identical_outputs": not mismatches(runs),
        "runs": [
            {
                "cache": run.name,
                "server_argv": run.argv,
                "startup_s": run.startup_s,
                "requests": [
                    {
                        "rid": r.rid,
                        "what": r.tag,
                        "prompt_tokens": r.prompt_tokens,
                        "cached_tokens": r.cached_tokens,
                        "prefilled_tokens": r.prefilled_tokens,
                        "completion_tokens": r.completion_tokens,
                        "output": r.output,
                        "ttft_s": None if math.isnan(r.ttft_s) else r.ttft_s,
                        "latency_s": None if math.isnan(r.latency_s) else r.latency_s,
                        "error": r.error,
                    }
                    for r in run.results
                ],
            }
            for run in runs
        ],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def plot(path: Path, runs: list[CacheRun]) -> Path | None:
    """Prefilled tokens per request, one bar per cache (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rids = [r.rid for r in runs[0].results]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for k, run in enumerate(runs):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(rids))]
        ax.bar(xs, [r.prefilled_tokens for r in run.results], width, label=run.name)
    ax.set_xticks(range(len(rids)), rids, rotation=30, ha="right")
    ax.set_ylabel("prompt tokens prefilled (not reused)")
    ax.set_title("Agent session on SGLang: tokens each request had to prefill, per prefix cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
