"""Unrelated warm-up traffic: fill the pools with evictable cache before the measured requests.

A benchmark that starts from a flushed pool measures a cache that never has to choose what to
drop. A server in steady state has its KV pool full of other traffic's blocks and its state slots
full of other traffic's snapshots; the measured requests must win room from them. The warm-up is
that other traffic: replayed before the trace, finished (so everything it left is evictable)
before the first measured request is released, and left out of every result.

Contract:
- ``unrelated_warmup(trace, requests=None, kv_tokens=0, min_requests=0, seed=0) -> Trace``:
  requests named ``warmup.K``, all arriving at t = 0 (together: SGLang admits them as its running
  cap and pools allow), without tap hints (token-id traffic), prompt and output lengths drawn
  (seeded) from ``trace``'s own requests, token ids from their own seeded streams. Exactly
  ``requests`` of them when given, else as many as it takes for their KV tokens (prompt + output)
  to reach ``kv_tokens`` and their count to reach ``min_requests``. Same arguments, same trace.
- **Disjoint from the trace**: no warm-up prompt starts with a token any trace prompt starts
  with, so no warm-up prompt shares a prefix (of any length, at any page size) with a trace
  prompt; ``check_disjoint`` verifies it and raises ``ReplayError`` otherwise. The warm-up's
  answers are the unscripted ones (``trace.output_tokens``: hashed from the rid).
- ``pool_warmup(trace, plan, seed)``: the warm-up that fills ``plan``'s pools (``--prefill-pool``):
  KV tokens ``FILL_FACTOR`` times the KV pool (the pool ends full even where the warm-up's own
  requests evict each other) and at least ``SLOT_FACTOR`` times as many requests as state slots
  (each request leaves an endpoint, and ``hybrid`` a prompt-tail tap too, so every slot a cache
  keeps states in is taken).
- ``without_hints(trace)``: the same requests without tap hints (hint-less token-id traffic).
"""

from __future__ import annotations

import dataclasses
import random

from .budget import PoolPlan
from .errors import ReplayError
from .tokens import VOCAB_SIZE, hashed_tokens
from .trace import Trace, TraceRequest

FILL_FACTOR = 1.5
SLOT_FACTOR = 1
_WARMUP_SEED = 0x3A4D0  # the warm-up's token streams, apart from every generator's
PREFIX = "warmup."


def _first_tokens(trace: Trace) -> set[int]:
    return {int(r.input_ids[0]) for r in trace.requests if r.n}


def unrelated_warmup(
    trace: Trace,
    *,
    requests: int | None = None,
    kv_tokens: int = 0,
    min_requests: int = 0,
    seed: int = 0,
) -> Trace:
    """Unrelated requests shaped like ``trace``'s (see the module contract)."""
    if not trace.requests:
        raise ReplayError("a warm-up needs a trace to draw its lengths from")
    if requests is not None and requests < 0:
        raise ValueError(f"warm-up requests must be non-negative, got {requests}")
    taken = _first_tokens(trace)
    if len(taken) >= VOCAB_SIZE - 16:
        raise ReplayError("every token id starts a trace prompt: no disjoint warm-up exists")
    rng = random.Random(f"{seed}/warmup")
    shapes = [(r.n, r.output_len) for r in trace.requests]
    out: list[TraceRequest] = []
    total = 0
    while (requests is not None and len(out) < requests) or (
        requests is None and (total < kv_tokens or len(out) < min_requests)
    ):
        n, output_len = rng.choice(shapes)
        k = len(out)
        ids = hashed_tokens(_WARMUP_SEED ^ seed, k, n)
        if int(ids[0]) in taken:  # remapped to the next id no trace prompt starts with
            ids[0] = hashed_tokens(_WARMUP_SEED ^ seed, k, 1, avoid=taken)[0]
        out.append(
            TraceRequest(
                rid=f"{PREFIX}{k}",
                input_ids=ids,
                output_len=output_len,
                arrival_s=0.0,
                tag="warmup",
            )
        )
        total += n + output_len
    warm = Trace(
        name=f"{trace.name}-warmup",
        requests=out,
        source=f"unrelated_warmup({len(out)} requests, {total:,} KV tokens, seed={seed})",
    )
    check_disjoint(warm, trace)
    return warm


def check_disjoint(warmup: Trace, trace: Trace) -> None:
    """Raise ``ReplayError`` if a warm-up prompt could share a prefix with a trace prompt."""
    taken = _first_tokens(trace)
    rids = {r.rid for r in trace.requests}
    for r in warmup.requests:
        if r.rid in rids:
            raise ReplayError(f"warm-up request {r.rid!r} has a trace request's rid")
        if r.n and int(r.input_ids[0]) in taken:
            raise ReplayError(f"warm-up request {r.rid!r} starts like a trace prompt")


def pool_warmup(trace: Trace, plan: PoolPlan, seed: int = 0) -> Trace:
    """The warm-up that fills ``plan``'s KV pool and state slots (see the module contract)."""
    return unrelated_warmup(
        trace,
        kv_tokens=int(FILL_FACTOR * plan.kv_tokens),
        min_requests=SLOT_FACTOR * plan.state_slots,
        seed=seed,
    )


def without_hints(trace: Trace) -> Trace:
    """``trace`` without tap hints: what a server sees from token-id (``/generate``) clients."""
    reqs = [dataclasses.replace(r, hint_positions=(), hint_kinds=()) for r in trace.requests]
    return Trace(f"{trace.name}-nohints", reqs, f"{trace.source} [hints dropped]")
