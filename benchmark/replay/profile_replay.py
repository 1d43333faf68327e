"""Where a replay's wall time goes: cProfile of one cache over a trace, grouped by layer.

Usage:
  python benchmark/replay/profile_replay.py --trace mooncake:PATH --cache hybrid --limit 300 \
      [--budget-gib 32 --geometry qwen3-next-80b --top 25 --save out/replay.prof]

Prints the wall time, the share of it spent in SGLang's scheduler code, our cache backend and
index, the workers, the replay driver (including the oracle), and torch ops, then the top
functions by own time. Uses the same argument parsing as ``sglang-hybrid replay run``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from sglang_hybrid.replay import cli
from sglang_hybrid.replay.driver import replay

GROUPS = (
    ("sglang scheduler, pools, caches", "site-packages/sglang/"),
    ("our backend: sglang_hybrid/sglang + store", "sglang_hybrid/sglang/"),
    ("our backend: sglang_hybrid/store", "sglang_hybrid/store/"),
    ("our index", "sglang_hybrid/index/"),
    ("CPU worker", "sglang_hybrid/cpu/"),
    ("replay driver, worker, oracle", "sglang_hybrid/replay/"),
    ("torch", "site-packages/torch/"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--cache", default="hybrid")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--save", default=None, help="also write the raw profile here (pstats; snakeviz reads it)"
    )
    cli._engine_args(parser)
    cli._trace_args(parser)
    cli._budget_args(parser)
    args = parser.parse_args()
    trace = cli.load_trace(args.trace, args)
    settings = cli._settings(args, args.budget_gib[0])
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    result = replay(trace, args.cache, settings)
    prof.disable()
    wall = time.perf_counter() - start
    s = result.summary()
    print(
        f"{args.cache}: {s.requests} requests, {s.prompt_tokens:,} prompt tokens, "
        f"{result.passes} passes ({result.extend_passes} prefill, {result.decode_passes} "
        f"decode) in {wall:.1f} s wall ({result.wall_s:.1f} s in the replay loop)"
    )
    if args.save:
        prof.dump_stats(args.save)
    stats = pstats.Stats(prof)
    own: dict[str, float] = {}
    total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]  # set at runtime, not in typeshed
        total += tottime
        group = next((g for g, key in GROUPS if key in filename), "other (python, numpy, builtins)")
        own[group] = own.get(group, 0.0) + tottime
    print("\nown time by layer:")
    for group, t in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {t:8.1f} s  {100 * t / total:5.1f} %  {group}")
    print()
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
