"""The host tier's memory: one budget of slabs, allocated in chunks of at most 4 GiB (spec §5.4).

Pinned when CUDA is present (so copies run on the copy engines and overlap compute), pageable on
a CPU-only machine. Chunks hold whole slabs, so a slab never crosses a chunk and a strided copy
run never needs to. Slab ids and their addresses come from the index's ``HostSlabPool``; this
class only owns the bytes. A failed allocation is a startup error naming the flag.
"""

from __future__ import annotations

import torch

from ..index import ConfigError
from ..index.host_slabs import HostSlabPool


class HostMemory:
    pool: HostSlabPool  # (declared here: rebind, defined first, reads it)

    def rebind(self, pool: HostSlabPool) -> None:
        """Serve a fresh index's slab pool from the same bytes (a cache reset keeps them)."""
        if (pool.n_slabs, pool.slab_bytes) != (self.pool.n_slabs, self.pool.slab_bytes):
            raise ValueError("a rebound slab pool must have the geometry the memory was made for")
        self.pool = pool

    def __init__(self, pool: HostSlabPool, *, pin: bool | None = None) -> None:
        self.pool = pool
        self.slab_bytes = pool.slab_bytes
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = pin
        self.chunks: list[torch.Tensor] = []
        try:
            for c in range(pool.n_chunks):
                nbytes = pool.chunk_slabs(c) * pool.slab_bytes
                self.chunks.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
        except (RuntimeError, MemoryError) as e:
            total = pool.n_slabs * pool.slab_bytes
            self.chunks.clear()
            raise ConfigError(
                f"--hybrid-host-cache-mib: allocating {total / 2**20:.0f} MiB of "
                f"{'pinned' if pin else 'host'} memory failed ({e}); lower the budget"
            ) from e

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def slab(self, slab: int) -> torch.Tensor:
        """The bytes of one slab (a view)."""
        chunk, offset = self.pool.address(slab)
        return self.chunks[chunk][offset : offset + self.slab_bytes]

    def run(self, first: int, count: int, offset: int, length: int) -> torch.Tensor:
        """``count`` consecutive slabs from ``first`` (one chunk), bytes [offset, offset+length)
        of each: a strided ``[count, length]`` view, one copy per plane for a whole run."""
        chunk, base = self.pool.address(first)
        return self.chunks[chunk].as_strided((count, length), (self.slab_bytes, 1), base + offset)
