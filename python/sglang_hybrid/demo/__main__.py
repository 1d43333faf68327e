"""``python -m sglang_hybrid.demo`` (what ``make demo`` runs).

Starts SGLang's real server on the CPU (``python -m sglang.launch_server``, the tiny hybrid model,
the CPU model worker) three times in turn: ``--radix-cache hybrid``, SGLang's built-in cache and
no cache. Each replays the embedded agent session (``session.py``) through the OpenAI chat API,
streaming, and the demo prints per request the prompt, reused and prefilled tokens and the TTFT,
then totals and ratios, checks that all three generated the same outputs, and writes
``<out>/demo.json`` and ``<out>/demo.png``. Every server is stopped on exit, on Ctrl+C and on
failure. ``--url NAME=URL`` replays against servers already running (a GPU, a real model).
Exit status: 0 when every request succeeded and the outputs agree, 1 otherwise, 130 on Ctrl+C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .report import CacheRun, mismatches, plot, ratios, table, totals, write_json

CACHE_NAMES = {"hybrid": "hybrid", "builtin": "built-in", "off": "uncached"}

GPU_HINT = """\
On a GPU with a real hybrid model (not verifiable on these machines):
  pip install sglang==0.5.23 && pip install -e .
  python -m sglang.launch_server --model-path Qwen/Qwen3-Next-80B-A3B-Instruct --tp 4 \\
      --radix-cache hybrid --hybrid-host-cache-mib 65536 --enable-cache-report --port 30000
  python -m sglang.launch_server --model-path Qwen/Qwen3-Next-80B-A3B-Instruct --tp 4 \\
      --mamba-radix-cache-strategy no_buffer --disable-overlap-schedule --enable-cache-report \\
      --port 30001
  python -m sglang_hybrid.demo --url hybrid=http://127.0.0.1:30000 --url built-in=http://127.0.0.1:30001
"""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglang_hybrid.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out/demo"),
        help="logs, demo.json and demo.png (default out/demo)",
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a model directory (default: the tiny Qwen3-Next, written to <out>/tiny)",
    )
    p.add_argument(
        "--caches",
        default="hybrid,builtin,off",
        help="CPU servers to start, in order: hybrid, builtin, off (default: all)",
    )
    p.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="replay against a running server instead (repeatable; no CPU servers)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    # A GPU server prefills thousands of tokens per pass; at a few hundred, SGLang's built-in
    # cache would keep a state at every chunk end, a placement no real deployment gives it.
    p.add_argument(
        "--chunk",
        type=int,
        default=8192,
        help="--chunked-prefill-size of the CPU servers (default 8192, as a GPU server runs)",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def _replay(name: str, url: str, reqs: list[Any]) -> list[Any]:
    from sglang_hybrid.replay.live import run_replay

    total = len(reqs)
    count = [0]

    def show(r: Any) -> None:
        count[0] += 1
        if r.error:
            _say(f"  [{name}] {count[0]}/{total} {r.rid}: ERROR {r.error}")
        else:
            _say(
                f"  [{name}] {count[0]}/{total} {r.rid:<13} prompt {r.prompt_tokens:>5}, "
                f"reused {r.cached_tokens:>5}, ttft {1000 * r.ttft_s:6.0f} ms"
            )

    return run_replay(url, reqs, concurrency=1, on_result=show)


def _run_cpu(args: argparse.Namespace, reqs: list[Any]) -> list[CacheRun]:
    from sglang_hybrid.cpu.server import CpuServer, ServerConfig
    from sglang_hybrid.cpu.tiny_model import write_tiny_model

    model = args.model_dir
    if model is None:
        _say(f"writing the tiny hybrid model (Qwen3-Next layout, seed 0) to {args.out / 'tiny'}")
        model = write_tiny_model(args.out / "tiny", "qwen3_next", seed=0)
    runs = []
    kinds = [k.strip() for k in args.caches.split(",") if k.strip()]
    for k in kinds:
        if k not in CACHE_NAMES:
            raise SystemExit(f"--caches: unknown {k!r}; choose from {', '.join(CACHE_NAMES)}")
    for i, kind in enumerate(kinds, 1):
        name = CACHE_NAMES[kind]
        cfg = ServerConfig(
            model,
            cache=kind,
            chunked_prefill_size=args.chunk,
            max_total_tokens=max(16384, 2 * args.chunk),
        )
        log = args.out / f"server-{kind}.log"
        _say(f"\n[{i}/{len(kinds)}] {name}: starting SGLang's server on the CPU (log {log})")
        _say("  " + " ".join(cfg.argv()[1:]))
        t0 = time.monotonic()
        with CpuServer(cfg, log, args.startup_timeout, lambda m, n=name: _say(f"  [{n}] {m}")) as s:  # type: ignore[misc]  # mypy cannot infer a lambda with a default
            startup = time.monotonic() - t0
            _say(f"  [{name}] ready in {startup:.0f} s at {s.url}; replaying {len(reqs)} requests")
            results = _replay(name, s.url, reqs)
            runs.append(CacheRun(name, results, cfg.argv(), startup))
        _say(f"  [{name}] server stopped")
    return runs


def _run_urls(args: argparse.Namespace, reqs: list[Any]) -> list[CacheRun]:
    runs = []
    for spec in args.url:
        name, sep, url = spec.partition("=")
        if not sep or not url:
            raise SystemExit(f"--url {spec!r}: expected NAME=URL")
        _say(f"\n{name}: replaying {len(reqs)} requests against {url}")
        runs.append(CacheRun(name, _replay(name, url, reqs), [], 0.0))
    return runs


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from sglang_hybrid.replay.chat_session import agent_session

    args = _parse(argv)
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"--model-dir {args.model_dir}: no config.json there (a model directory)")
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl+C so every server is stopped; SIGINT gets
    # Python's handler back even where a launcher started us with it ignored (`cmd &` in sh).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reqs = agent_session(max_tokens=args.max_tokens)
    _say(
        f"sglang-hybrid demo: an agent session of {len(reqs)} chat requests (system + 6 tools "
        "shared with a subagent, tool turns, re-rendered history, a retry, a deep edit)"
    )
    from sglang_hybrid.cpu.server import ServerError
    from sglang_hybrid.replay.errors import ReplayError

    try:
        runs = _run_urls(args, reqs) if args.url else _run_cpu(args, reqs)
    except KeyboardInterrupt:
        _say("\ninterrupted: every server the demo started has been stopped")
        return 130
    except (ServerError, ReplayError) as e:
        print(f"\nsglang-hybrid demo failed: {e}", file=sys.stderr, flush=True)
        _say("every server the demo started has been stopped")
        return 1
    if not runs:
        _say("nothing to compare")
        return 1
    _say("\n" + table(runs))
    tot = totals(runs)
    _say("")
    for name, t in tot.items():
        _say(
            f"{name:>9}: prefilled {t['prefilled_tokens']:>6} of {t['prompt_tokens']:>6} prompt "
            f"tokens (reused {100 * t['reuse']:.1f}%), TTFT summed {t['ttft_total_s']:.2f} s"
            + (f", {t['failed']} failed" if t["failed"] else "")
        )
    for label, value in ratios(tot).items():
        _say(f"  {label}: {value:.2f}x")
    bad = mismatches(runs)
    names = ", ".join(r.name for r in runs)
    if bad:
        _say(f"\nOUTPUTS DIFFER between {names} for: {', '.join(bad)}")
    else:
        _say(f"\ngenerated outputs identical under {names} for all {len(reqs)} requests")
    meta = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "command": " ".join([sys.executable, "-m", "sglang_hybrid.demo", *(argv or sys.argv[1:])]),
        "note": "TTFT on a shared 2-core CPU with a tiny model: compare ratios, not absolutes",
    }
    write_json(args.out / "demo.json", runs, meta)
    png = None
    with contextlib.suppress(Exception):  # a plot is a nicety; never fail the demo for it
        png = plot(args.out / "demo.png", runs)
    _say(f"wrote {args.out / 'demo.json'}" + (f" and {png}" if png else ""))
    _say("\n" + GPU_HINT)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
