"""Host slab accounting (spec §5.4): one budget, fixed-size slabs, an index-stack free list.

A slab holds one block bundle (the 64-token KV of every full-attention layer); a snapshot image
spans ``image_slabs`` slabs that need not be contiguous, a tail takes one more. The pool is
allocated in chunks of at most ``chunk_bytes`` of whole slabs, so a slab never crosses a chunk and a
strided copy run must split where chunks change. Capacity is simply the free-slab count: no
fragmentation, no geometry check. This module only counts; ``store/`` owns the bytes.
"""

from __future__ import annotations

from typing import NamedTuple

MAX_CHUNK_BYTES = 4 << 30


class ConfigError(ValueError):
    """A configuration the cache cannot honour; the message names the flag and the fix."""


class SlabAddress(NamedTuple):
    chunk: int
    offset: int  # bytes into the chunk


class HostSlabPool:
    def __init__(
        self,
        budget_bytes: int,
        slab_bytes: int,
        image_bytes: int,
        *,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        flag: str = "--hybrid-host-cache-mib",
    ) -> None:
        if slab_bytes <= 0 or image_bytes <= 0:
            raise ConfigError(
                f"slab and image sizes must be positive ({slab_bytes}, {image_bytes})"
            )
        self.slab_bytes = slab_bytes
        self.image_slabs = -(-image_bytes // slab_bytes)
        self.n_slabs = budget_bytes // slab_bytes
        need = self.image_slabs + 1
        if self.n_slabs < need:
            raise ConfigError(
                f"{flag}: a host budget of {budget_bytes / 2**20:.1f} MiB holds {self.n_slabs} "
                f"slabs of {slab_bytes} B, but one snapshot ({self.image_slabs} slabs) plus one "
                f"block needs {need} ({need * slab_bytes / 2**20:.1f} MiB); raise it, or pass 0 "
                f"to run without a host tier"
            )
        self.slabs_per_chunk = max(1, chunk_bytes // slab_bytes)
        self.n_chunks = -(-self.n_slabs // self.slabs_per_chunk)
        # Index stack: pop() hands out low ids first, so a fresh pool fills chunk 0 first.
        self._free = list(range(self.n_slabs - 1, -1, -1))
        self._used = bytearray(self.n_slabs)
        # A slab's allocation count: a reader on another thread (the L3 writer) that copies a
        # slab checks it did not change meanwhile (the bytes are only rewritten after an alloc).
        self.gen = [0] * self.n_slabs
        # Slabs an L3 fetch is writing (``l3_adopt``): used, owned by no node or snapshot yet.
        self.reserved: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_slabs - len(self._free)

    def chunk_slabs(self, chunk: int) -> int:
        return min(self.slabs_per_chunk, self.n_slabs - chunk * self.slabs_per_chunk)

    def address(self, slab: int) -> SlabAddress:
        return SlabAddress(
            slab // self.slabs_per_chunk, (slab % self.slabs_per_chunk) * self.slab_bytes
        )

    def alloc(self, k: int) -> list[int] | None:
        """``k`` slabs, or None (and nothing taken) when fewer are free."""
        if k > len(self._free):
            return None
        out = [self._free.pop() for _ in range(k)]
        gen = self.gen
        for s in out:
            self._used[s] = 1
            gen[s] += 1
        return out

    def release(self, slabs: list[int] | tuple[int, ...]) -> None:
        for s in slabs:
            if not self._used[s]:
                raise AssertionError(f"slab {s} freed twice")
            self._used[s] = 0
            self._free.append(s)

    def is_used(self, slab: int) -> bool:
        return bool(self._used[slab])
