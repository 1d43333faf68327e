"""The bytes of one L3 object: a checked header, then a block bundle or a state image (issue #39).

Layout (little endian), fixed size per kind so a reader knows how many bytes to ask for::

    magic "SGLHYL3\\0" | u16 version | u8 kind | u8 snapshot kind | u32 payload bytes
    fingerprint (16) | digest (16) | u64 frontier | u32 tail tokens | u32 slab bytes
    u64 xxh3(payload) | tokens (256: the block's, or the tail's zero-padded)
    u64 xxh3(everything above)
    payload: a block bundle (``block_bytes``), or a state image (``image_bytes``) followed, when
    the snapshot has a tail, by the tail's block bundle (``block_bytes``, its first rows valid)

A reader refuses an object unless every field is what it asked for: the magic and version, the
kind, its own fingerprint (a *foreign* object: another model, layout, TP rank or version), the
digest it looked up (a *misplaced* object: an object stored under another key), the tokens it
resumes on (the prompt's block, the snapshot's tail: exact identity, §5.1), the sizes of its
geometry, and both checksums (a *corrupt* or *truncated* object). Nothing refused ever reaches a
host slab: objects land in a staging buffer and are copied into slabs only once verified.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import xxhash

from ...index.keys import BLOCK_BYTES

MAGIC = b"SGLHYL3\0"
VERSION = 1
HEAD = struct.Struct("<8sHBBI16s16sQIIQ")
TOKENS = BLOCK_BYTES
SUM = struct.Struct("<Q")
HEADER_BYTES = HEAD.size + TOKENS + SUM.size


class Kind(IntEnum):
    BLOCK = 1
    SNAPSHOT = 2


class Refusal(IntEnum):
    """Why a fetched object was not taken (counted per reason)."""

    MISSING = 1  # gone between the lookup and the fetch (evicted by the store)
    TRUNCATED = 2  # fewer bytes than its geometry
    CORRUPT = 3  # a checksum, the magic or a size does not match
    FOREIGN = 4  # another fingerprint: model, layout, TP rank or version
    MISPLACED = 5  # a valid object of another key, or other tokens than the prompt's
    ERROR = 6  # the store failed the read


class Geometry(NamedTuple):
    block_bytes: int  # a block bundle (the meaningful bytes of a slab)
    image_bytes: int
    slab_bytes: int


class Expect(NamedTuple):
    """What a reader asks for, and checks the object against."""

    kind: Kind
    fingerprint: bytes
    digest: bytes
    tokens: bytes  # the block's packed tokens, or the snapshot's tail
    frontier: int = 0


def payload_bytes(g: Geometry, kind: Kind, has_tail: bool) -> int:
    if kind is Kind.BLOCK:
        return g.block_bytes
    return g.image_bytes + (g.block_bytes if has_tail else 0)


def object_bytes(g: Geometry, kind: Kind, has_tail: bool) -> int:
    return HEADER_BYTES + payload_bytes(g, kind, has_tail)


def write_header(
    buf: memoryview, g: Geometry, e: Expect, payload: int, snapshot_kind: int = 0
) -> None:
    """Fill ``buf``'s header for the payload already placed after it (``payload`` bytes)."""
    if len(e.tokens) > TOKENS:
        raise ValueError(f"{len(e.tokens)} token bytes do not fit the header")
    body = buf[HEADER_BYTES : HEADER_BYTES + payload]
    tail_tokens = len(e.tokens) // 4 if e.kind is Kind.SNAPSHOT else 0
    HEAD.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        int(e.kind),
        snapshot_kind,
        payload,
        e.fingerprint,
        e.digest,
        e.frontier,
        tail_tokens,
        g.slab_bytes,
        xxhash.xxh3_64_intdigest(body),
    )
    buf[HEAD.size : HEAD.size + TOKENS] = e.tokens.ljust(TOKENS, b"\0")
    SUM.pack_into(buf, HEAD.size + TOKENS, xxhash.xxh3_64_intdigest(buf[: HEAD.size + TOKENS]))


class Verified(NamedTuple):
    refusal: Refusal | None
    snapshot_kind: int = 0
    detail: str = ""


def verify(buf: memoryview, got: int, g: Geometry, e: Expect) -> Verified:
    """Check the object ``buf[:got]`` against what was asked for (see the module docstring)."""
    has_tail = e.kind is Kind.SNAPSHOT and e.frontier % 64 != 0
    want = object_bytes(g, e.kind, has_tail)
    if got < want:
        return Verified(Refusal.TRUNCATED, detail=f"{got} of {want} bytes")
    if got > want:
        return Verified(Refusal.CORRUPT, detail=f"{got} bytes, its geometry says {want}")
    head = buf[: HEAD.size + TOKENS]
    (hsum,) = SUM.unpack_from(buf, HEAD.size + TOKENS)
    if xxhash.xxh3_64_intdigest(head) != hsum:
        return Verified(Refusal.CORRUPT, detail="header checksum")
    magic, version, kind, skind, payload, fp, digest, frontier, tail_tokens, slab, psum = (
        HEAD.unpack_from(buf, 0)
    )
    if magic != MAGIC or version != VERSION:
        return Verified(Refusal.CORRUPT, detail=f"magic {magic!r} version {version}")
    if fp != e.fingerprint:
        return Verified(Refusal.FOREIGN, detail=f"fingerprint {fp.hex()}")
    if kind != int(e.kind) or digest != e.digest or frontier != e.frontier:
        return Verified(Refusal.MISPLACED, detail="kind, digest or frontier")
    n_tokens = len(e.tokens)
    if bytes(buf[HEAD.size : HEAD.size + TOKENS]) != e.tokens.ljust(TOKENS, b"\0") or (
        e.kind is Kind.SNAPSHOT and 4 * tail_tokens != n_tokens
    ):
        return Verified(Refusal.MISPLACED, detail="tokens")
    if payload != want - HEADER_BYTES or slab != g.slab_bytes:
        return Verified(Refusal.CORRUPT, detail=f"payload {payload}, slab {slab}")
    if xxhash.xxh3_64_intdigest(buf[HEADER_BYTES:want]) != psum:
        return Verified(Refusal.CORRUPT, detail="payload checksum")
    return Verified(None, skind)
