"""The staging layout of a block: exactly ``sglang_hybrid.store.layout``'s slab bundle.

A bundle holds, for each full-attention layer ``l`` (of ``n``), its K plane then its V plane
(buffers ``l`` and ``n + l`` of ``kv_buffers = [K0..K(n-1), V0..V(n-1)]``); a plane is the 64 token
rows of that buffer back to back (a row: the pool's ``[heads, head_dim]`` bytes of one slot).
``block_bytes`` is their sum and a slab is that rounded up to 4 KiB. The staging buffer of a batch
is ``[blocks, pitch]`` bytes with ``pitch = slab_bytes`` by default, so blocks whose host slabs
are consecutive reach them in one contiguous copy. A tail (fewer than 64 rows) fills the first
rows of each plane, as ``store.transfer`` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

SLAB_ALIGN = 4096
BLOCK_TOKENS = 64


class BundleLayout(NamedTuple):
    offsets: tuple[int, ...]  # per buffer (index into kv_buffers): byte offset of its plane
    row_bytes: tuple[int, ...]  # per buffer: bytes of one token row
    block_bytes: int
    slab_bytes: int
    tokens: int


def row_bytes_of(buf: torch.Tensor) -> int:
    return buf[0].numel() * buf.element_size() if buf.dim() > 1 else buf.element_size()


def bundle_layout(kv_buffers: Sequence[torch.Tensor], tokens: int = BLOCK_TOKENS) -> BundleLayout:
    """The bundle layout of ``kv_buffers`` (``store.layout.build_layout``'s planes)."""
    n = len(kv_buffers) // 2
    order = [b for layer in range(n) for b in (layer, n + layer)]
    offsets = [0] * len(kv_buffers)
    rows = [row_bytes_of(b) for b in kv_buffers]
    off = 0
    for b in order:
        offsets[b] = off
        off += rows[b] * tokens
    slab = -(-off // SLAB_ALIGN) * SLAB_ALIGN
    return BundleLayout(tuple(offsets), tuple(rows), off, slab, tokens)


def from_slab_layout(layout: Any, n_buffers: int) -> BundleLayout:
    """A ``BundleLayout`` from ``store.layout.SlabLayout`` (anything with ``planes`` of
    ``(buffer, layer, row_bytes, offset)``, ``block_bytes`` and ``slab_bytes``)."""
    offsets = [-1] * n_buffers
    rows = [0] * n_buffers
    for p in layout.planes:
        if not 0 <= p.buffer < n_buffers:
            raise ValueError(f"layout plane names buffer {p.buffer}; there are {n_buffers}")
        offsets[p.buffer], rows[p.buffer] = p.offset, p.row_bytes
    if min(offsets) < 0:
        raise ValueError("layout has no plane for some KV buffer")
    tokens = layout.block_bytes // max(1, sum(rows))
    return BundleLayout(
        tuple(offsets), tuple(rows), layout.block_bytes, layout.slab_bytes, tokens or BLOCK_TOKENS
    )


def staging_buffer(
    kv_buffers: Sequence[torch.Tensor],
    n_blocks: int,
    device: torch.device | str | None = None,
    pitch: int | None = None,
) -> torch.Tensor:
    """An uninitialised ``[n_blocks, pitch]`` uint8 staging buffer (pitch: the slab size)."""
    lay = bundle_layout(kv_buffers)
    dev = device if device is not None else kv_buffers[0].device
    return torch.empty(n_blocks, pitch or lay.slab_bytes, dtype=torch.uint8, device=dev)
