"""CPU time inside the prefix cache per scheduler pass: ``hybrid`` against SGLang's ``no_buffer``.

Usage (from the repository root):
  python benchmark/replay/pass_profile.py [--trace mooncake:PATH] [--caches hybrid,no_buffer] \
      [--budget-gib 32 --geometry qwen3-next-80b --device h200 --limit N] \
      [--concurrent [--rounds 2]] [--clock {wall,cpu}] [--json docs/results/pass-profile.json]

Replays the trace (default: the synthetic Mooncake trace at its own arrival times, which keeps a
waiting queue of hundreds of requests for most of the run) through SGLang's real Scheduler once
per cache, one after the other in this process, and measures for every scheduler pass (one
``InProcessScheduler.step``) the wall time spent inside the cache's code:

- every public method of the scheduler's ``tree_cache`` (our ``HybridRadixCache``; SGLang's
  radix cache for ``no_buffer``), outermost call only (a method calling another counts once);
- for ``hybrid`` also every hook our plugin registers with SGLang's ``HookRegistry`` (admission,
  chunking, the waiting-queue coalescer, ...): BEFORE/AFTER/REPLACE hooks whole, AROUND hooks
  without the SGLang function they wrap.

Both include what the cache calls in SGLang (allocator frees, pool copies): that is cache work.
The step's own wall time (scheduler + the replay worker) is reported beside it. Prints p50 / p99 /
mean microseconds per pass and the total, the hybrid / no_buffer ratios, what a typical pass
spends per entry point (the passes between the 40th and 60th percentile of cache time), and
writes the numbers to ``--json``. Timings are wall clock on a shared machine, with one torch
thread: run it on an idle one and compare the ratios, which are measured side by side in one
run. Tensor work (state and index copies) runs synchronously here, in both caches; on a GPU it is
an asynchronous launch.

``--concurrent`` replays each cache in its own process, all at once, each pinned to its own CPU,
in ``--rounds`` rounds (default 2) that swap the CPUs: on a busy machine a neighbour then slows
every cache alike, and a CPU slower than the other slows each cache in one round; the ratios
reported are the geometric mean of the rounds'.

A speed probe runs before and after each cache's replay (``speed_probe``: fixed Python dictionary
work like the index's, fixed torch gathers like SGLang's checkpoints). These machines are shared,
and a neighbour can slow dictionary-heavy Python 2-3x while tensor slicing slows 1.2x (seen on
2026-12-02), which moves the ratios with no change in either cache: the probes go into the JSON,
and a spread above ``PROBE_TOLERANCE`` between them is reported as a run not to quote.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import math
import platform
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sglang_hybrid.replay import cli
from sglang_hybrid.replay.results import percentile

DEFAULT_TRACE = "mooncake:../shared/traces/mooncake_synthetic_trace.jsonl"
# Slowest / fastest probe beyond which a run's ratios are not quoted. Coarse on purpose: back to
# back on a quiet machine the dict probe varied 1.35x (the torch one 1.04x); the moves it is for
# were 2-3x.
PROBE_TOLERANCE = 1.5


def speed_probe() -> dict[str, float]:
    """Seconds (best of five) of two fixed workloads: 400k counter updates and lookups in a
    Python dict (the index's kind of work), and 1M-element torch gathers (SGLang's checkpoint
    slicing). Only their change between probes matters."""
    import torch

    rng = random.Random(0)
    keys = [rng.getrandbits(62) for _ in range(400_000)]
    src = torch.arange(4_000_000, dtype=torch.int32)
    idx = torch.randint(0, 4_000_000, (1_000_000,), generator=torch.Generator().manual_seed(0))

    def dict_work() -> None:
        d: dict[int, int] = {}
        for k in keys:
            d[k] = d.get(k, 0) + 1
        for k in keys:
            d[k] -= 1

    def tensor_work() -> None:
        for _ in range(5):
            src[idx].sum()

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"python_dict_s": best(dict_work), "torch_gather_s": best(tensor_work)}


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class Meter:
    """Time inside the cache's code, outermost entries only; ``pause`` lends time back.

    ``clock``: ``perf_counter`` (wall, the default: what a GPU waits for) or ``thread_time`` (the
    scheduler thread's CPU time: blind to time the machine's neighbours take from it, so an A/B of
    two builds of the same cache resolves smaller differences on a shared machine)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.depth = 0
        self.start = 0.0
        self.total = 0.0
        self.name = ""
        self.by_name: dict[str, float] = {}  # outermost entry point -> seconds, whole run
        # Our hooks pass straight through for SGLang's caches; that is not their cache's time.
        self.hooks_count = True

    def enter(self, name: str) -> None:
        if self.depth == 0:
            self.start = self.clock()
            self.name = name
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            dt = self.clock() - self.start
            self.total += dt
            self.by_name[self.name] = self.by_name.get(self.name, 0.0) + dt

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()

        return wrapper

    def paused(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run from inside the cache's code but not counted (the SGLang function an AROUND
        hook wraps)."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = self.depth
            if depth:
                dt = self.clock() - self.start
                self.total += dt
                self.by_name[self.name] = self.by_name.get(self.name, 0.0) + dt
                self.depth = 0
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth = depth
                if depth:
                    self.start = self.clock()

        return wrapper


def time_plugin_hooks(meter: Meter) -> int:
    """Wrap every hook of ours in SGLang's HookRegistry before it is applied; how many."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_hybrid.sglang import plugin

    plugin.register()
    wrapped = 0
    for target, hooks in HookRegistry._hooks.items():
        for i, (kind, hook, src) in enumerate(hooks):
            mod = getattr(hook, "__module__", "") or ""
            if isinstance(hook, type) or not mod.startswith("sglang_hybrid.sglang"):
                continue  # worker classes and the replay's own hooks are not cache code
            name = f"hook {target.rsplit('.', 2)[-2]}.{target.rsplit('.', 1)[-1]} ({kind.value})"
            hooks[i] = (kind, _timed_hook(meter, hook, kind is HookType.AROUND, name), src)
            wrapped += 1
        HookRegistry._hooks[target] = hooks
    return wrapped


def _timed_hook(meter: Meter, hook: Any, around: bool, name: str) -> Callable[..., Any]:
    timed = meter.timed(hook, name)
    if around:

        def timed_around(original: Any, *a: Any, **k: Any) -> Any:
            if not meter.hooks_count:
                return hook(original, *a, **k)
            return timed(meter.paused(original), *a, **k)

        return timed_around

    def timed_plain(*a: Any, **k: Any) -> Any:
        return timed(*a, **k) if meter.hooks_count else hook(*a, **k)

    return timed_plain


def time_cache_methods(cache: Any, meter: Meter) -> list[str]:
    """Wrap the public methods of one cache instance (instance attributes shadow the class's)."""
    names = []
    for name, attr in inspect.getmembers(type(cache)):
        if name.startswith("_") or not inspect.isfunction(attr):
            continue
        setattr(cache, name, meter.timed(getattr(cache, name), f"cache.{name}"))
        names.append(name)
    return names


def profile(cache: str, trace: Any, settings: Any, meter: Meter) -> dict[str, Any]:
    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.replay.driver import replay

    inside: list[float] = []
    steps: list[float] = []
    per_pass: list[dict[str, float]] = []  # entry point -> seconds, for each pass
    wrapped: list[str] = []
    original = InProcessScheduler.step
    meter.by_name = {}
    meter.hooks_count = cache == "hybrid"

    def step(self: InProcessScheduler, *, idle_check: bool = True) -> Any:
        if not wrapped:
            wrapped.extend(time_cache_methods(self.tree_cache, meter))
        meter.total = 0.0
        before = dict(meter.by_name)
        t0 = meter.clock()
        try:
            return original(self, idle_check=idle_check)
        finally:
            steps.append(meter.clock() - t0)
            inside.append(meter.total)
            got = before.get
            per_pass.append(
                {k: v - got(k, 0.0) for k, v in meter.by_name.items() if v > got(k, 0.0)}
            )

    InProcessScheduler.step = step  # type: ignore[method-assign]  # restored below
    try:
        result = replay(trace, cache, settings)
    finally:
        InProcessScheduler.step = original  # type: ignore[method-assign]  # the restore
    us = np.asarray(inside) * 1e6
    step_us = np.asarray(steps) * 1e6
    inside_us, steps_us = us.tolist(), step_us.tolist()  # percentiles: the replay's definition
    s = result.summary()
    return {
        "cache": cache,
        "passes": len(us),
        "prefill_computed": s.prefill_tokens,
        "cache_us_p50": percentile(inside_us, 50),
        "cache_us_p99": percentile(inside_us, 99),
        "cache_us_mean": float(us.mean()),
        "cache_s_total": float(us.sum() / 1e6),
        "step_us_p50": percentile(steps_us, 50),
        "step_us_p99": percentile(steps_us, 99),
        "step_s_total": float(step_us.sum() / 1e6),
        "methods_timed": len(wrapped),
        "top_entry_points_s": dict(sorted(meter.by_name.items(), key=lambda kv: -kv[1])[:12]),
        "median_passes_us": median_breakdown(inside, per_pass),
    }


def median_breakdown(inside: list[float], per_pass: list[dict[str, float]]) -> dict[str, float]:
    """Microseconds per pass of each entry point, over the passes whose cache time lies between
    the 40th and 60th percentile: what a typical pass (the p50) spends, not the long tail."""
    order = sorted(range(len(inside)), key=inside.__getitem__)
    mid = order[int(0.4 * len(order)) : int(0.6 * len(order))]
    sums: dict[str, float] = {}
    for i in mid:
        for k, v in per_pass[i].items():
            sums[k] = sums.get(k, 0.0) + v
    top = sorted(sums.items(), key=lambda kv: -kv[1])[:8]
    return {k: v / max(1, len(mid)) * 1e6 for k, v in top}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--caches", default="hybrid,no_buffer")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall (default) or cpu: the scheduler thread's CPU time (see Meter)",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="replay each cache in its own process, all at once (see run_concurrently)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --concurrent: rounds, each pinning the caches to the CPUs shifted by one",
    )
    cli._engine_args(parser)
    cli._trace_args(parser)
    cli._budget_args(parser)
    parser.set_defaults(geometry="qwen3-next-80b")
    args = parser.parse_args()
    caches = [c for c in args.caches.split(",") if c]
    unknown = set(caches) - {"hybrid", "no_buffer", "extra_buffer"}
    if unknown:
        parser.error(f"--caches: unknown {sorted(unknown)} (hybrid, no_buffer, extra_buffer)")
    if args.concurrent and len(caches) > 1:
        rows, compiled = [], True
        for r in range(max(1, args.rounds)):
            got, ok = run_concurrently(caches, shift=r)
            for row in got:
                row["round"] = r
            rows.extend(got)
            compiled = compiled and ok
            print(f"round {r + 1}: " + format_ratios(ratios_of(got)), flush=True)
        return report(rows, args, compiled)
    import torch

    # One torch thread (as bench_bookkeeping): on a shared 2-core machine two threads turn a
    # state copy of microseconds into milliseconds, in whichever cache happens to copy.
    torch.set_num_threads(1)
    meter = Meter(CLOCKS[args.clock])
    hooks = time_plugin_hooks(meter)
    trace = cli.load_trace(args.trace, args)
    settings = cli._settings(args, args.budget_gib[0])
    from sglang_hybrid.index import native

    index = native.status()  # compiled (mypyc) or the sources: docs/index.md, "Compiled"
    print(
        f"{len(trace.requests)} requests; {hooks} plugin hooks timed; index "
        f"{'compiled' if index.compiled else 'from its sources'} ({index.reason})",
        flush=True,
    )
    rows = []
    for cache in caches:
        print(f"replaying {cache} ...", flush=True)
        before = speed_probe()
        rows.append(profile(cache, trace, settings, meter))
        r = rows[-1]
        r["speed_probe"] = {"before": before, "after": speed_probe()}
        print(
            f"  {cache}: {r['passes']} passes; cache p50 {r['cache_us_p50']:.0f} us, "
            f"p99 {r['cache_us_p99']:.0f} us, total {r['cache_s_total']:.1f} s "
            f"(steps {r['step_s_total']:.1f} s); prefill computed {r['prefill_computed']:,}",
            flush=True,
        )
        for name, sec in r["top_entry_points_s"].items():
            print(f"    {sec:8.3f} s  {name}")
        print("    a typical pass (40th-60th percentile of cache time), us per pass:")
        for name, us in r["median_passes_us"].items():
            print(f"    {us:8.1f}    {name}")
    return report(rows, args, index.compiled)


def run_concurrently(caches: list[str], shift: int = 0) -> tuple[list[dict[str, Any]], bool]:
    """Each cache replayed by a child running this script with the same arguments, all started
    together, so a neighbour that slows the machine slows every cache alike instead of whichever
    ran then. Child i is pinned to CPU i + ``shift`` (mod the CPUs this process may use): a
    neighbour often loads one CPU more than another (seen: one cache 30 % slower than in the run
    before, the other not), so rounds with shifted pins put each cache on each CPU (``--rounds``,
    whose ratios are combined by their geometric mean). Each child's own output is printed once
    all have finished. Returns the children's rows and whether they ran the index compiled.
    """
    import os
    import subprocess
    import tempfile

    skip = {"--concurrent", "--caches", "--json"}
    argv, drop = [], False
    for a in sys.argv[1:]:
        name = a.split("=", 1)[0]
        if drop:
            drop = False
            continue
        if name in skip:
            drop = name != "--concurrent" and "=" not in a
            continue
        argv.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        cpus = sorted(os.sched_getaffinity(0))
        pins = {}
        for i, cache in enumerate(caches):
            out = Path(tmp) / f"{cache}.json"
            cmd = [sys.executable, __file__, *argv, "--caches", cache, "--json", str(out)]
            pins[cache] = cpus[(i + shift) % len(cpus)]
            if shutil.which("taskset"):  # util-linux; unpinned without it
                cmd = ["taskset", "-c", str(pins[cache]), *cmd]
            log = (Path(tmp) / f"{cache}.log").open("w+")
            runs.append((cache, out, log, subprocess.Popen(cmd, stdout=log, stderr=log)))
        print(
            "replaying at once, one process each: "
            + ", ".join(f"{c} on CPU {p}" for c, p in pins.items())
            + " ...",
            flush=True,
        )
        failed = [cache for cache, _, _, proc in runs if proc.wait() != 0]
        rows, compiled = [], True
        for cache, out, log, _ in runs:
            log.seek(0)
            print(f"--- {cache} ---\n{log.read().rstrip()}", flush=True)
            log.close()
            if cache not in failed:
                data = json.loads(out.read_text())
                for row in data["rows"]:
                    row["cpu"] = pins[cache]
                rows.extend(data["rows"])
                compiled = compiled and data["index_compiled"]
    if failed:
        raise SystemExit(f"replay failed for {', '.join(failed)} (its output is above)")
    return rows, compiled


def report(rows: list[dict[str, Any]], args: argparse.Namespace, compiled: bool) -> int:
    """Print the ratios (over several rounds: the geometric mean of each round's) and the
    probes' spread; write ``--json``."""
    rounds = sorted({r.get("round", 0) for r in rows})
    each = [ratios_of([r for r in rows if r.get("round", 0) == k]) for k in rounds]
    each = [e for e in each if e]
    ratios: dict[str, float] = {}
    if each:
        ratios = {k: math.prod(e[k] for e in each) ** (1 / len(each)) for k in each[0]}
        label = "geometric mean of the rounds" if len(each) > 1 else "cache time per pass"
        print(f"hybrid / no_buffer, {label}: " + format_ratios(ratios))
    spread = probe_spread(rows)
    print(
        "speed probes, slowest / fastest: "
        + ", ".join(f"{k.removesuffix('_s')} {v:.2f}x" for k, v in spread.items())
    )
    if max(spread.values(), default=1.0) > PROBE_TOLERANCE:
        print(
            f"WARNING: the machine's speed moved by more than {PROBE_TOLERANCE:.2f}x during this "
            "run: the ratios above are not comparable; rerun on a quieter machine"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "command": shlex.join(["python", *sys.argv]),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {platform.node()}",
            "index_compiled": compiled,
            "clock": args.clock,
            "concurrent": bool(args.concurrent),
            "rows": rows,
            "ratios_hybrid_over_no_buffer": ratios,
            "ratios_per_round": each,
            "speed_probe_spread": spread,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def ratios_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """hybrid / no_buffer per-pass cache time (p50, p99, mean) of one replay of each, if both."""
    by = {r["cache"]: r for r in rows}
    if "hybrid" not in by or "no_buffer" not in by:
        return {}
    h, n = by["hybrid"], by["no_buffer"]
    keys = ("cache_us_p50", "cache_us_p99", "cache_us_mean")
    return {k: h[k] / n[k] if n[k] else float("inf") for k in keys}


def format_ratios(ratios: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('cache_us_')} {v:.2f}x" for k, v in ratios.items())


def probe_spread(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Slowest over fastest of every probe of the run, per workload."""
    probes = [p for r in rows for p in r["speed_probe"].values()]
    return (
        {k: max(p[k] for p in probes) / min(p[k] for p in probes) for k in probes[0]}
        if probes
        else {}
    )


if __name__ == "__main__":
    sys.exit(main())
