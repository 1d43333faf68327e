"""Offline model of host placement on hint-less chat: LRU, the learned order, Belady (issue #37).

What it models: a cache of C tokens holding whole conversations (the KV of a conversation's
history past its shared system prompt, plus one state image), the unit a hybrid model's host
tier keeps or loses; a request reuses its previous turn's history if the conversation is held.
No device, no queueing: requests run in release order on an approximate clock (1.5 s + prefill
at 20k tokens/s + 20 ms per output token). It isolates the eviction order:

- ``lru``: the conversation used longest ago goes (GDSF's order among equal values);
- ``learned``: ``sglang_hybrid.index.hit_density.HitDensity``, the host tier's own class, fed
  hits and evictions by age in requests and classed by the conversation's resumes so far (the
  cache's lineage frequency), victim the lowest density among 64 sampled (no duel with GDSF and
  no ghosts: a conversation evicted here is not seen again);
- ``belady``: the one used again furthest in the future (clairvoyant, an upper bound).

The chat trace's think times are uniform in [20, 600] s (``replay/traces/chat_sessions.py``);
``--think lognormal`` redraws them heavy-tailed (20 s + a log-normal of median 60 s, sigma 1.2,
at most an hour), where reuse decays with age and LRU's order is the right one.

    python benchmark/replay/placement_model.py [--think uniform|lognormal] [--gib 48 96 128]

Prints reused fractions per order and size and writes them as JSON (``--out``). Minutes on one
core. It is a model: ``docs/benchmarks.md`` quotes the replay for what the cache does.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import numpy as np

from sglang_hybrid.index.hit_density import LEARNED, SAMPLE, WARM, HitDensity
from sglang_hybrid.replay.traces import chat_sessions

KV_BYTES_PER_TOKEN = 64 * 1024  # qwen3.5-27b (index/presets.py)
STATE_TOKENS = 2349  # its 147 MiB state image, in tokens of KV
SYSTEM = 3000  # the shared system prompt: always held


def requests(think: str) -> list[tuple[float, str, int, int, int]]:
    """(release, session, prompt tokens, tokens reusable from the previous turn, history)."""
    draw = random.Random.uniform
    if think == "lognormal":

        def heavy(self: random.Random, a: float, b: float) -> float:
            if (a, b) == (20.0, 600.0):
                return min(20.0 + self.lognormvariate(math.log(60.0), 1.2), 3600.0)
            return draw(self, a, b)

        random.Random.uniform = heavy  # type: ignore[method-assign]
    try:
        trace = chat_sessions.chat_trace()
    finally:
        random.Random.uniform = draw  # type: ignore[method-assign]
    finish: dict[str, float] = {}
    timed = []
    for r in trace.requests:
        t = r.arrival_s if r.arrival_s is not None else finish[r.after[0]] + r.delay_s
        finish[r.rid] = t + 1.5 + r.n / 20_000 + r.output_len * 0.02
        timed.append((t, r))
    timed.sort(key=lambda x: x[0])
    prev: dict[str, np.ndarray] = {}
    out = []
    for t, r in timed:
        assert r.session is not None and r.output_ids is not None
        p = prev.get(r.session)
        reuse = 0
        if p is not None:
            m = min(len(p), r.n)
            diff = np.nonzero(p[:m] != r.input_ids[:m])[0]
            reuse = m if len(diff) == 0 else int(diff[0])
        history = np.concatenate([r.input_ids, r.output_ids])
        prev[r.session] = history
        out.append((t, r.session, r.n, reuse, len(history)))
    return out


def simulate(reqs: list[tuple[float, str, int, int, int]], capacity: int, order: str) -> float:
    nxt: dict[str, float] = {}
    next_use = [math.inf] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        next_use[i] = nxt.get(reqs[i][1], math.inf)
        nxt[reqs[i][1]] = reqs[i][0]
    # session -> (tokens, used_at, next use, resumes so far: the lineage's hits)
    held: dict[str, tuple[int, int, float, int]] = {}
    used = reused = total = 0
    density = HitDensity()
    rng = random.Random(1)
    for i, (_, session, n, reuse, history) in enumerate(reqs):
        total += n
        k = 0
        if session in held:
            size, used_at, _, k = held.pop(session)
            used -= size
            reused += reuse
            density.note_hit(0, k, i - used_at)
            k += 1
        else:
            reused += min(SYSTEM, n)
        size = history - SYSTEM + STATE_TOKENS
        while used + size > capacity and held:
            if order == "belady":
                victim = max(held, key=lambda s: held[s][2])
            elif order == "lru" or not density.events >= WARM:
                victim = min(held, key=lambda s: held[s][1])
            else:
                names = list(held)
                pool = names if len(names) <= SAMPLE else rng.sample(names, SAMPLE)
                victim = min(
                    pool,
                    key=lambda s: (density.density(0, held[s][3], i - held[s][1]), held[s][1]),
                )
            size_v, used_at, _, k_v = held.pop(victim)
            density.note_eviction(0, k_v, used_at, i, 0, LEARNED)
            used -= size_v
        held[session] = (size, i, next_use[i], k)
        used += size
    return reused / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--think", choices=("uniform", "lognormal"), default="uniform")
    ap.add_argument("--gib", type=float, nargs="+", default=[48.0, 96.0, 128.0])
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: none)")
    args = ap.parse_args()
    reqs = requests(args.think)
    results = []
    for gib in args.gib:
        cap = int(gib * (1 << 30) / KV_BYTES_PER_TOKEN)
        row = {"think": args.think, "gib": gib}
        for order in ("lru", "learned", "belady"):
            row[order] = round(simulate(reqs, cap, order), 4)
        print(
            f"{args.think} {gib:g} GiB: lru {row['lru']:.1%}  learned {row['learned']:.1%}  "
            f"belady {row['belady']:.1%}",
            flush=True,
        )
        results.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
