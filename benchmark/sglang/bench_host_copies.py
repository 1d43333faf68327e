"""Scheduler-thread time of the host tier: asynchronous copies vs copies on the scheduler thread.

    python benchmark/sglang/bench_host_copies.py [--tokens 32768] [--json PATH]

SGLang's real Scheduler on the CPU (``cpu/loop.py``, the token worker: no model compute, so what
is left of each pass is scheduling and the cache), ``--radix-cache hybrid`` with a host tier, run
twice on identical pools: ``--hybrid-host-copy inline`` (every copy on the scheduler thread, as
before issue #13) and ``async`` (copies issued to the host tier's copy worker, polled once per
iteration). One request decodes throughout; meanwhile

1. a ``--tokens``-token conversation finishes: its release writes every block through;
2. an unrelated prompt of the same size pushes those blocks off the device (SGLang's own
   eviction under pool pressure; the blocks stay on the host);
3. the conversation's next turn arrives and resumes from the host: its blocks are restored.

Measured per run: the time the scheduler thread spends inside the cache per pass (every method
SGLang and our hooks call, outermost calls only: p50 / p99 / max microseconds), the longest single
call issuing the write-through and the restore, and the decode stall: the longest decode step in
each window (from the event until its copies retired, any batch: the decode waits for all of
them) beyond the median decode step before it.
Prints the async/inline ratios and writes JSON (``docs/results/host-copies-cpu.json`` by
default). On the CPU the "device" is host memory, so bytes move at memcpy speed on both sides;
the GPU check (``benchmark/gpu/``) times the same protocol on CUDA streams (unverified here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
# The tiny model declares 8k positions; the token worker computes nothing position-dependent.
os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")

# Entry points of the cache on the scheduler thread (SGLang's calls and our hooks').
CACHE_METHODS = (
    "match_prefix",
    "init_load_back",
    "lock",
    "unlock",
    "inc_lock_ref",
    "dec_lock_ref",
    "checkpoint",
    "evict",
    "poll",
    "prefetch_head",
    "path_device_indices",
    "prefix_device_indices",
    "on_release",
    "on_admitted",
    "before_chunked_abort",
    "reserve_inpass",
    "held_for_restores",
)


class CacheClock:
    """Wall time inside the cache per scheduler pass (outermost calls only) and per method."""

    def __init__(self) -> None:
        self.depth = 0
        self.pass_s = 0.0
        self.max_call: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.depth -= 1
                if not self.depth:  # a pass counts outermost calls only
                    self.pass_s += dt
                self.max_call[name] = max(self.max_call.get(name, 0.0), dt)

        return timed

    def take_pass(self) -> float:
        s, self.pass_s = self.pass_s, 0.0
        return s


def _install(clock: CacheClock) -> list[tuple[Any, str, Any]]:
    from sglang_hybrid.sglang.cache import HybridRadixCache
    from sglang_hybrid.sglang.coalesce import Coalescer
    from sglang_hybrid.sglang.host_tier import HostTier

    saved = []
    targets = [(HybridRadixCache, m) for m in CACHE_METHODS]
    targets += [(Coalescer, "select")]
    targets += [(HostTier, "release_lane"), (HostTier, "restore"), (HostTier, "write_snapshot")]
    for cls, name in targets:
        orig = getattr(cls, name)
        saved.append((cls, name, orig))
        label = name if cls is HybridRadixCache else f"{cls.__name__}.{name}"
        setattr(cls, name, clock.wrap(label, orig))
    return saved


def _uninstall(saved: list[tuple[Any, str, Any]]) -> None:
    for cls, name, orig in saved:
        setattr(cls, name, orig)


def run(mode: str, tokens: int, model: Path, device: str = "cpu") -> dict[str, Any]:
    """One run (``mode``: the ``--hybrid-host-copy`` value) on pools on ``device``."""
    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.replay.caches import tiny_kv_bytes_per_token
    from sglang_hybrid.sglang.flags import HybridOptions

    n = tokens
    kv_mib = n * tiny_kv_bytes_per_token(model) / 2**20
    opts = HybridOptions(host_cache_mib=int(4 * kv_mib) + 64, host_copy=mode)  # type: ignore[arg-type]  # a CopyMode string
    clock = CacheClock()
    saved = _install(clock)
    rng = __import__("random").Random(0)

    def toks(k: int) -> list[int]:
        return [rng.randrange(10, 2000) for _ in range(k)]

    sched = InProcessScheduler(
        model,
        worker="tokens",
        device=device,
        radix_cache_backend="hybrid",
        page_size=1,
        chunked_prefill_size=8192,
        max_total_tokens=int(1.25 * n) + 1024,  # conversation + filler overflow it
        max_running_requests=4,
        max_mamba_cache_size=16,
        context_length=n + 4096,
        server_args_attrs={"_hybrid_options": opts},
    )
    passes: list[float] = []
    steps: list[tuple[str, float, str]] = []  # (window, step seconds, forward mode)
    window = "before"

    def step() -> None:
        t0 = time.perf_counter()
        batch = sched.step(idle_check=False)
        dt = time.perf_counter() - t0
        passes.append(clock.take_pass())
        mode_name = str(getattr(getattr(batch, "forward_mode", None), "name", "")) if batch else ""
        steps.append((window, dt, mode_name))

    def until(cond: Callable[[], bool], limit: int = 200_000) -> None:
        for _ in range(limit):
            if cond():
                return
            step()
        host = sched.tree_cache.host_tier
        import faulthandler

        faulthandler.dump_traceback(all_threads=True)  # where a copy worker is stuck
        raise RuntimeError(
            f"{mode}: the scheduler did not reach the condition in window {window!r} "
            f"(waiting {[r.rid for r in sched.scheduler.waiting_queue]}, running "
            f"{[r.rid for r in sched.scheduler.running_batch.reqs]}, host ops {len(host.ops)}, "
            f"backlog {len(host.backlog)}, finished {host.queue.finished()} of "
            f"{len(host.queue)} ({type(host.queue).__name__}), restores {host.restores}, results "
            f"{sorted(sched.results())})"
        )

    try:
        cache = sched.tree_cache
        host = cache.host_tier
        sched.submit("decoder", toks(64), n)  # decodes throughout
        until(lambda: len(steps) >= 40)
        conv = toks(n)
        sched.submit("conv", conv, 8)
        until(lambda: "conv" in sched.results())
        window = "write-through"  # from the step whose release issued it until it retired
        steps[-1] = (window, *steps[-1][1:])
        until(lambda: not host.ops and not host.backlog)
        written = host.written_bytes
        window = "between"
        sched.submit("filler", toks(n), 8)  # pool pressure: conv's blocks go to host-only
        until(lambda: "filler" in sched.results())
        until(lambda: not host.ops and not host.backlog)
        turn2 = conv + list(sched.results()["conv"].output_ids) + toks(32)
        restored0 = host.restored_bytes
        window = "restore"
        sched.submit("turn2", turn2, 4)
        until(lambda: "turn2" in sched.results())
        result = sched.results()["turn2"]
        window = "after"
        sched.abort("decoder")
        until(lambda: not sched.has_work())
    finally:
        sched.close()
        _uninstall(saved)

    def decode(w: str) -> list[float]:
        return [dt for win, dt, m in steps if win == w and m == "DECODE"]

    def every(w: str) -> list[float]:
        return [dt for win, dt, _ in steps if win == w]

    base = statistics.median(decode("before"))
    ordered = sorted(passes)
    out: dict[str, Any] = {
        "mode": mode,
        "device": device,
        "tokens": n,
        "kv_bytes_per_token": tiny_kv_bytes_per_token(model),
        "written_bytes": written,
        "restored_bytes": host.restored_bytes - restored0,
        "turn2_cached_tokens": result.cached_tokens,
        "passes": len(passes),
        "cache_us_per_pass_p50": 1e6 * ordered[len(ordered) // 2],
        "cache_us_per_pass_p99": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "cache_us_per_pass_max": 1e6 * ordered[-1],
        "decode_step_ms_median_before": 1e3 * base,
        "max_call_ms": {k: 1e3 * v for k, v in sorted(clock.max_call.items())},
    }
    for w in ("write-through", "restore"):
        # The running decode waits for every step of the window: its stall is the longest step
        # (whichever batch it ran) beyond a plain decode step.
        d = every(w)
        out[f"steps_in_{w}_window"] = len(d)
        out[f"decode_stall_ms_{w}"] = 1e3 * max(0.0, max(d) - base) if d else 0.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="conversation length (default 32k)")
    p.add_argument("--json", type=Path, default=ROOT / "docs/results/host-copies-cpu.json")
    args = p.parse_args()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.cpu.tiny_model import write_tiny_model
    from sglang_hybrid.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "qwen3_next", "qwen3_next", seed=0)
        runs = {}
        for mode in ("inline", "async"):
            print(f"{mode}: {args.tokens}-token conversation ...", file=sys.stderr, flush=True)
            runs[mode] = run(mode, args.tokens, model)
    report = summarize(runs)
    report["reproduce"] = f"python benchmark/sglang/bench_host_copies.py --tokens {args.tokens}"
    print_report(runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}; reproduce: {report['reproduce']}")
    return 0


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    a, i = runs["async"], runs["inline"]

    def ratio(key: str) -> float:
        return a[key] / i[key] if i[key] else float("nan")

    report = {
        "runs": runs,
        "ratios_async_over_inline": {
            k: ratio(k)
            for k in (
                "cache_us_per_pass_p99",
                "cache_us_per_pass_max",
                "decode_stall_ms_write-through",
                "decode_stall_ms_restore",
            )
        },
        "issue_ms_async": {
            "write_through (HostTier.release_lane)": a["max_call_ms"].get("HostTier.release_lane"),
            "restore (HostTier.restore)": a["max_call_ms"].get("HostTier.restore"),
        },
        "machine": f"{a['device']} pools; on the CPU the device is host memory",
    }
    return report


def print_report(runs: dict[str, dict[str, Any]]) -> None:
    a, i = runs["async"], runs["inline"]

    def ratio(key: str) -> float:
        return a[key] / i[key] if i[key] else float("nan")

    print(f"{'':34s} {'inline':>10s} {'async':>10s} {'ratio':>7s}")
    for key in (
        "cache_us_per_pass_p50",
        "cache_us_per_pass_p99",
        "cache_us_per_pass_max",
        "decode_step_ms_median_before",
        "decode_stall_ms_write-through",
        "decode_stall_ms_restore",
    ):
        print(f"{key:34s} {i[key]:10.1f} {a[key]:10.1f} {ratio(key):7.2f}")
    for name in ("HostTier.release_lane", "HostTier.restore", "init_load_back", "unlock"):
        x, y = i["max_call_ms"].get(name, 0.0), a["max_call_ms"].get(name, 0.0)
        print(f"max call {name:25s} {x:10.2f} {y:10.2f} ms")
    slowest = sorted(a["max_call_ms"].items(), key=lambda kv: -kv[1])[:5]
    print("slowest calls (async): " + ", ".join(f"{k} {v:.2f} ms" for k, v in slowest))
    print(
        f"written {a['written_bytes'] / 2**20:.1f} MiB, restored {a['restored_bytes'] / 2**20:.1f}"
        f" MiB; turn 2 cached {a['turn2_cached_tokens']} (inline {i['turn2_cached_tokens']})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
