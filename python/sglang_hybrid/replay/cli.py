"""``sglang-hybrid replay`` / ``python -m sglang_hybrid.replay``: the trace-replay benchmark.

Subcommands:

- ``run``: replay a trace or a generated workload against caches over one or more budgets and
  write ``report.json``, ``report.md`` and plots to ``--out`` (the markdown also goes to stdout).
  Traces: ``--trace mooncake:PATH``, ``--trace sessions:PATH``, ``--trace agent`` (generated,
  ``--sessions``, ``--session-rate``, ``--seed``), ``--trace shared-prefix`` (bench_serving's
  generated-shared-prefix shape, ``--gsp-*``), ``--trace chat`` (hint-less multi-turn chat at
  load, ``traces/chat_sessions.py``: ``--sessions``, ``--session-rate``), ``--trace prefixes``
  (prompts re-sending a prefix of an earlier one, ``traces/prefix_resend.py``: ``--requests``,
  ``--arrival-rate``).
- ``generate {agent,shared-prefix,chat,prefixes} --out FILE``: write a generated workload in the
  session format.
- ``plan``: print how budgets map to each cache's pools.
- ``live --url URL``: send a trace (``/generate`` with its token ids) or the demo's agent chat
  session (``--trace demo-session``, chat completions) to a running SGLang-compatible server,
  honouring arrivals, closed-loop dependencies and ``--concurrency``, streaming for TTFT and
  reading the cached tokens it reports; ``--out FILE`` writes the results as JSON.

Budgets are GiB of the modelled geometry (``--geometry``), whatever the CPU tensors weigh.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..index.config import HOST_ORDER_CHOICES
from .budget import CACHES, DEFAULT_CACHES, DEFAULT_MAMBA_RATIO, GIB
from .l3_model import L3_CACHES
from .trace import Trace, first
from .warmup import FILL_FACTOR, SLOT_FACTOR

if TYPE_CHECKING:  # the CLI imports the driver (torch, SGLang) only when it runs a replay
    from .driver import ReplaySettings

PROG = "sglang-hybrid replay"


def _trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--seed", type=int, default=0, help="token ids / generator seed (default 0)")
    g.add_argument("--limit", type=int, default=None, help="keep the first N requests")
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply Mooncake arrival times (default 1: the trace's own timing)",
    )
    g.add_argument(
        "--sessions", type=int, default=None, help="agent: sessions (default 24); chat: 400"
    )
    g.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="agent: sessions started per second (default 0.1); chat: 0.5",
    )
    g.add_argument("--requests", type=int, default=1500, help="prefixes: requests (default 1500)")
    g.add_argument(
        "--arrival-rate", type=float, default=2.0, help="prefixes: requests per second (2)"
    )
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--gsp-range-ratio", type=float, default=1.0)
    g.add_argument("--gsp-ordered", action="store_true")
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="shared-prefix: requests/s (inf)"
    )
    g.add_argument(
        "--drop-hints",
        action="store_true",
        help="drop the trace's tap hints (hint-less token-id traffic, as /generate clients send)",
    )


def _warmup_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "steady state: unrelated warm-up traffic before the measured requests, not counted "
        "(seeded by --seed, disjoint from the trace, lengths drawn from it; docs/benchmarks.md)"
    )
    g.add_argument(
        "--warmup-unrelated",
        type=int,
        default=0,
        metavar="N",
        help="N unrelated requests, arriving together, run to completion first (default 0)",
    )
    g.add_argument(
        "--prefill-pool",
        action="store_true",
        help=f"as many unrelated requests as fill the pools ({FILL_FACTOR:g}x the KV tokens, at "
        f"least {SLOT_FACTOR}x the state slots in requests; run: each budget's, live: the "
        "server's, from /server_info)",
    )


def load_trace(spec: str, args: argparse.Namespace) -> Trace:
    """A trace from ``--trace`` (``mooncake:PATH``, ``sessions:PATH``, ``agent``, ...)."""
    trace = _load_trace(spec, args)
    if getattr(args, "drop_hints", False):
        from .warmup import without_hints

        trace = without_hints(trace)
    return trace


def _load_trace(spec: str, args: argparse.Namespace) -> Trace:
    kind, _, path = spec.partition(":")
    if kind == "mooncake":
        from .traces.mooncake import load_mooncake

        return load_mooncake(path, seed=args.seed, limit=args.limit, time_scale=args.time_scale)
    if kind == "sessions":
        from .traces.sessions import load_sessions

        return load_sessions(path, limit=args.limit)
    if kind == "agent":
        from .generators.workload import agent_workload

        trace = agent_workload(
            sessions=24 if args.sessions is None else args.sessions,
            session_rate_per_s=0.1 if args.session_rate is None else args.session_rate,
            seed=args.seed,
        )
    elif kind == "chat":
        from .traces.chat_sessions import chat_trace

        trace = chat_trace(
            sessions=400 if args.sessions is None else args.sessions,
            session_rate_per_s=0.5 if args.session_rate is None else args.session_rate,
            seed=args.seed,
        )
    elif kind == "prefixes":
        from .traces.prefix_resend import prefix_trace

        trace = prefix_trace(requests=args.requests, rate_per_s=args.arrival_rate, seed=args.seed)
    elif kind == "shared-prefix":
        from .traces.shared_prefix import shared_prefix_trace

        trace = shared_prefix_trace(
            num_groups=args.gsp_num_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            system_prompt_len=args.gsp_system_prompt_len,
            question_len=args.gsp_question_len,
            output_len=args.gsp_output_len,
            range_ratio=args.gsp_range_ratio,
            request_rate=args.request_rate,
            ordered=args.gsp_ordered,
            seed=args.seed,
        )
    else:
        raise SystemExit(
            f"--trace {spec!r}: expected mooncake:PATH, sessions:PATH, agent, shared-prefix, "
            "chat or prefixes"
        )
    if args.limit is not None:
        trace = first(trace, args.limit)
    return trace


def _budget_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("budget and model")
    g.add_argument(
        "--budget-gib",
        type=float,
        nargs="+",
        default=[32.0],
        help="device budgets for KV + states, GiB of the modelled geometry (several: a sweep)",
    )
    g.add_argument(
        "--host-gib",
        type=float,
        default=0.0,
        help="hybrid's host tier; SGLang's caches get it on the device (same total memory)",
    )
    g.add_argument("--device", default="h200", help="cost preset device (h200, rtx5090)")
    g.add_argument(
        "--geometry", default="qwen3.5-27b", help="model geometry (qwen3.5-27b, qwen3-next-80b)"
    )
    g.add_argument("--max-running", type=int, default=64, help="running-request cap (64)")
    g.add_argument(
        "--mamba-ratio",
        type=float,
        default=DEFAULT_MAMBA_RATIO,
        help="SGLang's --mamba-full-memory-ratio for the state/KV split (0.9)",
    )
    g.add_argument(
        "--snapshot-slots",
        type=int,
        default=None,
        help="hybrid device snapshot slots (default: every state slot running requests leave)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Scheduler and hybrid-backend options of a replay (shared with benchmark scripts)."""
    p.add_argument("--chunk", type=int, default=8192, help="chunked prefill size (8192)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    hy = p.add_argument_group("hybrid backend options (its --hybrid-* flags; default: its own)")
    hy.add_argument("--tail-tap", choices=("exact", "flexible"), default="exact")
    hy.add_argument("--taps-per-request", type=int, default=None)
    hy.add_argument("--tap-ladder", type=int, default=None)
    hy.add_argument("--tap-min-gap", type=int, default=None)
    hy.add_argument("--hybrid-page-size", type=int, default=None, help="default 1")
    hy.add_argument(
        "--tap-mode",
        choices=("auto", "split", "zero-split"),
        default="auto",
        help="taps end a prefill pass (split) or are captured inside it (zero-split), as "
        "--hybrid-tap-mode; auto (default): what the backend's auto resolves to on an H200 with "
        "SGLang's default arguments (sglang/inpass.py; today split, splitting only where it "
        "pays)",
    )
    hy.add_argument(
        "--capture-grid",
        choices=("any", "chunk"),
        default=None,
        help="with zero-split: capture at any position (the CPU workers; SGLang's GPU worker "
        "through its prefill tracking and gdn_taps' recompute) or only at each request's "
        "64-token grid from its pass start (the per-chunk states without the recompute), other "
        "taps splitting where it pays (default: any, or what auto resolved)",
    )
    hy.add_argument(
        "--split-threshold",
        type=float,
        default=1.0,
        help="--hybrid-split-threshold: a tap the worker cannot capture splits its pass when "
        "its modelled saving exceeds this many passes' cost (0: every exact tap splits)",
    )
    hy.add_argument(
        "--host-order",
        choices=HOST_ORDER_CHOICES,
        default="duel",
        help="--hybrid-host-order: the host tier's victim order once learned (default duel)",
    )
    hy.add_argument(
        "--host-exclusive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--hybrid-host-exclusive: each KV block on one tier (default: the server's)",
    )
    hy.add_argument(
        "--coalesce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="in-flight prefix coalescing (default on; --no-coalesce: as before it existed)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="SGLang's overlap loop (the next batch is scheduled before this one's results are "
        "processed) for hybrid, extra_buffer and oracle; no_buffer refuses it and runs without",
    )
    p.add_argument("--model-dir", default=None, help="tiny model directory (written if absent)")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument("--no-progress", dest="progress", action="store_false")


def _settings(args: argparse.Namespace, budget_gib: float) -> ReplaySettings:
    from .driver import ReplaySettings

    if args.tap_mode == "auto":  # callers other than cmd_run (the profiling benchmarks)
        resolve_tap_mode(args)
    return ReplaySettings(
        device=args.device,
        geometry=args.geometry,
        device_bytes=int(budget_gib * GIB),
        host_bytes=int(args.host_gib * GIB),
        max_running=args.max_running,
        chunk=args.chunk,
        max_prefill_tokens=args.max_prefill_tokens,
        mamba_ratio=args.mamba_ratio,
        snapshot_slots=args.snapshot_slots,
        tail_tap=args.tail_tap,
        taps_per_request=args.taps_per_request,
        tap_ladder=args.tap_ladder,
        tap_min_gap=args.tap_min_gap,
        hybrid_page_size=args.hybrid_page_size,
        coalesce=args.coalesce,
        tap_mode=args.tap_mode,
        capture_grid=args.capture_grid or "any",
        split_threshold=args.split_threshold,
        host_order=getattr(args, "host_order", "duel"),
        host_exclusive=getattr(args, "host_exclusive", None),
        overlap=args.overlap,
        model_dir=args.model_dir,
        progress=args.progress,
        l3_bytes=int(getattr(args, "l3_gib", 0.0) * GIB),
    )


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .driver import replay
    from .report import SweepPoint, markdown, write_report

    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    known = (*CACHES, *L3_CACHES)
    unknown = [c for c in caches if c not in known]
    if unknown or not caches:
        raise SystemExit(f"--caches: unknown {unknown}; choose from {', '.join(known)}")
    if any(c in L3_CACHES for c in caches) and not (args.l3_gib > 0 and args.host_gib > 0):
        raise SystemExit("--caches hybrid+l3-*: give the L3 store --l3-gib and a --host-gib")
    if args.prefill_pool and args.warmup_unrelated:
        raise SystemExit("--prefill-pool sizes the warm-up itself: drop --warmup-unrelated")
    tap_note = resolve_tap_mode(args)
    if args.capture_grid not in (None, "any") and args.tap_mode != "zero-split":
        raise SystemExit(
            "--capture-grid says where zero-split taps are captured: add --tap-mode zero-split"
        )
    if not args.split_threshold >= 0 or args.split_threshold == float("inf"):
        raise SystemExit(f"--split-threshold {args.split_threshold}: give a finite number >= 0")
    trace = load_trace(args.trace, args)
    warm = args.prefill_pool or args.warmup_unrelated > 0
    meta = {
        "title": args.title or f"{trace.name} replay" + (" (pools pre-filled)" if warm else ""),
        "command": f"{PROG} " + shlex.join(argv),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "trace": f"{trace.name} ({len(trace.requests)} requests, "
        f"{sum(r.n for r in trace.requests):,} prompt tokens; {trace.source})",
    }
    meta["tap mode"] = tap_note
    if args.overlap:
        meta["overlap"] = "overlap scheduling on (no_buffer without: SGLang refuses it there)"
    if warm:
        meta["warmup"] = (
            "unrelated requests filling the pools (--prefill-pool)"
            if args.prefill_pool
            else f"{args.warmup_unrelated} unrelated requests"
        ) + " before the measured ones, not counted"
    sweep: list[SweepPoint] = []
    for b in args.budget_gib:
        settings = _settings(args, b)
        warmup = _warmup(args, trace, settings)
        point = SweepPoint(b, args.host_gib, {})
        sweep.append(point)
        for c in caches:
            point.results[c] = replay(trace, c, settings, warmup)
            if args.out:  # after every run: a long sweep that fails later keeps what it did
                write_report(sweep, args.out, meta)
    if args.out:
        print(f"wrote report.json, report.md, reuse_vs_budget.png, ttft_cdf.png to {args.out}")
    print(markdown(sweep, meta))
    return 0


def resolve_tap_mode(args: argparse.Namespace) -> str:
    """Turn ``--tap-mode auto`` into what the backend's auto picks on an H200 with SGLang's
    default arguments (``inpass.replay_default``); returns the line the report records."""
    from sglang_hybrid.sglang.inpass import replay_default

    if args.tap_mode != "auto":
        grid = args.capture_grid or "any"
        extra = f", capture grid {grid}" if args.tap_mode == "zero-split" else ""
        return f"{args.tap_mode} (asked for{extra}), split threshold {args.split_threshold:g}"
    choice = replay_default()
    if args.capture_grid is not None and choice.mode != "zero-split":
        raise SystemExit(
            f"--capture-grid: --tap-mode auto resolves to {choice.mode} here; add --tap-mode "
            f"zero-split"
        )
    args.tap_mode = choice.mode
    if choice.mode == "zero-split" and args.capture_grid is None:
        args.capture_grid = "any" if choice.grid == 1 else "chunk"
    return (
        f"{choice.message} [as on an H200 with SGLang's defaults], split threshold "
        f"{args.split_threshold:g}"
    )


def _warmup(args: argparse.Namespace, trace: Trace, settings: ReplaySettings) -> Trace | None:
    """The same unrelated warm-up for every cache of a budget point (or None)."""
    from .warmup import pool_warmup, unrelated_warmup

    if getattr(args, "prefill_pool", False):
        from .driver import plan_for

        # SGLang's caches get the largest device pools of a budget (host bytes go to their
        # device); the warm-up that fills them fills hybrid's too.
        return pool_warmup(trace, plan_for("no_buffer", settings), seed=args.seed)
    if args.warmup_unrelated > 0:
        return unrelated_warmup(trace, requests=args.warmup_unrelated, seed=args.seed)
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from .traces.sessions import write_sessions

    trace = load_trace(args.kind, args)
    path = write_sessions(trace, args.out)
    print(f"wrote {len(trace.requests)} requests to {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from sglang_hybrid.index.presets import GEOMETRIES

    from .budget import plan_pools

    geometry = GEOMETRIES[args.geometry]
    for b in args.budget_gib:
        print(f"budget {b:g} GiB device + {args.host_gib:g} GiB host, {geometry.name}:")
        for cache in CACHES:
            try:
                plan = plan_pools(
                    cache,
                    device_bytes=int(b * GIB),
                    host_bytes=int(args.host_gib * GIB),
                    geometry=geometry,
                    max_running=args.max_running,
                    mamba_ratio=args.mamba_ratio,
                    snapshot_slots=args.snapshot_slots,
                )
            except ValueError as e:  # a budget too small for this cache: say so, plan the rest
                print(f"  {cache}: {e}")
                continue
            print("  " + plan.describe(geometry))
    return 0


def cmd_live(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json
    from dataclasses import asdict

    from .errors import ReplayError
    from .live import LiveResult, flush_cache, from_trace, run_replay, server_pools, summarize
    from .warmup import pool_warmup, unrelated_warmup

    warm = args.prefill_pool or args.warmup_unrelated > 0
    if args.prefill_pool and args.warmup_unrelated:
        raise SystemExit("--prefill-pool sizes the warm-up itself: drop --warmup-unrelated")
    if args.trace == "demo-session":
        if warm:
            raise SystemExit("a warm-up needs a token-id trace, not demo-session")
        from .chat_session import agent_session

        reqs = agent_session(max_tokens=args.max_tokens, model=args.model)
    else:
        trace = load_trace(args.trace, args)
        reqs = from_trace(trace)  # /generate takes no model name
    done = 0

    def show(r: LiveResult) -> None:
        nonlocal done
        done += 1
        line = (
            f"[{done}/{len(reqs)}] {r.rid:<16} prompt {r.prompt_tokens:>7}, "
            f"cached {r.cached_tokens:>7}, ttft {r.ttft_s * 1e3:8.0f} ms"
        )
        print(line + (f"  FAILED: {r.error}" if r.error else ""), flush=True)

    warm_summary = None
    try:
        if args.flush:
            flush_cache(args.url)
            print(f"{PROG} live: flushed the cache of {args.url}")
        if warm:
            if args.prefill_pool:
                from .budget import PoolPlan

                kv, slots = server_pools(args.url)
                plan = PoolPlan("server", kv, slots, 0, 0, 0, 0)
                warmup = pool_warmup(trace, plan, seed=args.seed)
            else:
                warmup = unrelated_warmup(trace, requests=args.warmup_unrelated, seed=args.seed)
            print(f"{PROG} live: warm-up, {warmup.source}, not counted")
            warm_results = run_replay(args.url, from_trace(warmup), concurrency=args.concurrency)
            warm_summary = {"source": warmup.source, **summarize(warm_results)}
        print(f"{PROG} live: {len(reqs)} requests to {args.url} (concurrency {args.concurrency})")
        results = run_replay(
            args.url, reqs, concurrency=args.concurrency, time_scale=args.pace, on_result=show
        )
    except ReplayError as e:
        print(f"{PROG} live: {e}", file=sys.stderr)
        return 2
    summary = summarize(results)
    print(
        f"prompt {summary['prompt_tokens']:,} tokens, cached {summary['cached_tokens']:,} "
        f"({summary['reuse']:.1%}), prefilled {summary['prefilled_tokens']:,}; "
        f"TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms; {summary['failed']} failed"
    )
    if args.out:
        out = {
            "command": f"{PROG} " + shlex.join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "url": args.url,
            "summary": summary,
            "requests": [asdict(r) for r in results],
        }
        if warm_summary is not None:
            out["warmup"] = warm_summary
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if summary["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Trace-replay benchmark of prefix caches (SGLang scheduler, CPU)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="replay a trace against caches and report")
    run.add_argument(
        "--trace",
        required=True,
        help="mooncake:PATH, sessions:PATH, agent, shared-prefix, chat (hint-less multi-turn "
        "chat at load) or prefixes (prompts re-sending a prefix of an earlier one)",
    )
    run.add_argument(
        "--caches",
        default=",".join(DEFAULT_CACHES),
        help=f"comma-separated, from {', '.join((*CACHES, *L3_CACHES))} (default "
        f"{', '.join(DEFAULT_CACHES)}; lru is the free-state LRU bound: the budget's bytes, device "
        "and host, as KV only; the L3 caches need --host-gib and --l3-gib)",
    )
    _engine_args(run)
    _warmup_args(run)
    # L3 (issue #39): ``hybrid+l3-tcp`` / ``hybrid+l3-rdma`` in --caches (``l3_model.py``).
    run.add_argument(
        "--l3-gib",
        type=float,
        default=0.0,
        help="the hybrid+l3-tcp / hybrid+l3-rdma caches' store behind the host tier, GiB of the "
        "modelled geometry (transfers timed on the link; docs/benchmarks.md)",
    )
    run.add_argument("--out", default=None, help="directory for report.json, report.md, PNGs")
    run.add_argument("--title", default=None)
    _trace_args(run)
    _budget_args(run)

    gen = sub.add_parser("generate", help="write a generated workload as a session trace")
    gen.add_argument("kind", choices=("agent", "shared-prefix", "chat", "prefixes"))
    gen.add_argument("--out", required=True)
    _trace_args(gen)

    plan = sub.add_parser("plan", help="print how budgets map to each cache's pools")
    _budget_args(plan)

    live = sub.add_parser("live", help="send a trace to a running SGLang-compatible server")
    live.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    live.add_argument(
        "--trace",
        required=True,
        help="mooncake:PATH, sessions:PATH, agent, shared-prefix (token ids to /generate) or "
        "demo-session (make demo's agent session, chat completions)",
    )
    live.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    live.add_argument("--model", default="default", help="chat: the model name sent (default)")
    live.add_argument("--max-tokens", type=int, default=16, help="demo-session: tokens per turn")
    live.add_argument("--out", default=None, help="write per-request results as JSON")
    live.add_argument(
        "--pace",
        type=float,
        default=1.0,
        help="multiply every arrival time and closed-loop delay (0.1: ten times faster; 1)",
    )
    live.add_argument(
        "--flush", action="store_true", help="flush the server's prefix cache before sending"
    )
    _warmup_args(live)
    _trace_args(live)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return cmd_run(args, argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "live":
        return cmd_live(args, argv)
    return cmd_plan(args)
