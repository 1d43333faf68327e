"""Straightforward loop implementations the references are checked against (tests only)."""

from __future__ import annotations

import torch


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of one tensor (any layout) in its logical element order."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def kv_to_staging(kv_buffers, slot_lists, staging, planes) -> None:
    """``planes``: ``store.layout.SlabLayout.planes`` (buffer, layer, row_bytes, offset)."""
    for b, slots in enumerate(slot_lists):
        for p in planes:
            for r, s in enumerate(slots):
                off = p.offset + r * p.row_bytes
                staging[b, off : off + p.row_bytes] = row_bytes(kv_buffers[p.buffer][int(s)])


def staging_to_kv(staging, kv_buffers, slot_lists, planes) -> None:
    for b, slots in enumerate(slot_lists):
        for p in planes:
            buf = kv_buffers[p.buffer]
            for r, s in enumerate(slots):
                off = p.offset + r * p.row_bytes
                raw = staging[b, off : off + p.row_bytes].clone()
                buf[int(s)] = raw.view(buf.dtype).reshape(buf.shape[1:])


def state_taps(h_layers, pool, taps, layers) -> None:
    for h, layer in zip(h_layers, layers):
        nt = h.shape[1]
        for chunk, slot in taps:
            b, i = divmod(int(chunk), nt)
            for head in range(h.shape[2]):
                pool[layer, slot, head] = h[b, i, head].to(pool.dtype)


def conv_taps(x_layers, pool, taps, incoming, layers) -> None:
    w = pool.shape[-1]
    for k, (x, layer) in enumerate(zip(x_layers, layers)):
        for start, _length, pos, in_row, slot in taps:
            for j in range(w):
                q = pos - w + j
                if q >= 0:
                    col = x[start + q]
                else:
                    col = incoming[k][in_row][:, w + q]
                pool[layer, slot, :, j] = col.to(pool.dtype)
