"""Content keys of the shared third tier, L3 (issue #39; the spec's §5.1 identity, fleet-wide).

An L3 object is found by a key any server computes from the prompt alone, and is taken only if
it means the same bytes to the reader (``store/l3/objects.py`` verifies that). The key is:

- a *prefix digest*: BLAKE2b-128 chained over the 64-token blocks, ``d_b = H(d_{b-1} || block
  b's packed int32 tokens || its extra key)`` from a fixed root. The index's lookup hash
  (``keys.py``) is a 64-bit xxh3 chain that only selects a child and is confirmed by an exact
  compare; an L3 key is confirmed by nothing but the object's header, so it must not collide for
  any prompt a client may send: 128 bits of a cryptographic hash, never xxh3 (whose collisions
  can be built on purpose, and then a tenant sharing a namespace could poison another's prefix);
- a snapshot's digest chains its anchor block's digest with its frontier and tail tokens;
- the *fingerprint* (``sglang/l3_tier.py``: model, config, weights, dtypes, page size, TP rank and
  size, the byte layout's sources) and an operator's prefix, both in the key string, so a server
  of another model, layout or TP rank never asks for another's objects. Each TP rank holds its
  own KV heads and state shards: its objects carry its rank in the fingerprint.

The extra key carries SGLang's namespace (``extra_key``, ``cache_salt``) as the index does, so a
tenant's blocks never share a key with another's. Pure Python: computed on the L3 threads, never
on the scheduler's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from .keys import BLOCK_BYTES, BLOCK_TOKENS, TOKEN_BYTES

DIGEST_BYTES = 16
ROOT_DIGEST = b"sglang-hybrid-l3"  # d_{-1}: any fixed 16 bytes
KEY_VERSION = 1  # in every key: a change of derivation never meets the old objects


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def chain_digests(
    data: bytes, start: int, end: int, extras: Sequence[int] | None, prev: bytes = ROOT_DIGEST
) -> list[bytes]:
    """Digests of blocks [start, end) of the packed prompt ``data``; ``prev`` is block
    ``start - 1``'s (the root's for 0). ``extras[b]``: block b's extra key (None: all 0)."""
    out: list[bytes] = []
    d = prev
    for b in range(start, end):
        x = extras[b] if extras is not None else 0
        blk = data[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]
        d = _h(d + blk + (x & (2**64 - 1)).to_bytes(8, "little"))
        out.append(d)
    return out


def snapshot_digest(anchor_digest: bytes, frontier: int, tail: bytes) -> bytes:
    """A snapshot's digest: its anchor block's (the root's when F < 64), its frontier and its
    tail tokens (the exact tokens past the anchor, §5.3)."""
    if len(tail) != TOKEN_BYTES * (frontier % BLOCK_TOKENS):
        raise ValueError(f"tail of {len(tail)} bytes for frontier {frontier}")
    return _h(anchor_digest + b"snap" + frontier.to_bytes(8, "little") + tail)


class KeySpace(NamedTuple):
    """Where one server's objects live: an operator's prefix and its fingerprint digest."""

    prefix: str
    fingerprint: bytes  # DIGEST_BYTES

    def _base(self) -> str:
        return f"{self.prefix}sglh{KEY_VERSION}-{self.fingerprint.hex()}"

    def block(self, digest: bytes) -> str:
        return f"{self._base()}-b-{digest.hex()}"

    def snapshot(self, digest: bytes) -> str:
        return f"{self._base()}-s-{digest.hex()}"


def fingerprint_digest(fields: dict[str, object]) -> bytes:
    """The fingerprint's fields (sorted, ``repr``'d) to DIGEST_BYTES."""
    text = "\n".join(f"{k}={fields[k]!r}" for k in sorted(fields))
    return _h(text.encode())


class ProbePlan(NamedTuple):
    """What one lookup asks L3: the blocks past the local path, then snapshots deeper than the
    local best source (§6.2), deepest first."""

    first_block: int  # blocks [first_block, blocks) are probed (the local path ends there)
    blocks: int  # full blocks a resume point may use: floor((n - 1) / 64)
    min_frontier: int  # only snapshots deeper than this are worth fetching
    max_frontier: int  # n - 1: at least one prompt token is always prefilled (§6.1)


def snapshot_candidates(
    plan: ProbePlan, available: int, off_grid_anchors: int
) -> list[tuple[int, int]]:
    """(anchor block, tail length) of the snapshots to ask for, deepest frontier first.

    ``available`` blocks from the root are known (local path and L3 run). Snapshots on the block
    grid (no tail) are asked for at every anchor; off the grid (an endpoint, a cut inside a
    block: tails of 1..63 tokens) only at the ``off_grid_anchors`` deepest anchors, 63 keys each:
    a follow-up turn resumes near its prompt's end. The anchor of frontier F is block
    ``F // 64 - 1`` (-1: the root, never asked: it saves under 64 tokens).
    """
    out: list[tuple[int, int]] = []
    top = min(available, plan.blocks) - 1
    for a in range(top, -1, -1):
        base = BLOCK_TOKENS * (a + 1)
        if base + BLOCK_TOKENS - 1 <= plan.min_frontier:
            break
        tails = range(BLOCK_TOKENS - 1, -1, -1) if top - a < off_grid_anchors else (0,)
        for t in tails:
            f = base + t
            if plan.min_frontier < f <= plan.max_frontier:
                out.append((a, t))
    return out
