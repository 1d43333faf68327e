"""Offline model of reuse against capacity and eviction order on a block-hash trace (issue #37).

What it models: a cache of C tokens of KV in the trace's own blocks (512 tokens for Mooncake),
with a state free at every block boundary (as the free-state LRU bound has), fed every prompt in
arrival order; a request reuses its longest prefix of full blocks still held. No device, no
queueing, no concurrency. Orders:

- ``lru``: the block used longest ago goes (what ``--caches lru`` replays, at 64-token grain);
- ``slru``: segmented LRU, a block used twice moves to a protected half (scan resistance by
  frequency, as TinyLFU's and ARC's protected segments);
- ``ghost_slru``: the host tier's order (``host_eviction.density_victim``): a block used a
  second time, counting uses remembered after it left (over ``GHOST_SPAN`` times the capacity,
  as ``newcomers.GhostBlocks``), is protected; blocks used once go first;
- ``belady``: the block used again furthest in the future goes (clairvoyant: an upper bound on
  any order at that capacity).

It answers what the host tier's bytes could buy on that trace: how far reuse moves with capacity
under LRU (a state image costs capacity: 3,144 tokens of KV at the 80B geometry), and how much
an order could add at the same capacity (``docs/benchmarks.md``, "Where Mooncake's host tier
loses against the bound").

    python benchmark/replay/block_orders.py [TRACE] [--mtokens 3.4 4.2 5.59] [--out DIR]
        [--mark "hybrid, 32 + 96 GiB host=33.5"]

Prints reuse per order and capacity, writes ``block_orders.json`` and a plot to ``--out``.
Seconds to a minute per capacity on one core.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import ChainMap, OrderedDict
from collections.abc import Container
from pathlib import Path

BLOCK = 512  # tokens per hash id in a Mooncake trace

Request = tuple[list[int], int, int]  # (chained block keys, full blocks, prompt tokens)


def load(path: str) -> list[Request]:
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            keys, k = [], 0
            for h in r["hash_ids"]:
                k = hash((k, h))  # the block's identity is its whole prefix (ints hash stably)
                keys.append(k)
            n = r["input_length"]
            full = len(keys) if n % BLOCK == 0 else len(keys) - 1  # a partial last block is private
            out.append((keys, full, n))
    return out


def _held_prefix(keys: list[int], full: int, held: Container[int]) -> int:
    d = 0
    for k in keys[:full]:
        if k not in held:
            break
        d += 1
    return d


def lru(reqs: list[Request], cap: int) -> int:
    c: OrderedDict[int, None] = OrderedDict()
    reused = 0
    for keys, full, _ in reqs:
        reused += _held_prefix(keys, full, c)
        for k in keys:
            if k in c:
                c.move_to_end(k)
            else:
                c[k] = None
        while len(c) > cap:
            c.popitem(last=False)
    return reused


def slru(reqs: list[Request], cap: int, protected: float = 0.5) -> int:
    prob: OrderedDict[int, None] = OrderedDict()
    prot: OrderedDict[int, None] = OrderedDict()
    limit = int(cap * protected)
    reused = 0
    held = ChainMap(prob, prot)  # membership in either segment
    for keys, full, _ in reqs:
        reused += _held_prefix(keys, full, held)
        for k in keys:
            if k in prot:
                prot.move_to_end(k)
            elif k in prob:
                del prob[k]
                prot[k] = None
                while len(prot) > limit:  # the protected segment's LRU drops back to probation
                    prob[prot.popitem(last=False)[0]] = None
            else:
                prob[k] = None
        while len(prob) + len(prot) > cap:
            (prob or prot).popitem(last=False)
    return reused


def ghost_slru(reqs: list[Request], cap: int, span: int = 4) -> int:
    uses: OrderedDict[int, int] = OrderedDict()  # resident and remembered blocks, by last use
    once: OrderedDict[int, None] = OrderedDict()  # used once: evicted first
    twice: OrderedDict[int, None] = OrderedDict()  # the protected class
    reused = 0
    held = ChainMap(once, twice)
    for keys, full, _ in reqs:
        reused += _held_prefix(keys, full, held)
        for k in keys:
            n = uses.pop(k, 0) + 1
            uses[k] = n
            if k in twice:
                twice.move_to_end(k)
                continue
            once.pop(k, None)
            (twice if n > 1 else once)[k] = None
        while len(once) + len(twice) > cap:
            (once or twice).popitem(last=False)
        while len(uses) > span * cap:
            uses.popitem(last=False)
    return reused


def belady(reqs: list[Request], cap: int) -> int:
    never = 1 << 40
    nxt: dict[int, int] = {}
    uses: list[list[int]] = []
    for i in range(len(reqs) - 1, -1, -1):  # each block's next use after request i
        keys = reqs[i][0]
        uses.append([nxt.get(k, never) for k in keys])
        for k in keys:
            nxt[k] = i
    uses.reverse()
    held: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    reused = 0
    for i, (keys, full, _) in enumerate(reqs):
        reused += _held_prefix(keys, full, held)
        for k, u in zip(keys, uses[i], strict=True):
            held[k] = u
            heapq.heappush(heap, (-u, k))
        while len(held) > cap:
            u, k = heapq.heappop(heap)
            if held.get(k) == -u:
                del held[k]
    return reused


ORDERS = {"lru": lru, "slru": slru, "ghost_slru": ghost_slru, "belady": belady}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", nargs="?", default="../shared/traces/mooncake_synthetic_trace.jsonl")
    p.add_argument("--mtokens", type=float, nargs="+", default=[2.5, 3.4, 4.2, 5.59, 7.0])
    p.add_argument("--out", default="docs/results/replay/block-orders")
    p.add_argument(
        "--mark",
        nargs="*",
        default=[],
        metavar="LABEL=PERCENT",
        help="horizontal reference lines on the plot (a replay's measured reuse, a target)",
    )
    args = p.parse_args()
    reqs = load(args.trace)
    total = sum(n for _, _, n in reqs)
    print(f"{len(reqs)} requests, {total:,} prompt tokens; capacity in M tokens of KV")
    rows = []
    for m in args.mtokens:
        cap = int(m * 1e6) // BLOCK
        row: dict[str, float] = {"mtokens": m}
        for name, fn in ORDERS.items():
            row[name] = fn(reqs, cap) * BLOCK / total
        rows.append(row)
        print(f"  {m:5.2f} M: " + "  ".join(f"{k} {row[k]:.1%}" for k in ORDERS), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_orders.json").write_text(
        json.dumps({"trace": Path(args.trace).name, "block": BLOCK, "rows": rows}, indent=1) + "\n"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ORDERS:
        ax.plot([r["mtokens"] for r in rows], [100 * r[name] for r in rows], "o-", label=name)
    for i, mark in enumerate(args.mark):
        label, _, value = mark.rpartition("=")
        ax.axhline(float(value), ls="--", lw=1, color=f"C{len(ORDERS) + i}", label=label)
    ax.set_xlabel("capacity (M tokens of KV)")
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_title(f"{Path(args.trace).stem}: reuse by capacity and order")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reuse_vs_capacity.png", dpi=120)
    print(f"wrote {out}/block_orders.json and reuse_vs_capacity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
