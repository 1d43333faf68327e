"""The replay benchmarks behind ``docs/benchmarks.md``: each one a fixed ``replay run`` command.

Usage (from the repository root):
``python benchmark/replay/bench_replay.py NAME [--dry-run] [extra replay-run args]``

Runs ``sglang-hybrid replay run`` with the arguments listed under NAME and writes the report to
``docs/results/replay/NAME/`` (report.json, report.md with the exact command, two PNGs).
``--dry-run`` prints the command instead. Names: see ``RUNS``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sglang_hybrid.replay import cli

ROOT = Path(__file__).resolve().parents[2]
# Paths as the docs write them: relative to the repository root, where this script must run.
MOONCAKE = "../shared/traces/mooncake_synthetic_trace.jsonl"
ALL = "hybrid,no_buffer,extra_buffer,oracle"

# Shared pieces: the trace and modelled machine of each family, and the options a run pins.
MC = [f"--trace=mooncake:{MOONCAKE}"]
MC_X4 = [*MC, "--time-scale=4"]
NEXT_H200 = ["--geometry=qwen3-next-80b", "--device=h200"]
AGENT = ["--trace=agent", "--sessions=24", "--geometry=qwen3.5-27b", "--device=h200"]
LADDER = ["--tap-ladder=4096", "--tap-min-gap=1024", "--taps-per-request=4"]
BEFORE_COALESCING = ["--no-coalesce"]  # recorded before coalescing existed (docs/benchmarks.md)

RUNS: dict[str, list[str]] = {
    # The whole synthetic Mooncake trace at its own arrival times, one H200 serving an
    # 80B-A3B-class hybrid: the trace's load saturates it (queues of minutes).
    "mooncake": [*MC, *NEXT_H200, "--budget-gib", "32", f"--caches={ALL}", *BEFORE_COALESCING],
    # The same trace with arrivals stretched 4x (a quarter of the load), over budgets.
    "mooncake-x4": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "16",
        "32",
        "64",
        f"--caches={ALL}",
        *BEFORE_COALESCING,
    ],
    # Host tier on: hybrid gets 32 GiB device + 96 GiB host, SGLang's caches 128 GiB device.
    "mooncake-host": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "32",
        "--host-gib=96",
        f"--caches={ALL}",
        *BEFORE_COALESCING,
    ],
    # "mooncake" for hybrid with in-flight coalescing (the default).
    "mooncake-coalesce": [*MC, *NEXT_H200, "--budget-gib", "32", "--caches=hybrid"],
    # The 32 GiB point of "mooncake-x4" for hybrid with in-flight coalescing (the default).
    "mooncake-x4-coalesce": [*MC_X4, *NEXT_H200, "--budget-gib", "32", "--caches=hybrid"],
    # Host tier on: hybrid gets 16 GiB device + 48 GiB host, SGLang's caches 64 GiB device.
    "agent-host": [*AGENT, "--budget-gib", "16", "--host-gib=48", f"--caches={ALL}"],
    # The generated agent workload on a 27B-class hybrid, over budgets up to one that holds
    # its working set.
    "agent": [*AGENT, "--budget-gib", "16", "32", "64", "128", f"--caches={ALL}"],
    # bench_serving's generated-shared-prefix shape at its defaults (64 groups x 16 prompts,
    # 2048-token system prompts, all arriving at once): SGLang issue 28222's case.
    "shared-prefix": [
        "--trace=shared-prefix",
        "--geometry=qwen3.5-27b",
        "--device=h200",
        "--budget-gib",
        "32",
        f"--caches={ALL}",
    ],
    # Exploration, not a default: the hybrid backend with a denser tap ladder and four taps per
    # prompt on the stretched Mooncake trace (its taps are the knob that decides hint-less
    # traffic); "agent-ladder" checks the same options on the agent workload.
    "mooncake-x4-ladder": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "32",
        "--caches=hybrid",
        *LADDER,
        *BEFORE_COALESCING,
    ],
    "agent-ladder": [
        *AGENT,
        "--budget-gib",
        "16",
        "32",
        "64",
        "128",
        "--caches=hybrid",
        *LADDER,
        *BEFORE_COALESCING,
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(RUNS))
    parser.add_argument("--dry-run", action="store_true")
    args, extra = parser.parse_known_args()
    if Path.cwd().resolve() != ROOT:
        raise SystemExit(f"run this from the repository root ({ROOT})")
    argv = ["run", *RUNS[args.name], f"--out=docs/results/replay/{args.name}", *extra]
    if args.dry_run:
        print(f"{cli.PROG} {shlex.join(argv)}")
        return 0
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
