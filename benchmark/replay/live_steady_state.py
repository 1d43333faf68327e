"""Steady state on SGLang's real server (CPU): the live counterpart of ``bench_replay.py
steady-state``.

Usage (from the repository root):
``python benchmark/replay/live_steady_state.py [--dry-run] [--out DIR] [--raw DIR]``

For each cache, ``hybrid`` (``--radix-cache hybrid``, host tier off) and ``builtin`` (SGLang's
``no_buffer``), it starts the CPU server (``sglang_hybrid.cpu.server.CpuServer``: SGLang's
``launch_server`` with the token worker, which computes nothing and answers deterministic tokens)
on the same pools and sends the same trace twice with ``sglang-hybrid replay live``:

- ``flushed``: ``--flush`` (SGLang's ``/flush_cache``), then the measured requests;
- ``prefilled``: ``--flush --prefill-pool``: unrelated requests sized from the server's
  ``/server_info`` fill the KV pool and the state slots, run to completion, then the same
  measured requests (``replay/warmup.py``; the warm-up is not counted).

It writes ``steady_state_live.json`` / ``.md`` to ``--out`` (``docs/results/replay/steady-state-
live/``): reuse (cached prompt tokens, as the server reports them) side by side; the per-request
results (``replay live --out``, ``CACHE-VARIANT.json``) and the servers' logs go to ``--raw``
(``out/steady-state-live/``, not versioned). ``HybridRadixCache.stats()``
is not served over HTTP; the skip counts quoted are the growth of the totals the backend logged
during each variant, warm-up included (``sglang/skips.py`` logs each kind at most once a
minute, so they are lower bounds).

The trace goes to ``/generate`` as token ids, so it carries no template hints, and the token
worker's answers are not the trace's scripted ones: a tool step's prompt shares its previous
prompt, not the answer, with the cache. The same holds for both caches and both variants.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

from sglang_hybrid.replay import cli

ROOT = Path(__file__).resolve().parents[2]
OUT_DEFAULT = "docs/results/replay/steady-state-live"
RAW_DEFAULT = "out/steady-state-live"
# The measured traffic: four agent sessions starting within seconds of each other, think and
# tool times compressed 20x, eight requests in flight at most.
TRACE = ["--trace=agent", "--sessions=4", "--session-rate=1", "--pace=0.05", "--concurrency=8"]
# Equal pools for both caches (KV tokens, state slots, running requests, chunk), large enough
# for the four sessions' working set (their longest prompts are ~16k tokens).
POOLS = dict(
    max_total_tokens=131072,
    max_mamba_cache_size=32,
    max_running_requests=4,
    chunked_prefill_size=2048,
)
EXTRA = ["--context-length", "32768"]
VARIANTS = {"flushed": ["--flush"], "prefilled": ["--flush", "--prefill-pool"]}
CACHES = {"hybrid": "hybrid", "builtin": "no_buffer"}
_SKIP_LINE = re.compile(r"sglang-hybrid skipped \d+× (\w+).*?\(total (\d+)\)")


def logged_skips(text: str) -> dict[str, int]:
    """The last total the backend logged for each skip kind."""
    out: dict[str, int] = {}
    for kind, total in _SKIP_LINE.findall(text):
        out[kind] = int(total)
    return out


def run(out_dir: Path, raw_dir: Path, dry_run: bool, driver: str) -> int:
    from sglang_hybrid.cpu.server import CpuServer, ServerConfig
    from sglang_hybrid.replay.driver import ReplaySettings, model_dir

    model = model_dir(ReplaySettings())  # the replay's tiny model (written once)
    # The tiny model declares 8192 positions; the agent's prompts are longer (never computed).
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    docs: dict[str, dict[str, object]] = {}
    started = time.perf_counter()
    commands = []
    for cache, label in CACHES.items():
        cfg = ServerConfig(
            model, cache=cache, worker="tokens", host_cache_mib=0, extra=EXTRA, **POOLS
        )
        if dry_run:
            print(shlex.join(str(a) for a in cfg.argv()))
        log = raw_dir / f"{cache}-server.log"
        server = CpuServer(cfg, log) if not dry_run else None
        try:
            if server is not None:
                server.start()
            skips_before: dict[str, int] = {}
            for variant, flags in VARIANTS.items():
                url = server.url if server is not None else "http://127.0.0.1:PORT"
                out = raw_dir / f"{cache}-{variant}.json"
                argv = ["live", "--url", url, *TRACE, *flags, f"--out={out}"]
                commands.append(f"{cli.PROG} {shlex.join(argv)}")
                if dry_run:
                    print(commands[-1])
                    continue
                t0 = time.perf_counter()
                rc = cli.main(argv)
                if rc:
                    return rc
                doc = json.loads(out.read_text())
                skips = logged_skips(log.read_text(errors="replace")) if cache == "hybrid" else {}
                doc["logged_skips"] = {k: v - skips_before.get(k, 0) for k, v in skips.items()}
                skips_before = skips
                doc["wall_s"] = time.perf_counter() - t0
                docs[f"{label}/{variant}"] = doc
        finally:
            if server is not None:
                server.stop()
    if dry_run:
        return 0
    wall = time.perf_counter() - started
    write(out_dir, docs, commands, wall, driver)
    return 0


def write(
    out_dir: Path, docs: dict[str, dict], commands: list[str], wall: float, driver: str
) -> None:
    rows = []
    for label in CACHES.values():
        f, p = docs[f"{label}/flushed"], docs[f"{label}/prefilled"]
        fs, ps = f["summary"], p["summary"]
        change = (
            (ps["cached_tokens"] - fs["cached_tokens"]) / fs["cached_tokens"]
            if fs["cached_tokens"]
            else None
        )
        rows.append(
            {
                "cache": label,
                "prompt_tokens": fs["prompt_tokens"],
                "flushed": fs,
                "prefilled": ps,
                "reused_change": change,
                "warmup": p.get("warmup"),
                "logged_skips": {"flushed": f["logged_skips"], "prefilled": p["logged_skips"]},
                "wall_s": {"flushed": f["wall_s"], "prefilled": p["wall_s"]},
            }
        )
    doc = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "pools": POOLS,
        "commands": commands,
        "wall_s": wall,
        "rows": rows,
    }
    (out_dir / "steady_state_live.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "### steady-state-live",
        "",
        "```",
        driver,
        *commands,
        "```",
        "",
        f"date: {doc['date']}; machine: {doc['machine']}; pools: {POOLS}, {EXTRA}; whole run "
        f"(server starts included): {wall:.0f} s.",
        "",
        "| cache | prompt tokens | flushed: cached | prefilled | pre-filled: cached | prefilled "
        "| cached, pre-filled vs flushed | failed | warm-up requests (prompt tokens) "
        "| skips logged, flushed / pre-filled (warm-up included; lower bounds) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        f, p, w = r["flushed"], r["prefilled"], r["warmup"] or {}
        sk = r["logged_skips"]
        skips = ", ".join(
            f"{k} {sk['flushed'].get(k, 0)} / {sk['prefilled'].get(k, 0)}"
            for k in sorted({*sk["flushed"], *sk["prefilled"]})
        )
        change = "-" if r["reused_change"] is None else f"{r['reused_change']:+.1%}"
        lines.append(
            f"| {r['cache']} | {r['prompt_tokens']:,} "
            f"| {f['cached_tokens']:,} ({f['reuse']:.1%}) | {f['prefilled_tokens']:,} "
            f"| {p['cached_tokens']:,} ({p['reuse']:.1%}) | {p['prefilled_tokens']:,} "
            f"| {change} | {f['failed']} / {p['failed']} "
            f"| {w.get('requests', 0)} ({w.get('prompt_tokens', 0):,}) | {skips or '-'} |"
        )
    (out_dir / "steady_state_live.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=OUT_DEFAULT, help=f"summary directory ({OUT_DEFAULT})")
    parser.add_argument(
        "--raw", default=RAW_DEFAULT, help=f"per-request results and logs ({RAW_DEFAULT})"
    )
    args = parser.parse_args()
    if Path.cwd().resolve() != ROOT:
        raise SystemExit(f"run this from the repository root ({ROOT})")
    out, raw = Path(args.out), Path(args.raw)
    out.mkdir(parents=True, exist_ok=True)
    raw.mkdir(parents=True, exist_ok=True)
    driver = shlex.join(["python", "benchmark/replay/live_steady_state.py", *sys.argv[1:]])
    return run(out, raw, args.dry_run, driver)


if __name__ == "__main__":
    sys.exit(main())
