"""How far apart a Mooncake trace's reuse lies, in tokens of traffic: the capacity it needs.

Usage: ``python benchmark/replay/reuse_distance.py [TRACE] [--limit N]``
(default ``../shared/traces/mooncake_synthetic_trace.jsonl``, from the repository root).

For each request, the earlier request sharing its longest hash-block prefix (full blocks; a
partial last block is private) and the prompt tokens that arrived in between: an LRU cache of
that many tokens, fed every prompt, would still hold the shared prefix. Prints the total
block-prefix reuse, distance percentiles, and the share of reusable tokens within a cache of
0.5 .. 16 M tokens. Reads the trace only; replays nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

BLOCK = 512


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "trace", nargs="?", default="../shared/traces/mooncake_synthetic_trace.jsonl"
    )
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    with open(args.trace) as f:
        rows = [json.loads(x) for x in f if x.strip()][: args.limit]
    trie: dict = {}
    arrived = 0  # prompt tokens seen before the current request
    before: list[int] = []
    total = reused = 0
    pairs: list[tuple[int, int]] = []  # (distance in tokens, reused tokens)
    for i, r in enumerate(rows):
        n = r["input_length"]
        ids = r["hash_ids"] if n % BLOCK == 0 else r["hash_ids"][:-1]
        node, depth, parent = trie, 0, None
        for h in ids:
            child = node.get(h)
            if child is None:
                break
            node, depth, parent = child[0], depth + 1, child[1]
        if depth:
            since = arrived - before[parent] - rows[parent]["input_length"]
            pairs.append((since, depth * BLOCK))
            reused += depth * BLOCK
        node = trie
        for h in ids:
            child = node.setdefault(h, [{}, i])
            child[1] = i  # the latest request through this block
            node = child[0]
        before.append(arrived)
        arrived += n
        total += n
    print(f"{len(rows)} requests, {total:,} prompt tokens")
    print(f"block-prefix reuse: {reused:,} tokens ({reused / total:.1%}) in {len(pairs)} requests")
    dist = sorted(d for d, _ in pairs)
    for q in (10, 25, 50, 75, 90):
        print(f"  reuse distance p{q}: {dist[min(len(dist) - 1, len(dist) * q // 100)]:,} tokens")
    for cap in (0.5e6, 1e6, 2e6, 4e6, 8e6, 16e6):
        within = sum(t for d, t in pairs if d < cap)
        print(f"  reusable within an LRU of {cap / 1e6:g} M tokens: {within / reused:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
