"""The replay benchmarks behind ``docs/benchmarks.md``: each one a fixed ``replay run`` command.

Usage (from the repository root):
``python benchmark/replay/bench_replay.py NAME [--dry-run] [extra replay-run args]``

Runs ``sglang-hybrid replay run`` with the arguments listed under NAME and writes the report to
``docs/results/replay/NAME/`` (report.json, report.md with the exact command, two PNGs).
``--dry-run`` prints the command instead. Names: see ``RUNS``.

``steady-state`` (``STEADY``) runs several commands: each traffic twice, from flushed pools and
with the pools pre-filled by unrelated traffic (``--prefill-pool``), into
``docs/results/replay/steady-state/TRAFFIC-{flushed,prefilled}/``, then writes the side-by-side
comparison ``steady_state.json`` / ``steady_state.md`` there (``sglang_hybrid.replay.steady``).

``tap-modes`` (``TAP_MODES``) runs each traffic in each of ``MODES`` (the replay's default with
no_buffer beside it, in-pass capture on the 64-token grid and anywhere, every tap splitting)
into ``docs/results/replay/tap-modes/TRAFFIC-MODE/`` and writes ``tap_modes.json`` /
``tap_modes.md`` (``sglang_hybrid.replay.tap_modes``). ``--only TRAFFIC`` (repeatable) runs a
subset and compares what the folder holds (with ``--reuse``, the others' reports).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_hybrid.replay import cli, steady, tap_modes

ROOT = Path(__file__).resolve().parents[2]
# Paths as the docs write them: relative to the repository root, where this script must run
# (a worktree elsewhere names the shared folder in SGLANG_HYBRID_SHARED).
SHARED = os.environ.get("SGLANG_HYBRID_SHARED", "../shared")
MOONCAKE = f"{SHARED}/traces/mooncake_synthetic_trace.jsonl"
ALL = "hybrid,no_buffer,extra_buffer,oracle"

# Shared pieces: the trace and modelled machine of each family, and the options a run pins.
MC = [f"--trace=mooncake:{MOONCAKE}"]
MC_X4 = [*MC, "--time-scale=4"]
NEXT_H200 = ["--geometry=qwen3-next-80b", "--device=h200"]
AGENT = ["--trace=agent", "--sessions=24", "--geometry=qwen3.5-27b", "--device=h200"]
LADDER = ["--tap-ladder=4096", "--tap-min-gap=1024", "--taps-per-request=4"]
# The ladder explorations were recorded before coalescing existed (docs/benchmarks.md, History).
BEFORE_COALESCING = ["--no-coalesce"]

RUNS: dict[str, list[str]] = {
    # The whole synthetic Mooncake trace at its own arrival times, one H200 serving an
    # 80B-A3B-class hybrid: the trace's load saturates it (queues of minutes).
    "mooncake": [*MC, *NEXT_H200, "--budget-gib", "32", f"--caches={ALL}"],
    # The same trace with arrivals stretched 4x (a quarter of the load), over budgets.
    "mooncake-x4": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "16",
        "32",
        "64",
        f"--caches={ALL}",
    ],
    # Host tier on: hybrid gets 32 GiB device + 96 GiB host, SGLang's caches 128 GiB device.
    "mooncake-host": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "32",
        "--host-gib=96",
        f"--caches={ALL}",
    ],
    # L3 as a third tier (issue #39): hybrid with a small host tier (16 GiB device + 16 GiB host)
    # alone and with a shared store of 256 GiB behind it, its transfers timed at Mooncake's
    # published RoCE and TCP rates (replay/l3_model.py); the report's L3 table says what writing
    # at host eviction would have written instead of writing through.
    "mooncake-l3": [
        *MC_X4,
        *NEXT_H200,
        "--budget-gib",
        "16",
        "--host-gib=16",
        "--l3-gib=256",
        "--caches=hybrid,hybrid+l3-tcp,hybrid+l3-rdma",
    ],
    # Hint-less multi-turn chat at load (issue #37): hybrid with a host tier against SGLang's
    # caches on the same bytes and the free-state LRU bound (the budget's bytes as KV, states
    # free).
    "chat-host": [
        "--trace=chat",
        "--geometry=qwen3.5-27b",
        "--device=h200",
        "--budget-gib",
        "32",
        "--host-gib=96",
        f"--caches={ALL},lru",
    ],
    # Prompts re-sending a prefix of an earlier one (issue #37: whole 512-token blocks, a prefix
    # and a new question, a prompt without its last message), hint-less, device only.
    "prefixes": [
        "--trace=prefixes",
        "--geometry=qwen3.5-27b",
        "--device=h200",
        "--budget-gib",
        "16",
        "32",
        f"--caches={ALL}",
    ],
    # Host tier on: hybrid gets 16 GiB device + 48 GiB host, SGLang's caches 64 GiB device.
    "agent-host": [*AGENT, "--budget-gib", "16", "--host-gib=48", f"--caches={ALL}"],
    # The generated agent workload on a 27B-class hybrid, over budgets up to one that holds
    # its working set.
    "agent": [*AGENT, "--budget-gib", "16", "32", "64", "128", f"--caches={ALL}"],
    # The same workload as hint-less token-id traffic (no template hints reach the cache): what
    # a /generate client or a router sends. SGLang's caches read no hints; they run again so
    # every row of the report is side by side.
    "agent-hintless": [
        *AGENT,
        "--budget-gib",
        "16",
        "32",
        "64",
        "128",
        f"--caches={ALL}",
        "--drop-hints",
    ],
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


# Steady state (docs/benchmarks.md, "Steady state"): 16 agent sessions starting within ~16 s
# (session rate 1/s: every session overlaps the others; subagents and fan-outs released
# together), hybrid against SGLang's no_buffer on the same 64 GiB of the 27B geometry, a budget
# where this workload's working set fits (the flushed hybrid run evicts ~300 of its blocks). The
# same traffic twice: with the template's tap hints, and as hint-less token-id traffic, for
# hybrid only (no_buffer reads no hints: its replay is the same either way).
STEADY_BASE = [
    "--trace=agent",
    "--sessions=16",
    "--session-rate=1",
    "--geometry=qwen3.5-27b",
    "--device=h200",
    "--budget-gib",
    "64",
]
STEADY: dict[str, dict[str, list[str]]] = {
    "steady-state": {
        "hinted": [*STEADY_BASE, "--caches=hybrid,no_buffer"],
        "hint-less": [*STEADY_BASE, "--caches=hybrid", "--drop-hints"],
    },
}
VARIANTS = {"flushed": [], "prefilled": ["--prefill-pool"]}


def run_steady(name: str, extra: list[str], dry_run: bool, reuse: bool = False) -> int:
    """Every traffic of ``name`` flushed and pre-filled, then the side-by-side comparison."""
    out = Path("docs/results/replay") / name
    plan = [
        (traffic, variant, ["run", *base, *flags, f"--out={out}/{traffic}-{variant}", *extra])
        for traffic, base in STEADY[name].items()
        for variant, flags in VARIANTS.items()
    ]

    def finish(reports: dict[tuple[str, str], Any]) -> dict[str, Any]:
        return steady.compare(
            [(t, reports[t, "flushed"], reports[t, "prefilled"]) for t in STEADY[name]]
        )

    return run_family(name, out, plan, extra, dry_run, finish, steady.write, reuse)


# Tap modes (docs/benchmarks.md, "Taps inside the pass"): the committed agent workload at every
# budget, the whole Mooncake trace at its own arrivals and at a quarter of the load, in the
# replay's default (auto as on an H200 today), in-pass on each request's 64-token grid (what auto
# picks there once the GPU check's stage I passed), in-pass anywhere, and every exact tap
# splitting (the agent only: the behaviour before issue #36); no_buffer runs once, beside the
# default, as the yardstick (it takes no taps).
TAP_MODES: dict[str, list[str]] = {
    "agent": [*AGENT, "--budget-gib", "16", "32", "64", "128"],
    "mooncake": [*MC, *NEXT_H200, "--budget-gib", "32"],
    # One budget: at a quarter of the load a Mooncake replay takes 5-18 min per cache on this
    # 2-core machine (mooncake-x4 has the sweep over budgets for the default mode).
    "mooncake-x4": [*MC_X4, *NEXT_H200, "--budget-gib", "32"],
}
MODES = {
    "auto": ["--caches=hybrid,no_buffer"],
    "chunk": ["--tap-mode=zero-split", "--capture-grid=chunk", "--caches=hybrid"],
    "zero_split": ["--tap-mode=zero-split", "--caches=hybrid"],
    "split": ["--tap-mode=split", "--split-threshold=0", "--caches=hybrid"],
}
# Every-tap splitting is history (on Mooncake see the docs' History); Mooncake's hint-less taps
# lie on the block grid, where the chunk-grid variant captures what capture anywhere does: run
# at its own arrivals only, to show it.
SKIPPED = {("mooncake", "split"), ("mooncake-x4", "split"), ("mooncake-x4", "chunk")}


def run_tap_modes(
    name: str, extra: list[str], dry_run: bool, reuse: bool = False, only: list[str] | None = None
) -> int:
    """Every traffic of ``TAP_MODES`` in its modes, then the side-by-side comparison (``only``:
    run these traffics, keep the reports of the others)."""
    out = Path("docs/results/replay") / name
    plan = [
        (traffic, mode, ["run", *base, *flags, f"--out={out}/{traffic}-{mode}", *extra])
        for traffic, base in TAP_MODES.items()
        for mode, flags in MODES.items()
        if (traffic, mode) not in SKIPPED
    ]

    def finish(reports: dict[tuple[str, str], Any]) -> dict[str, Any]:
        return tap_modes.compare(
            [
                (t, {m: reports[t, m] for m in MODES if (t, m) in reports})
                for t in TAP_MODES
                if any((t, m) in reports for m in MODES)
            ]
        )

    keep = None if not only else {t for t in TAP_MODES if t not in only}
    return run_family(name, out, plan, extra, dry_run, finish, tap_modes.write, reuse, keep)


def run_family(
    name: str,
    out: Path,
    plan: list[tuple[str, str, list[str]]],
    extra: list[str],
    dry_run: bool,
    finish: Callable[[dict[tuple[str, str], Any]], dict[str, Any]],
    write: Callable[..., Path],
    reuse: bool = False,
    keep: set[str] | None = None,
) -> int:
    """Run ``plan`` (traffic, variant, ``replay`` argv), compare the reports with ``finish`` and
    write the comparison with ``write(out, doc, header)``; the header records every command.
    ``reuse``: keep the reports a previous run left (same output folders) instead of rerunning;
    ``keep``: traffics whose reports are kept whether or not ``reuse`` is given."""
    if dry_run:
        for *_, argv in plan:
            print(f"{cli.PROG} {shlex.join(argv)}")
        return 0
    started = time.perf_counter()
    for i, (traffic, variant, argv) in enumerate(plan, 1):
        kept = (out / f"{traffic}-{variant}" / "report.json").exists()
        if keep is not None and traffic in keep and not kept:
            print(f"[{i}/{len(plan)}] {traffic}, {variant}: not run (--only)", flush=True)
            continue
        if kept and (reuse or (keep is not None and traffic in keep)):
            print(f"[{i}/{len(plan)}] {traffic}, {variant}: kept (--reuse)", flush=True)
            continue
        print(f"[{i}/{len(plan)}] {traffic}, {variant}", flush=True)
        if rc := cli.main(argv):
            return rc
    wall = time.perf_counter() - started
    files = {(t, v): out / f"{t}-{v}" / "report.json" for t, v, _ in plan}
    reports = {k: json.loads(f.read_text()) for k, f in files.items() if f.exists()}
    doc = finish(reports)
    doc["wall_s"] = wall
    doc["date"] = datetime.date.today().isoformat()
    doc["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"
    header = "\n".join(
        [
            f"### {name}",
            "",
            "```",
            f"python benchmark/replay/bench_replay.py {shlex.join([name, *extra])}",
            *(f"{cli.PROG} {shlex.join(argv)}" for *_, argv in plan),
            "```",
            "",
            f"date: {doc['date']}; machine: {doc['machine']}; the {len(plan)} commands: "
            f"{wall:.0f} s. Target: {doc['target']}.",
        ]
    )
    md = write(out, doc, header)
    print(md.read_text())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted([*RUNS, *STEADY, "tap-modes"]))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="steady-state, tap-modes: keep the reports of commands that already ran",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(TAP_MODES),
        help="tap-modes: run this traffic only (repeatable), keep the others' reports",
    )
    args, extra = parser.parse_known_args()
    if Path.cwd().resolve() != ROOT:
        raise SystemExit(f"run this from the repository root ({ROOT})")
    if args.name in STEADY:
        return run_steady(args.name, extra, args.dry_run, args.reuse)
    if args.name == "tap-modes":
        return run_tap_modes(args.name, extra, args.dry_run, args.reuse, args.only)
    argv = ["run", *RUNS[args.name], f"--out=docs/results/replay/{args.name}", *extra]
    if args.dry_run:
        print(f"{cli.PROG} {shlex.join(argv)}")
        return 0
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
