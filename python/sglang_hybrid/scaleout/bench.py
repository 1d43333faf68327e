"""Reuse and TTFT through SGLang's router: N workers per policy against one server.

``sglang-hybrid scaleout`` (or ``python -m sglang_hybrid.scaleout``) ``[--workloads agent,mooncake]
[--workers 1,2,4] [--policies ...] [--topologies servers,dp]``

For each worker count N it starts N CPU servers (``--radix-cache hybrid``, the token worker: it
computes nothing and answers deterministic tokens, so a run measures routing and caching, not a
model) that split one memory budget N ways (``--total-kv-tokens``, default ``TOTAL_KV_TOKENS``;
``--total-slots``, default ``TOTAL_SLOTS`` state slots), behind SGLang's router. N = 1 is the
reference: one server with the whole budget. Running requests per server stay at ``RUNNING``
(compute grows with the servers; memory does not). For each policy the router is restarted (its
tree starts empty), every server's cache flushed, and the workload sent with ``replay/live.py``.
Topologies (``--topologies``): ``servers``, N servers behind the router; ``dp``, one server with
``--dp-size N`` (SGLang's DP controller, N scheduler processes, each rank with its own cache and
the per-server budgets above) behind the router with ``--dp-aware``, which addresses every rank
itself (``url@rank``), so the policies below place requests on ranks as on servers. Policies:

- ``cache_aware``, ``round_robin``: the router alone, requests as a client sends them;
- ``cache_aware_balanced``: ``cache_aware`` balancing past ``RUNNING`` requests of imbalance
  rather than the router's default 64 (``ROUTER_POLICY``);
- ``consistent_hashing``: each request carries ``X-SMG-Routing-Key`` = its affinity key
  (``placement.affinity_key``: the session, else a digest of the first 512 token ids);
- ``resume_aware``: ``placement.ResumeAwarePlacement`` — the deepest resume point the workers
  report over ``/hybrid/boundaries``, sent through the router's target-worker header.

L3 (``--l3 off,mooncake``): ``mooncake`` runs every fleet again with a shared L3, a real
Mooncake Store on loopback (``shared_store.py``, ``--l3-mib`` of memory) that every server writes
through to and looks up (``--hybrid-l3``; it needs the host tier, ``--total-host-mib``). The store
is emptied before every run, after the servers are flushed, so a run reuses only what its own
requests stored. The reference stays one server with all the memory and no L3; one server with
L3 is run beside it.

Workloads (token ids to ``/generate``, no template hints): ``agent``, the replay's agent sessions
(``--agent-sessions``, a session a second, think and tool times compressed 20x), and ``mooncake``,
the first ``--mooncake-requests`` requests of the synthetic Mooncake trace at its own arrival
times. Reuse is cached prompt tokens as the servers report them; each run also records every
server's share of the prompt tokens (``/metrics``), which shows what a policy's balance costs.

Writes ``scale_out.json``, ``scale_out.md`` and ``scale_out.png`` to ``--out``; servers' and
routers' logs and per-request results to ``--raw``. Live runs are not repeatable to the token
(requests meet in batches by wall-clock arrival), so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sglang_hybrid.cpu.server import ServerConfig, ServerError
from sglang_hybrid.replay.live import LiveRequest, from_trace, run_replay, summarize
from sglang_hybrid.replay.results import percentile

from .fleet import Fleet, WorkerCounters
from .placement import ResumeAwarePlacement, keyed
from .router import RouterConfig
from .shared_store import L3_MODES, SharedStore

TOTAL_KV_TOKENS = 4 * 98_304  # the longest Mooncake prompt of the slice fits one of four servers
TOTAL_SLOTS = 64
RUNNING = 4
CHUNK = 2048
CONTEXT = 98_304
POLICIES = (
    "cache_aware",
    "cache_aware_balanced",
    "round_robin",
    "consistent_hashing",
    "resume_aware",
)
# What each measured policy runs on the router: (its policy, extra router flags).
ROUTER_POLICY: dict[str, tuple[str, list[str]]] = {
    # The router starts balancing only past 64 requests in flight (--balance-abs-threshold): at a
    # few requests per server that is never, and cache_aware sends everything that shares a
    # prefix to one server. Balanced: past one server's batch (RUNNING) of imbalance instead.
    "cache_aware_balanced": ("cache_aware", ["--balance-abs-threshold", str(RUNNING)]),
    "resume_aware": ("consistent_hashing", []),
}
WORKLOADS = ("agent", "mooncake")
TOPOLOGIES = ("servers", "dp")
MOONCAKE = "../shared/traces/mooncake_synthetic_trace.jsonl"
PACE = 0.05  # agent think / tool times compressed 20x, as live_steady_state.py
CONCURRENCY = 16
STORE_SETTLE_S = 2.0  # after a run, before reading what the L3 store holds


@dataclass(slots=True)
class RunResult:
    workload: str
    workers: int
    policy: str
    summary: dict[str, Any]
    ttft_p90_s: float
    wall_s: float
    per_worker: list[dict[str, int]] = field(default_factory=list)  # per server, or DP rank
    resume_placed: int | None = None  # resume_aware: requests sent where a worker could resume
    topology: str = "servers"  # or "dp": one server, ``workers`` DP ranks, router --dp-aware
    l3: str = "off"  # or "mooncake": the servers share an L3 (``--hybrid-l3``)
    store: dict[str, int] | None = None  # the L3 store after the run: objects, nbytes, evicted

    @property
    def where(self) -> str:
        """The fleet in words: ``2`` (servers) or ``dp 2`` (one server's DP ranks)."""
        return f"dp {self.workers}" if self.topology == "dp" else str(self.workers)

    @property
    def label(self) -> str:
        """The policy, with `` + L3`` when the fleet shares one."""
        return self.policy if self.l3 == "off" else f"{self.policy} + L3"


def _say(msg: str) -> None:
    print(f"[scale-out {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(name: str, args: argparse.Namespace) -> list[LiveRequest]:
    if name == "agent":
        from sglang_hybrid.replay.generators.workload import agent_workload

        trace = agent_workload(sessions=args.agent_sessions, session_rate_per_s=1.0, seed=0)
    elif name == "mooncake":
        from sglang_hybrid.replay.traces.mooncake import load_mooncake

        path = Path(args.mooncake)
        if not path.is_file():
            raise SystemExit(f"the Mooncake trace {path} is missing: pass --mooncake PATH")
        trace = load_mooncake(path, seed=0, limit=args.mooncake_requests)
    else:
        raise SystemExit(f"workload {name!r}: expected one of {', '.join(WORKLOADS)}")
    return from_trace(trace)


def server_config(
    model: Path, workers: int, kv_tokens: int, slots: int, host_mib: int = 0, l3: str = ""
) -> ServerConfig:
    """One of ``workers`` servers sharing the budgets evenly (KV tokens, state slots, host MiB);
    ``l3``: the shared store's ``--hybrid-l3`` URL, if any."""
    return ServerConfig(
        model,
        cache="hybrid",
        worker="tokens",
        max_total_tokens=kv_tokens // workers,
        max_mamba_cache_size=slots // workers,
        max_running_requests=RUNNING,
        chunked_prefill_size=CHUNK,
        host_cache_mib=host_mib // workers,
        extra=["--context-length", str(CONTEXT), *(["--hybrid-l3", l3] if l3 else [])],
    )


def _one_run(
    fleet: Fleet,
    name: str,
    reqs: list[LiveRequest],
    policy: str,
    raw: Path,
    topology: str,
    store: SharedStore | None = None,
) -> RunResult:
    n = sum(s.config.dp_size for s in fleet.servers)
    router_policy, extra = ROUTER_POLICY.get(policy, (policy, []))
    fleet.use_policy(router_policy, extra)
    fleet.flush()
    if store is not None:
        store.clear()  # after the flush: nothing of an earlier run is written after this
    before = fleet.counters()
    placement = None
    if policy in ("consistent_hashing", "resume_aware"):
        reqs = keyed([replace(r, headers={}) for r in reqs])  # the bodies stay shared
    if policy == "resume_aware":
        assert fleet.router is not None
        order = [w["url"] for w in fleet.router.workers()]
        placement = ResumeAwarePlacement([s.url for s in fleet.servers], order)
    t0 = time.monotonic()
    results = run_replay(
        fleet.url,
        reqs,
        concurrency=CONCURRENCY,
        time_scale=PACE if name == "agent" else 1.0,
        route=placement,
    )
    wall = time.monotonic() - t0
    after = fleet.counters()
    per_worker = []
    for b, a in zip(before, after, strict=True):
        d = (a - b) if a is not None and b is not None else WorkerCounters(0, 0)
        per_worker.append({"prompt_tokens": d.prompt_tokens, "cached_tokens": d.cached_tokens})
    summary = summarize(results)
    ttfts = [r.ttft_s for r in results if r.error is None and r.ttft_s == r.ttft_s]
    l3 = "off" if store is None else "mooncake"
    suffix = "" if store is None else "-l3"
    out = raw / f"{name}-{n}{'dp' if topology == 'dp' else 'w'}-{policy}{suffix}.json"
    out.write_text(json.dumps([asdict(r) for r in results]))
    usage = None
    if store is not None:
        time.sleep(STORE_SETTLE_S)  # the write-through of the last requests
        usage = store.usage()._asdict()
    return RunResult(
        name,
        n,
        policy,
        summary,
        percentile(ttfts, 90),
        wall,
        per_worker,
        placement.placed_by_resume if placement is not None else None,
        topology,
        l3,
        usage,
    )


def run(args: argparse.Namespace, on_result: Callable[[RunResult], None]) -> list[RunResult]:
    from sglang_hybrid.cpu.tiny_model import write_tiny_model

    raw = Path(args.raw)
    raw.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(raw / "tiny", "qwen3_next", seed=0)
    loads = {w: workload(w, args) for w in args.workloads}
    with contextlib.ExitStack() as stack:
        store = None
        if "mooncake" in args.l3:
            _say(f"a Mooncake Store on loopback with {args.l3_mib:,} MiB (logs in {raw / 'l3'})")
            store = stack.enter_context(SharedStore(raw / "l3", args.l3_mib))
        results = _run_fleets(args, model, loads, raw, store, on_result)
    return results


def _run_fleets(
    args: argparse.Namespace,
    model: Path,
    loads: dict[str, list[LiveRequest]],
    raw: Path,
    store: SharedStore | None,
    on_result: Callable[[RunResult], None],
) -> list[RunResult]:
    results: list[RunResult] = []
    router = RouterConfig(worker_urls=[], health_check_interval_s=5)
    # One server with all the memory (and no L3) is the reference of every topology.
    fleets = [(1, "servers", mode) for mode in args.l3] + [
        (n, t, mode) for n in args.workers if n > 1 for t in args.topologies for mode in args.l3
    ]
    for n, topology, mode in fleets:
        policies = ("round_robin",) if n == 1 else tuple(args.policies)
        kv, slots = args.total_kv_tokens, args.total_slots
        host = args.total_host_mib
        what = f"one server with {n} DP ranks" if topology == "dp" else f"{n} server(s)"
        shared = store if mode == "mooncake" else None
        _say(
            f"{what}, {kv // n:,} KV tokens, {slots // n} slots and "
            f"{host // n} MiB of host tier each"
            + (f", sharing {args.l3_mib:,} MiB of Mooncake Store" if shared else "")
        )
        cfg = server_config(model, n, kv, slots, host, shared.url if shared else "")
        fdir = raw / (f"{n}dp" if topology == "dp" else f"{n}w") / mode
        if topology == "dp":
            # Every DP rank builds its own pools from the server's arguments: the same per-rank
            # budgets as one of n servers.
            configs, fleet_router = [replace(cfg, dp_size=n)], replace(router, dp_aware=True)
        else:
            configs, fleet_router = [cfg] * n, router
        fdir.mkdir(parents=True, exist_ok=True)
        fleet = _start_fleet(configs, policies[0], fdir, fleet_router)
        try:
            for name, reqs in loads.items():
                for policy in policies:
                    label = policy if n > 1 else "single"
                    _say(f"{name}: {len(reqs)} requests, {what}, {label}, L3 {mode}")
                    r = _one_run(fleet, name, reqs, policy, raw, topology, shared)
                    if n == 1:
                        r.policy = "single"
                    results.append(r)
                    on_result(r)
        finally:
            fleet.stop()
    return results


def _start_fleet(
    configs: list[ServerConfig], policy: str, fdir: Path, router: RouterConfig
) -> Fleet:
    """A started fleet. A server that does not come up gets one more try, the whole fleet
    restarted (on these shared machines a start once stalled past its 600 s)."""
    for attempt in (1, 2):
        fleet = Fleet(configs, policy, fdir / f"start{attempt}", router=router, on_progress=_say)
        (fdir / f"start{attempt}").mkdir(parents=True, exist_ok=True)
        try:
            fleet.start()
            return fleet
        except ServerError as e:
            fleet.stop()
            if attempt == 2:
                raise
            _say(f"the fleet did not start ({str(e).splitlines()[0]}); starting it again")
    raise AssertionError("unreachable")


def _show(r: RunResult) -> None:
    s = r.summary
    l3 = f", {s.get('l3_tokens', 0):,} from L3" if r.l3 != "off" else ""
    _say(
        f"  {r.workload} {r.where} {r.label}: cached {s['cached_tokens']:,} of "
        f"{s['prompt_tokens']:,} ({s['reuse']:.1%}){l3}, TTFT p50 "
        f"{s['ttft_p50_s'] * 1e3:.0f} ms, {s['failed']} failed, {r.wall_s:.0f} s"
    )


def table(results: Sequence[RunResult]) -> str:
    single = {r.workload: r for r in results if r.policy == "single" and r.l3 == "off"}
    with_l3 = any(r.l3 != "off" for r in results)
    lines = [
        "| workload | servers (dp N: one server's DP ranks) | policy | cached tokens | reuse | "
        "of one server's reuse | busiest server's prompt share | TTFT p50 | TTFT p90 | failed |"
        + (" from L3 | L3 objects after |" if with_l3 else ""),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if with_l3 else ""),
    ]
    for r in results:
        s = r.summary
        ref = single.get(r.workload)
        kept = (
            f"{s['cached_tokens'] / ref.summary['cached_tokens']:.1%}"
            if ref is not None and ref.summary["cached_tokens"]
            else "-"
        )
        total = sum(w["prompt_tokens"] for w in r.per_worker)
        busiest = max(w["prompt_tokens"] for w in r.per_worker) / total if total else 0.0
        row = (
            f"| {r.workload} | {r.where} | {r.label} | {s['cached_tokens']:,} | "
            f"{s['reuse']:.1%} | {kept} | {busiest:.0%} | {s['ttft_p50_s'] * 1e3:.0f} ms | "
            f"{r.ttft_p90_s * 1e3:.0f} ms | {s['failed']} |"
        )
        if with_l3:
            objects = (
                f"{r.store['objects']:,} ({r.store['nbytes'] / 2**20:,.0f} MiB)" if r.store else "-"
            )
            l3 = f"{s.get('l3_tokens', 0):,}" if r.l3 != "off" else "-"
            row += f" {l3} | {objects} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r.workload for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rs = [r for r in results if r.workload == name]
        ref = next((r for r in rs if r.policy == "single" and r.l3 == "off"), None)
        groups = sorted(
            {(r.topology, r.workers) for r in rs if r.policy != "single"},
            key=lambda g: (TOPOLOGIES.index(g[0]), g[1]),
        )
        # A bar per policy, and per policy + L3 where the fleets shared one.
        series = [
            (p, m)
            for p in POLICIES
            for m in L3_MODES
            if any((r.policy, r.l3) == (p, m) for r in rs)
        ]
        width = 0.8 / max(1, len(series))
        for i, (p, m) in enumerate(series):
            ys = []
            for t, n in groups:
                key = (t, n, p, m)
                r = next((x for x in rs if (x.topology, x.workers, x.policy, x.l3) == key), None)
                ys.append(r.summary["reuse"] * 100 if r else 0.0)
            ax.bar(
                [c + (i - (len(series) - 1) / 2) * width for c in range(len(groups))],
                ys,
                width,
                label=p if m == "off" else f"{p} + L3",
                hatch="//" if m != "off" else None,
            )
        if ref is not None:
            ax.axhline(
                ref.summary["reuse"] * 100, color="k", ls="--", label="one server, same memory"
            )
            ax.axhline(ref.summary["reuse"] * 90, color="k", ls=":", label="90 % of it")
        ax.set_xticks(
            range(len(groups)),
            [f"{n} DP ranks" if t == "dp" else f"{n} servers" for t, n in groups],
        )
        ax.set_ylabel("cached prompt tokens (%)")
        ax.set_title(f"{name}: reuse through sglang-router")
    # One legend under both plots: inside the axes it hides the bars it names.
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=(len(labels) + 1) // 2)
    fig.tight_layout(rect=(0.0, 0.1, 1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sglang-hybrid scaleout",
        description="Reuse and TTFT of --radix-cache hybrid servers behind SGLang's router.",
    )
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--workloads", type=csv, default=list(WORKLOADS))
    p.add_argument("--workers", type=lambda s: [int(x) for x in csv(s)], default=[1, 2, 4])
    p.add_argument("--policies", type=csv, default=list(POLICIES))
    p.add_argument(
        "--topologies",
        type=csv,
        default=list(TOPOLOGIES),
        help="servers: N servers behind the router; dp: one server with --dp-size N behind the "
        "router's --dp-aware (default: both)",
    )
    p.add_argument("--agent-sessions", type=int, default=8)
    p.add_argument("--mooncake", default=MOONCAKE, help=f"the trace (default {MOONCAKE})")
    p.add_argument("--mooncake-requests", type=int, default=200)
    p.add_argument("--total-kv-tokens", type=int, default=TOTAL_KV_TOKENS)
    p.add_argument("--total-slots", type=int, default=TOTAL_SLOTS)
    p.add_argument(
        "--total-host-mib",
        type=int,
        default=0,
        help="host tier (--hybrid-host-cache-mib) split evenly over the servers; 0: none",
    )
    p.add_argument(
        "--l3",
        type=csv,
        default=["off"],
        help="off,mooncake: every fleet also with a shared Mooncake Store on loopback as L3 "
        "(--hybrid-l3; needs --total-host-mib); default off",
    )
    p.add_argument(
        "--l3-mib", type=int, default=4096, help="the L3 store's memory (default 4096 MiB)"
    )
    p.add_argument("--out", default="docs/results/scale-out")
    p.add_argument("--raw", default="out/scale-out")
    args = p.parse_args(argv)
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}: expected some of {', '.join(POLICIES)}")
    bad = [x for x in args.workloads if x not in WORKLOADS]
    if bad:
        p.error(f"unknown workloads {bad}: expected some of {', '.join(WORKLOADS)}")
    bad = [x for x in args.topologies if x not in TOPOLOGIES]
    if bad or not args.topologies:
        p.error(f"--topologies {bad}: expected some of {', '.join(TOPOLOGIES)}")
    if 1 not in args.workers:
        p.error("--workers must include 1 (the reference: one server with all the memory)")
    kv, slots = args.total_kv_tokens, args.total_slots
    host = args.total_host_mib
    if host < 0:
        p.error(f"--total-host-mib {host}: must be 0 or more")
    bad = [x for x in args.l3 if x not in L3_MODES]
    if bad or not args.l3:
        p.error(f"--l3 {bad}: expected some of {', '.join(L3_MODES)}")
    if "mooncake" in args.l3 and host == 0:
        p.error("--l3 mooncake: L3 lands in the host tier; give --total-host-mib too")
    if args.l3_mib < 64:
        p.error(f"--l3-mib {args.l3_mib}: at least 64")
    if any(n < 1 or slots % n or kv % n or host % n for n in args.workers):
        p.error(f"--workers: each count must divide {slots} slots, {kv} KV tokens and {host} MiB")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    # The tiny model declares 8k positions; the token worker computes nothing, so longer prompts
    # only need SGLang to accept them.
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    done: list[RunResult] = []

    def on_result(r: RunResult) -> None:  # each run's row is kept as soon as it is measured
        _show(r)
        done.append(r)
        write(args, argv, done)

    results = run(args, on_result)
    out = write(args, argv, results)
    print(table(results))
    _say(f"wrote {out / 'scale_out.json'}, .md and .png")
    failed = sum(r.summary["failed"] for r in results)
    return 0 if failed == 0 else 1


def write(args: argparse.Namespace, argv: Sequence[str] | None, results: list[RunResult]) -> Path:
    """``scale_out.json``, ``.md`` and ``.png`` of the runs so far, in ``--out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python -m sglang_hybrid.scaleout "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "total_kv_tokens": args.total_kv_tokens,
        "total_slots": args.total_slots,
        "total_host_mib": args.total_host_mib,
        "l3": args.l3,
        "l3_mib": args.l3_mib,
        "running_per_server": RUNNING,
        "topologies": args.topologies,
        "results": [asdict(r) for r in results],
    }
    (out / "scale_out.json").write_text(json.dumps(doc, indent=1))
    (out / "scale_out.md").write_text(f"`{doc['command']}` ({doc['date']})\n\n" + table(results))
    plot(results, out / "scale_out.png")
    return out
