"""Pure-torch reference implementations (CPU and CUDA): the fallback path and the CUDA ops'
definition of correct. Each takes arguments already validated and normalised by ``ops`` (lists
of per-layer tensors, CPU int64 metadata) and matches the CUDA op bit for bit: they only move
bytes or convert with ``Tensor.to`` (what the kernels' conversions reproduce on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def u8_rows(buf: torch.Tensor) -> torch.Tensor:
    """A KV buffer ``[slots, ...]`` (rows contiguous) as bytes ``[slots, row_bytes]`` (a view)."""
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def kv_blocks_to_staging(
    kv_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    offsets: Sequence[int],
    row_bytes: Sequence[int],
    staging: torch.Tensor,
) -> None:
    """``staging[b, off_k + r*row_k : ...] = bytes of kv_buffers[k][slots[b, r]]``."""
    n, rows = slots.shape
    idx = slots.reshape(-1).to(staging.device)
    for buf, off, rb in zip(kv_buffers, offsets, row_bytes):
        src = u8_rows(buf).index_select(0, idx).reshape(n, rows * rb)
        staging[:, off : off + rows * rb].copy_(src)


def staging_to_kv_blocks(
    kv_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    offsets: Sequence[int],
    row_bytes: Sequence[int],
    staging: torch.Tensor,
) -> None:
    """The inverse scatter (destination slots are distinct: validated)."""
    n, rows = slots.shape
    idx = slots.reshape(-1).to(staging.device)
    for buf, off, rb in zip(kv_buffers, offsets, row_bytes):
        src = staging[:, off : off + rows * rb].reshape(n * rows, rb)
        u8_rows(buf).index_copy_(0, idx, src)


def gather_state_taps(
    h: Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    chunks: torch.Tensor,
    slots: torch.Tensor,
    layers: Sequence[int],
) -> None:
    """``ssm_states[layers[l], slots[t]] = h[l].flatten(0, 1)[chunks[t]].to(ssm dtype)``."""
    dev = ssm_states.device
    nt = h[0].shape[1]
    b, i, s = (chunks // nt).to(dev), (chunks % nt).to(dev), slots.to(dev)
    for hl, layer in zip(h, layers):
        ssm_states[layer][s] = hl[b, i].to(ssm_states.dtype)


def gather_conv_taps(
    x: Sequence[torch.Tensor],
    conv_states: torch.Tensor,
    taps: torch.Tensor,
    incoming: Sequence[torch.Tensor] | None,
    layers: Sequence[int],
) -> None:
    """Per tap ``(start, length, pos, in_row, slot)``: column ``j`` of the window is the input at
    request position ``q = pos - W + j``: ``x[l][start + q]`` when ``q >= 0``, else column
    ``W + q`` of ``incoming[l][in_row]`` (the request's conv state at the pass start)."""
    dev = conv_states.device
    w = conv_states.shape[-1]
    n = taps.shape[0]
    start, pos, in_row, slot = taps[:, 0], taps[:, 2], taps[:, 3], taps[:, 4]
    j = torch.arange(w)
    q = pos[:, None] - w + j[None, :]  # [n, W]
    from_x = q >= 0
    need_in = bool((~from_x).any())
    rows = (start[:, None] + q).clamp(0, max(x[0].shape[0] - 1, 0)).to(dev)
    col = (pos[:, None] + j[None, :]).clamp(max=w - 1)  # the incoming column when q < 0
    sel = from_x[:, None, :].to(dev)
    s = slot.to(dev)
    for k, (xl, layer) in enumerate(zip(x, layers)):
        dim = xl.shape[1]
        dt = conv_states.dtype
        out = None
        if bool(from_x.any()):
            out = xl[rows].transpose(1, 2).to(dt)  # [n, D, W]
        if need_in:
            assert incoming is not None
            inc = incoming[k][in_row.clamp(min=0).to(dev)]  # [n, D, W]
            idx = col[:, None, :].expand(n, dim, w).to(dev)
            iv = torch.gather(inc, 2, idx).to(dt)
            out = iv if out is None else torch.where(sel, out, iv)
        assert out is not None  # n > 0 and W >= 1 (ops checks): x or incoming fills it
        conv_states[layer][s] = out
