"""Byte layouts of a slab: a block bundle, and a state image spread over slabs (spec §5.4, §11.2).

A *block bundle* is the 64-token KV of every full-attention layer as SGLang's KV pool stores it:
for each layer its K plane then its V plane, each plane the 64 rows ``[heads, head_dim]`` of the
pool buffer, back to back. A slab is the bundle rounded up to 4 KiB. A *state image* is one
MambaPool slot (conv and recurrent state of every linear-attention layer), packed layer by
layer so a restore can land in forward order; its byte ``o`` lives in image slab ``o // slab``.
Copies between the two sides are pure byte copies: restore is bit-exact for any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

SLAB_ALIGN = 4096


class Plane(NamedTuple):
    buffer: int  # index into the pool's KV buffers (K0, K1, ..., V0, V1, ...)
    layer: int  # forward order of its full-attention layer
    row_bytes: int  # bytes of one token row
    offset: int  # byte offset of the plane in the bundle


class ImagePart(NamedTuple):
    tensor: int  # index into the MambaPool state tensors (conv..., temporal)
    layer: int  # dense linear-layer index, forward order
    nbytes: int
    offset: int  # byte offset in the packed image


@dataclass(frozen=True, slots=True)
class SlabLayout:
    planes: tuple[Plane, ...]
    block_bytes: int
    slab_bytes: int
    image_parts: tuple[ImagePart, ...]
    image_bytes: int

    @property
    def image_slabs(self) -> int:
        return -(-self.image_bytes // self.slab_bytes)


def build_layout(
    kv_buffers: list[torch.Tensor], state_tensors: list[torch.Tensor], tokens: int = 64
) -> SlabLayout:
    """``kv_buffers``: K buffers of every full-attention layer then V buffers, ``[slots, ...]``;
    ``state_tensors``: MambaPool tensors ``[linear layers, slots, ...]`` (conv..., temporal)."""
    n = len(kv_buffers) // 2
    order = [b for layer in range(n) for b in (layer, n + layer)]  # K then V of each layer
    planes, off = [], 0
    for b in order:
        buf = kv_buffers[b]
        row = buf[0].numel() * buf.element_size()
        planes.append(Plane(b, b % n, row, off))
        off += row * tokens
    block = off
    slab = -(-block // SLAB_ALIGN) * SLAB_ALIGN
    parts, ioff = [], 0
    layers = state_tensors[0].shape[0] if state_tensors else 0
    for layer in range(layers):
        for t, tensor in enumerate(state_tensors):
            nb = tensor[layer, 0].numel() * tensor.element_size()
            parts.append(ImagePart(t, layer, nb, ioff))
            ioff += nb
    return SlabLayout(tuple(planes), block, slab, tuple(parts), ioff)
