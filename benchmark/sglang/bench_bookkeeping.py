"""Cache bookkeeping cost per request: ``--radix-cache hybrid`` vs SGLang's built-in cache.

    python benchmark/sglang/bench_bookkeeping.py [--conversations 20 --turns 10] [--json out]

The same multi-turn requests (default 200, about 8k tokens each: each turn re-sends the previous
prompt and answer plus a new user message) go through each cache on identical CPU pools, driven
through SGLang's own helpers exactly as its scheduler calls them (``test/sglang/direct.py``):
match with copy-on-write, lock, allocation, a checkpoint per 2048-token chunk and at the prompt
end, decode, release; the prompt end's checkpoint and the release run in a free group, as in
SGLang's result processor (pages a cache frees there are appended to the allocator's free list
once per batch, outside the cache). Only the time spent inside cache methods is counted; the
stand-in forward pass is excluded. SGLang's cache is ``UnifiedRadixCache`` with FULL + MAMBA
components on its default (Rust) tree core, page size 1 (what its no_buffer strategy requires).
Prints both means and the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "test" / "sglang"))  # the direct driver is a test instrument


def workload(conversations: int, turns: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """(conversation, turn, new user tokens) in arrival order: conversations interleave."""
    rng = random.Random(seed)
    order = [(c, t) for t in range(turns) for c in range(conversations)]
    return [(f"c{c}", t, rng.randrange(300, 900)) for c, t in order]


def run(kind: str, args: argparse.Namespace) -> dict:
    from direct import Driver, build_pools, builtin_cache, hybrid_cache

    pools = build_pools(1, kv_tokens=args.kv_tokens, reqs=4, mamba=64, context=1 << 16)
    cache = hybrid_cache(pools, chunk=2048) if kind == "hybrid" else builtin_cache(pools)
    d = Driver(cache, pools, chunk=2048, check=False, free_groups=True)
    rng = random.Random(1)
    history: dict[str, list[int]] = {}
    per_req, prompt_tokens, cached = [], 0, 0
    t0 = time.perf_counter()
    items = workload(args.conversations, args.turns)
    for i, (conv, _turn, user) in enumerate(items):
        prompt = history.get(conv) or [rng.randrange(10, 2000) for _ in range(args.first)]
        prompt = prompt + [rng.randrange(10, 2000) for _ in range(user)]
        r = d.serve(f"{conv}-{i}", prompt, max_new=args.output)
        history[conv] = prompt + r.output
        per_req.append(r.cache_seconds)
        prompt_tokens += r.prompt
        cached += r.cached
        if (i + 1) % 25 == 0:
            print(f"  {kind}: {i + 1}/{len(items)} requests", file=sys.stderr, flush=True)
    d.check_idle()
    return {
        "requests": len(per_req),
        "mean_prompt_tokens": prompt_tokens / len(per_req),
        "cache_us_per_request_mean": statistics.fmean(per_req) * 1e6,
        "cache_us_per_request_median": statistics.median(per_req) * 1e6,
        "reused_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--first", type=int, default=3500, help="tokens of each first prompt")
    ap.add_argument("--output", type=int, default=100, help="tokens generated per request")
    ap.add_argument("--kv-tokens", type=int, default=400_000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from sglang_hybrid.index import native

    index = native.status()  # compiled (mypyc) or the sources: docs/index.md, "Compiled"
    print(f"index: {'compiled' if index.compiled else 'sources'} ({index.reason})", flush=True)
    res: dict = {kind: run(kind, args) for kind in ("hybrid", "builtin")}
    res["index_compiled"] = index.compiled
    h, b = res["hybrid"], res["builtin"]
    ratio = h["cache_us_per_request_mean"] / b["cache_us_per_request_mean"]
    res["ratio_hybrid_over_builtin"] = ratio
    print(f"{h['requests']} requests, {h['mean_prompt_tokens']:.0f} prompt tokens on average")
    for name, r in (("hybrid", h), ("built-in", b)):
        print(
            f"  {name:9s} cache time per request: mean {r['cache_us_per_request_mean']:.0f} us, "
            f"median {r['cache_us_per_request_median']:.0f} us; reused "
            f"{r['reused_tokens'] / r['prompt_tokens']:.1%} of prompt tokens"
        )
    print(f"  ratio hybrid / built-in: {ratio:.2f}x (target <= 1.0x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
