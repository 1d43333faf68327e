"""The work of the L3 threads: objects out of host slabs, lookups, objects into host slabs.

:class:`L3Client` joins a backend (``backend.py``), the byte format (``objects.py``) and the host
tier's memory; its methods are the bodies of the jobs ``sglang/l3_tier.py`` submits and never run
on the scheduler thread. Each thread has its own staging buffer (registered with the backend):
an object is built or checked there, so a host slab is read only while its allocation count
shows it still holds what was asked for (the write side), and written only once the object was
verified (the read side).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...index.host_slabs import HostSlabPool
from ...index.keys import BLOCK_BYTES, BLOCK_TOKENS
from ...index.l3_keys import KeySpace, ProbePlan, chain_digests, snapshot_digest
from ...index.l3_keys import snapshot_candidates as candidates
from ..host_memory import HostMemory
from .backend import L3Backend, L3Url
from .connect import open_backend
from .jobs import Job
from .objects import (
    HEADER_BYTES,
    Expect,
    Geometry,
    Kind,
    Refusal,
    object_bytes,
    verify,
    write_header,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
STAGING_BYTES = 64 * MiB
OFF_GRID_ANCHORS = 32  # anchors whose 63 off-grid frontiers a lookup asks for (l3_keys)


class PutTarget(NamedTuple):
    """One object to write: a block at ``depth`` of the path, from ``slab`` (allocation ``gen``)."""

    depth: int
    slab: int
    gen: int


class SnapshotOut(NamedTuple):
    frontier: int
    tail: bytes
    kind: int
    image_slabs: tuple[int, ...]
    tail_slab: int
    gens: tuple[int, ...]  # of image_slabs, then of the tail slab


class ProbeResult(NamedTuple):
    digests: list[bytes]  # blocks [0, blocks)
    run: int  # blocks present in L3 from plan.first_block on
    frontier: int  # the deepest snapshot found; 0: none


class FetchResult(NamedTuple):
    refusal: Refusal | None
    detail: str = ""
    nbytes: int = 0
    snapshot_kind: int = 0


@dataclass(slots=True)
class PutCounts:
    objects: int = 0
    nbytes: int = 0
    present: int = 0  # already in the store
    changed: int = 0  # the slab was reused before it was read: not written
    failed: int = 0  # the store refused (full, say)
    written: list[tuple[int, int]] = field(default_factory=list)  # (slab, gen) read into objects


@dataclass(slots=True)
class ClientCounters:
    put: PutCounts = field(default_factory=PutCounts)
    refused: dict[str, int] = field(default_factory=dict)


class L3Client:
    def __init__(
        self,
        url: L3Url,
        space: KeySpace,
        geometry: Geometry,
        memory: HostMemory,
        *,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        self.url = url
        self.space = space
        self.g = geometry
        self.memory = memory
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.backend: L3Backend | None = None
        biggest = object_bytes(geometry, Kind.SNAPSHOT, True)
        size = max(STAGING_BYTES, 2 * biggest)
        self.read_buf = np.zeros(size, dtype=np.uint8)
        self.write_buf = np.zeros(size, dtype=np.uint8)
        self.counters = ClientCounters()

    # ---------------------------------------------------------------- connection
    def connect(self, job: Job | None = None) -> str:
        """Open the backend and register both staging buffers (an L3 thread; blocking)."""
        if self.backend is None:
            backend = open_backend(self.url, tp_rank=self.tp_rank, tp_size=self.tp_size)
            backend.register(self.read_buf)
            backend.register(self.write_buf)
            self.backend = backend
        return self.backend.name

    def _backend(self) -> L3Backend:
        if self.backend is None:
            self.connect()
        assert self.backend is not None
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:  # shutting down: nothing to recover
                logger.debug("closing the L3 backend failed", exc_info=True)
            self.backend = None

    # ---------------------------------------------------------------- writes
    def _slab(self, slab: int) -> np.ndarray:
        out: np.ndarray = self.memory.slab(slab).numpy()
        return out

    def _unchanged(self, pool: HostSlabPool, slabs: Sequence[int], gens: Sequence[int]) -> bool:
        return self.memory.pool is pool and all(
            pool.gen[s] == g and pool.is_used(s) for s, g in zip(slabs, gens, strict=True)
        )

    def put_blocks(
        self,
        job: Job,
        tokens: bytes,
        extras: list[int] | None,
        targets: list[PutTarget],
        pool: HostSlabPool,
    ) -> PutCounts:
        """Write blocks of one path (``tokens``: the path's packed tokens from the root)."""
        backend, c = self._backend(), PutCounts()
        depth = max(t.depth for t in targets) + 1
        digests = chain_digests(tokens, 0, depth, extras)
        keys = [self.space.block(digests[t.depth]) for t in targets]
        have = backend.exists(keys)
        size = object_bytes(self.g, Kind.BLOCK, False)
        todo = [(k, t) for k, t, h in zip(keys, targets, have, strict=True) if not h]
        c.present = len(targets) - len(todo)
        per = len(self.write_buf) // size
        for i in range(0, len(todo), per):
            batch_keys: list[str] = []
            bufs: list[np.ndarray] = []
            read: list[PutTarget] = []
            for j, (key, t) in enumerate(todo[i : i + per]):
                buf = self.write_buf[j * size : (j + 1) * size]
                if not self._unchanged(pool, (t.slab,), (t.gen,)):
                    c.changed += 1
                    continue
                buf[HEADER_BYTES:] = self._slab(t.slab)[: self.g.block_bytes]
                if not self._unchanged(pool, (t.slab,), (t.gen,)):  # reused while copied
                    c.changed += 1
                    continue
                b = t.depth * BLOCK_BYTES
                e = Expect(
                    Kind.BLOCK,
                    self.space.fingerprint,
                    digests[t.depth],
                    tokens[b : b + BLOCK_BYTES],
                )
                write_header(buf.data, self.g, e, self.g.block_bytes)
                batch_keys.append(key)
                bufs.append(buf)
                read.append(t)
            for t, ok in zip(read, backend.put(batch_keys, bufs), strict=True):
                if ok:
                    c.objects += 1
                    c.nbytes += size
                    c.written.append((t.slab, t.gen))
                else:
                    c.failed += 1
        self._count_put(c)
        return c

    def put_snapshot(
        self,
        job: Job,
        tokens: bytes,
        extras: list[int] | None,
        snap: SnapshotOut,
        pool: HostSlabPool,
    ) -> PutCounts:
        """Write a snapshot's image and tail (``tokens``: its anchor path's, from the root)."""
        backend, c = self._backend(), PutCounts()
        anchor_depth = snap.frontier // BLOCK_TOKENS - 1
        digests = chain_digests(tokens, 0, anchor_depth + 1, extras)
        anchor = digests[-1] if digests else b"sglang-hybrid-l3"
        digest = snapshot_digest(anchor, snap.frontier, snap.tail)
        key = self.space.snapshot(digest)
        if backend.exists([key])[0]:
            c.present = 1
            self._count_put(c)
            return c
        has_tail = snap.tail_slab >= 0
        size = object_bytes(self.g, Kind.SNAPSHOT, has_tail)
        buf = self.write_buf[:size]
        slabs = (*snap.image_slabs, *((snap.tail_slab,) if has_tail else ()))
        if not self._unchanged(pool, slabs, snap.gens):
            c.changed = 1
            self._count_put(c)
            return c
        self._gather_image(buf[HEADER_BYTES:], snap.image_slabs)
        if has_tail:
            at = HEADER_BYTES + self.g.image_bytes
            buf[at : at + self.g.block_bytes] = self._slab(snap.tail_slab)[: self.g.block_bytes]
        if not self._unchanged(pool, slabs, snap.gens):
            c.changed = 1
            self._count_put(c)
            return c
        e = Expect(Kind.SNAPSHOT, self.space.fingerprint, digest, snap.tail, snap.frontier)
        write_header(buf.data, self.g, e, size - HEADER_BYTES, snap.kind)
        if backend.put([key], [buf])[0]:
            c.objects, c.nbytes = 1, size
            c.written = list(zip(slabs, snap.gens, strict=True))
        else:
            c.failed = 1
        self._count_put(c)
        return c

    def _gather_image(self, dst: np.ndarray, slabs: Sequence[int]) -> None:
        """The image's bytes from its slabs (byte o in image slab o // slab_bytes)."""
        sb, n = self.g.slab_bytes, self.g.image_bytes
        for k, s in enumerate(slabs):
            lo = k * sb
            hi = min(n, lo + sb)
            if lo >= n:
                break
            dst[lo:hi] = self._slab(s)[: hi - lo]

    def _count_put(self, c: PutCounts) -> None:
        p = self.counters.put
        p.objects += c.objects
        p.nbytes += c.nbytes
        p.present += c.present
        p.changed += c.changed
        p.failed += c.failed

    # ---------------------------------------------------------------- lookups
    def probe(
        self, job: Job, data: bytes, extras: list[int] | None, plan: ProbePlan
    ) -> ProbeResult:
        """The blocks past the local path present in L3 (a leading run), then the deepest
        snapshot on what is available (``l3_keys.snapshot_candidates``)."""
        backend = self._backend()
        digests = chain_digests(data, 0, plan.blocks, extras)
        want = [self.space.block(d) for d in digests[plan.first_block :]]
        run = 0
        for present in backend.exists(want):
            if not present:
                break
            run += 1
        cands = candidates(plan, plan.first_block + run, OFF_GRID_ANCHORS)
        if not cands:
            return ProbeResult(digests, run, 0)
        keys = []
        for a, t in cands:
            f = BLOCK_TOKENS * (a + 1) + t
            tail = data[BLOCK_BYTES * (a + 1) : 4 * f]
            keys.append(self.space.snapshot(snapshot_digest(digests[a], f, tail)))
        found = 0
        for (a, t), present in zip(cands, backend.exists(keys), strict=True):
            if present:
                found = max(found, BLOCK_TOKENS * (a + 1) + t)
        return ProbeResult(digests, run, found)

    def fetch(
        self,
        job: Job,
        data: bytes,
        digests: list[bytes],
        first_block: int,
        frontier: int,
        block_slabs: list[int],
        image_slabs: list[int],
        tail_slab: int,
    ) -> FetchResult:
        """Read blocks [first_block, anchor] and the snapshot at ``frontier`` into staging,
        verify each, then (unless the job was cancelled) copy them into the reserved slabs."""
        backend, g, fp = self._backend(), self.g, self.space.fingerprint
        anchor = frontier // BLOCK_TOKENS - 1
        has_tail = frontier % BLOCK_TOKENS != 0
        tail = data[BLOCK_BYTES * (anchor + 1) : 4 * frontier]
        sdigest = snapshot_digest(digests[anchor], frontier, tail)
        items: list[tuple[str, Expect, int]] = [
            (
                self.space.block(digests[b]),
                Expect(Kind.BLOCK, fp, digests[b], data[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]),
                object_bytes(g, Kind.BLOCK, False),
            )
            for b in range(first_block, anchor + 1)
        ]
        items.append(
            (
                self.space.snapshot(sdigest),
                Expect(Kind.SNAPSHOT, fp, sdigest, tail, frontier),
                object_bytes(g, Kind.SNAPSHOT, has_tail),
            )
        )
        moved, skind, i = 0, 0, 0
        buf = self.read_buf
        while i < len(items):  # batches that fit the staging buffer
            j, used = i, 0
            while j < len(items) and used + items[j][2] <= len(buf):
                used += items[j][2]
                j += 1
            offs = np.cumsum([0] + [it[2] for it in items[i:j]]).tolist()
            views = [buf[offs[k] : offs[k] + items[i + k][2]] for k in range(j - i)]
            got = backend.get([it[0] for it in items[i:j]], views)
            for k, n in enumerate(got):
                key, e, _ = items[i + k]
                if n < 0:
                    return self._refuse(Refusal.MISSING if n == -1 else Refusal.ERROR, key)
                v = verify(views[k].data, n, g, e)
                if v.refusal is not None:
                    return self._refuse(v.refusal, key, v.detail)
                skind = v.snapshot_kind
            with job.writing():  # raises Cancelled once the scheduler gave the slabs back
                for k in range(j - i):
                    idx = i + k
                    src = views[k][HEADER_BYTES:]
                    if idx < len(block_slabs):
                        self._slab(block_slabs[idx])[: g.block_bytes] = src[: g.block_bytes]
                    else:
                        self._scatter_image(src, image_slabs)
                        if has_tail:
                            at = g.image_bytes
                            self._slab(tail_slab)[: g.block_bytes] = src[at : at + g.block_bytes]
                    moved += items[idx][2] - HEADER_BYTES
            i = j
        return FetchResult(None, nbytes=moved, snapshot_kind=skind)

    def _scatter_image(self, src: np.ndarray, slabs: Sequence[int]) -> None:
        sb, n = self.g.slab_bytes, self.g.image_bytes
        for k, s in enumerate(slabs):
            lo = k * sb
            if lo >= n:
                break
            hi = min(n, lo + sb)
            self._slab(s)[: hi - lo] = src[lo:hi]

    def _refuse(self, why: Refusal, key: str, detail: str = "") -> FetchResult:
        name = why.name.lower()
        self.counters.refused[name] = self.counters.refused.get(name, 0) + 1
        if why is not Refusal.MISSING:
            logger.warning(
                "L3 object %s refused (%s%s); recomputing",
                key,
                name,
                f": {detail}" if detail else "",
            )
        return FetchResult(why, detail)
