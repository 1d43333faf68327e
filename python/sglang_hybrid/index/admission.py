"""Admission: choose a source and check capacity by arithmetic (spec §6.2-6.3).

Candidates are the root, the deepest valid snapshot s* and the deepest fully device-resident one
s_dev. Each costs its restore (host-only path blocks, image and tail over H2D) plus the prefill from
its frontier; the cheapest wins, ties going to fewer transferred bytes. Capacity, in device tokens:

    need(s) = 64 * host-only path blocks + tail footprint (its private copy) + growth(n, F_s)

against ``free + evictable``, where evictable excludes the pages this admission would pin itself.
When the cheapest does not fit, fall back to s_dev, then the root. A root that does not fit now is
TemporarilyBlocked; one that would not fit even in an empty cache is PermanentlyInfeasible.

A quote records the index epoch; any mutation that can invalidate it bumps the epoch, so a stale
quote is detected in O(1) instead of being trusted.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple

from .keys import BLOCK_TOKENS
from .match import Match
from .node import FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


class Readiness(enum.IntEnum):
    READY = 0
    TEMPORARILY_BLOCKED = 1
    PERMANENTLY_INFEASIBLE = 2


class Candidate(NamedTuple):
    snapshot: Snapshot | None  # None: the root
    frontier: int
    host_blocks: int  # path blocks to restore from host
    restore_bytes: int
    seconds: float  # restore + prefill of the rest
    need_tokens: int  # device tokens the admission must find


class Quote(NamedTuple):
    readiness: Readiness
    choice: Candidate
    candidates: tuple[Candidate, ...]
    epoch: int


def candidate(index: PrefixIndex, m: Match, s: Snapshot | None, growth_tokens: int) -> Candidate:
    f = s.frontier if s is not None else 0
    k = f // BLOCK_TOKENS
    host_blocks = sum(1 for node in m.path[:k] if node.device_state is R.ABSENT)
    nbytes = host_blocks * index.slab_bytes
    need = host_blocks * BLOCK_TOKENS + growth_tokens
    if s is not None:
        if s.device_state is R.ABSENT:
            nbytes += index.image_bytes
        if s.tail:
            if s.tail_device_state is R.ABSENT:
                nbytes += index.slab_bytes
            need += s.tail_device_tokens or len(s.tail) // 4
    cost = index.valuer.cost
    seconds = cost.restore_seconds(nbytes) + cost.prefill_seconds(f, m.n - f)
    return Candidate(s, f, host_blocks, nbytes, seconds, need)


def candidates(index: PrefixIndex, m: Match, request_tokens: int) -> list[Candidate]:
    """s*, s_dev and the root (each once), in that order."""
    seen: set[int] = set()
    cands: list[Candidate] = []
    for s in (m.best, m.best_device, None):
        key = s.id if s is not None else 0
        if key in seen:
            continue
        seen.add(key)
        f = s.frontier if s is not None else 0
        cands.append(candidate(index, m, s, request_tokens - f))
    return cands


def _ranked(cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: (c.seconds, c.restore_bytes))


def cheapest(index: PrefixIndex, m: Match, *, request_tokens: int) -> Candidate:
    """The source costing least (restore + prefill), capacity aside: for a binding whose engine
    budgets the restore's pages itself (SGLang's load-back admission)."""
    return _ranked(candidates(index, m, request_tokens))[0]


def quote(
    index: PrefixIndex,
    m: Match,
    *,
    request_tokens: int,
    free_tokens: int,
    pool_tokens: int,
) -> Quote:
    """Pick the source for a prompt matched as ``m`` (§6.2) and classify its capacity (§6.3).

    ``request_tokens`` is the request's whole entitlement (prompt, output window, cushion); a
    source at F needs ``request_tokens - F`` of it as new pages. ``free_tokens`` is the pool's
    free count and ``pool_tokens`` its size.
    """
    cands = candidates(index, m, request_tokens)
    ranked = _ranked(cands)
    fallback = [c for c in cands if c is not ranked[0]]  # s_dev then root, in that order
    for c in (ranked[0], *fallback):
        if c.need_tokens <= free_tokens + _evictable_excluding(index, m, c):
            return Quote(Readiness.READY, c, tuple(cands), index.epoch)
    root = cands[-1]
    ready = (
        Readiness.TEMPORARILY_BLOCKED
        if root.need_tokens <= pool_tokens
        else Readiness.PERMANENTLY_INFEASIBLE
    )
    return Quote(ready, root, tuple(cands), index.epoch)


def is_current(index: PrefixIndex, q: Quote) -> bool:
    return q.epoch == index.epoch


def _evictable_excluding(index: PrefixIndex, m: Match, c: Candidate) -> int:
    """Evictable tokens once this admission has pinned its own path and tail."""
    k = c.frontier // BLOCK_TOKENS
    own = sum(BLOCK_TOKENS for node in m.path[:k] if node in index.lru)
    s = c.snapshot
    if s is not None and s.tail and s in index.lru:
        own += s.tail_device_tokens
    return index.lru.tokens - own
