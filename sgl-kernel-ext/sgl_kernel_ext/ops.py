"""The ops: argument qualification, then the CUDA kernel or the torch reference.

Every op validates its arguments here, on the CPU, before anything is launched, with the same
checks and messages whichever path runs (a refusal raises ``KernelArgError``, a ``ValueError``).
Index metadata (taps, slot lists) should be CPU tensors or Python sequences: a CUDA tensor is
accepted but reading it for validation synchronises the device.

``impl``: ``"auto"`` (the CUDA kernel for CUDA tensors when the library is loaded, else the
reference), ``"cuda"`` (the kernel or an error) or ``"reference"``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import reference
from ._lib import STATE, check, int64_array
from .layout import BundleLayout, bundle_layout, from_slab_layout

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
IMPLS = ("auto", "cuda", "reference")


class KernelArgError(ValueError):
    """An argument the ops refuse (raised before any launch, identically on both paths)."""


class StateTap(NamedTuple):
    chunk: int  # flat chunk index into h's [B, NT] (varlen: chunk_offsets[req] + pos // 64)
    slot: int  # destination slot of the SSM pool


class ConvTap(NamedTuple):
    start: int  # first token of the request's segment in mixed_qkv (query_start_loc[req])
    length: int  # tokens of the request in this pass
    pos: int  # tap position relative to the segment start, 0..length (0: the pass start)
    incoming: int  # row of incoming_conv holding the request's conv state at the pass start
    slot: int  # destination slot of the conv pool


# ------------------------------------------------------------------------------ helpers
def _fail(what: str, msg: str) -> KernelArgError:
    return KernelArgError(f"sgl_kernel_ext.{what}: {msg}")


def _table(x: Any, cols: int | None, what: str, name: str) -> torch.Tensor:
    """Index metadata as a CPU int64 ``[n, cols]`` tensor (``cols`` None: any width >= 1)."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in _INT_DTYPES:
            raise _fail(what, f"{name} must be an integer tensor, got {x.dtype}")
        t = x.detach().to("cpu", torch.int64)
    else:
        rows = [tuple(int(v) for v in r) for r in x]
        widths = {len(r) for r in rows}
        if len(widths) > 1:
            raise _fail(what, f"{name}: rows of different lengths {sorted(widths)}")
        t = torch.tensor(rows, dtype=torch.int64)
        if not rows:
            t = t.reshape(0, cols or 1)
    if t.dim() == 1 and t.numel() == 0:
        t = t.reshape(0, cols or 1)
    if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
        want = f"[n, {cols}]" if cols is not None else "[n, rows]"
        raise _fail(what, f"{name} must be {want}, got shape {list(t.shape)}")
    return t


def _in_range(v: torch.Tensor, lo: int, hi: int, what: str, name: str) -> None:
    if v.numel() == 0:
        return
    bad = ((v < lo) | (v >= hi)).reshape(-1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        at = f"block {k // v.shape[1]}, token {k % v.shape[1]}" if v.dim() == 2 else f"entry {k}"
        raise _fail(what, f"{name} {int(v.reshape(-1)[k])} ({at}) is out of range [{lo}, {hi})")


def _distinct(v: torch.Tensor, what: str, name: str) -> None:
    flat = v.reshape(-1)
    if flat.numel() < 2:
        return
    s, _ = flat.sort()
    dup = s[1:] == s[:-1]
    if bool(dup.any()):
        raise _fail(what, f"duplicate destination {name} {int(s[1:][dup][0])}")


def _per_layer(x: Any, ndim: int, what: str, name: str) -> list[torch.Tensor]:
    """One tensor, a stacked-over-layers tensor (one more leading dim) or a sequence of them."""
    if isinstance(x, torch.Tensor):
        if x.dim() == ndim:
            out = [x]
        elif x.dim() == ndim + 1:
            out = list(x.unbind(0))
        else:
            raise _fail(
                what, f"{name} must have {ndim} dims (or {ndim + 1} stacked), got {x.dim()}"
            )
    else:
        out = list(x)
        for t in out:
            if not isinstance(t, torch.Tensor) or t.dim() != ndim:
                raise _fail(what, f"each {name} must be a {ndim}-dim tensor")
    if not out:
        raise _fail(what, f"{name}: no layers given")
    t0 = out[0]
    for t in out[1:]:
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
            raise _fail(what, f"{name}: every layer needs the same shape, dtype and device")
        if t.stride() != t0.stride():
            raise _fail(what, f"{name}: every layer needs the same strides")
    return out


def _float_dtype(t: torch.Tensor, what: str, name: str) -> int:
    if t.dtype not in DTYPE_CODE:
        raise _fail(what, f"{name} dtype {t.dtype} is not float32, float16 or bfloat16")
    return DTYPE_CODE[t.dtype]


def _inner_contiguous(t: torch.Tensor, first: int) -> bool:
    """Dims ``first..`` laid out contiguously (size-1 dims ignored)."""
    expect = 1
    for size, stride in zip(reversed(t.shape[first:]), reversed(t.stride()[first:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def _same_device(ts: Sequence[torch.Tensor], what: str) -> torch.device:
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise _fail(what, f"tensors on different devices ({dev}, {t.device})")
    return dev


def _layers(layers: Sequence[int] | None, n: int, pool_layers: int, what: str) -> list[int]:
    out = list(range(n)) if layers is None else [int(v) for v in layers]
    if len(out) != n:
        raise _fail(what, f"layers has {len(out)} entries for {n} input layers")
    _in_range(torch.tensor(out, dtype=torch.int64), 0, pool_layers, what, "layer")
    _distinct(torch.tensor(out, dtype=torch.int64), what, "layer")
    return out


def _use_cuda(impl: str, device: torch.device, what: str) -> bool:
    if impl not in IMPLS:
        raise _fail(what, f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    on_cuda = device.type == "cuda"
    if impl == "cuda":
        if not on_cuda:
            raise _fail(what, "impl='cuda' needs CUDA tensors")
        if STATE.lib is None:
            raise RuntimeError(f"sgl_kernel_ext.{what}: CUDA library unavailable: {STATE.reason}")
        return True
    return on_cuda and STATE.lib is not None


_SM: dict[int, int] = {}


def _max_ctas(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM:
        _SM[idx] = torch.cuda.get_device_properties(idx).multi_processor_count * 8
    return _SM[idx]


def _launch_ctx(device: torch.device) -> tuple[Any, int, int]:
    """(device guard, raw current stream, CTA cap) for a launch on ``device``."""
    return (
        torch.cuda.device(device),
        torch.cuda.current_stream(device).cuda_stream,
        _max_ctas(device),
    )


def _widest(values: Sequence[int], widths: Sequence[int] = (16, 8, 4, 2, 1)) -> int:
    for w in widths:
        if all(v % w == 0 for v in values):
            return w
    return 1


# ------------------------------------------------------------------ KV blocks <-> staging
class _KvPlan(NamedTuple):
    buffers: list[torch.Tensor]
    slots: torch.Tensor  # CPU int64 [n, rows]
    staging: torch.Tensor
    layout: BundleLayout
    selected: list[int]  # the buffers to copy (all, or the K and V of the layers asked for)


def _kv_plan(
    kv_buffers: Sequence[torch.Tensor],
    slot_lists: Any,
    staging: torch.Tensor,
    layout: Any,
    layers: Sequence[int] | None,
    scatter: bool,
    what: str,
) -> _KvPlan:
    bufs = list(kv_buffers)
    if not bufs or not all(isinstance(b, torch.Tensor) for b in bufs):
        raise _fail(what, "kv_buffers must be a non-empty list of tensors")
    if layout is None and len(bufs) % 2:
        raise _fail(what, f"kv_buffers must be K buffers then V buffers (got {len(bufs)})")
    if not isinstance(staging, torch.Tensor):
        raise _fail(what, "staging must be a tensor")
    _same_device([*bufs, staging], what)
    n_slots = bufs[0].shape[0] if bufs[0].dim() else 0
    for k, b in enumerate(bufs):
        if b.dim() < 1 or b.shape[0] != n_slots:
            raise _fail(what, f"kv_buffers[{k}] must be [slots, ...] with {n_slots} slots")
        if not _inner_contiguous(b, 1):
            raise _fail(what, f"kv_buffers[{k}]: each token row must be contiguous")
    if layout is None:
        lay = bundle_layout(bufs)
    elif isinstance(layout, BundleLayout):
        lay = layout
    else:
        try:
            lay = from_slab_layout(layout, len(bufs))
        except ValueError as e:
            raise _fail(what, str(e)) from e
    for k, b in enumerate(bufs):
        rb = b[0].numel() * b.element_size() if n_slots else 0
        if len(lay.row_bytes) != len(bufs) or lay.row_bytes[k] != rb:
            raise _fail(what, f"layout does not match kv_buffers[{k}] ({rb} bytes per row)")
    slots = _table(slot_lists, None, what, "slot_lists")
    n, rows = slots.shape
    if n and not 1 <= rows <= lay.tokens:
        raise _fail(what, f"a block has 1..{lay.tokens} token slots, got {rows}")
    _in_range(slots, 0, n_slots, what, "slot")
    if scatter:
        _distinct(slots, what, "slot")
    if staging.dtype != torch.uint8 or staging.dim() != 2:
        raise _fail(
            what, f"staging must be a 2-dim uint8 tensor, got {staging.dtype} {list(staging.shape)}"
        )
    if staging.shape[0] != n:
        raise _fail(what, f"staging has {staging.shape[0]} rows for {n} blocks")
    if n and (
        staging.shape[1] < lay.block_bytes or (staging.stride(1) != 1 and staging.shape[1] > 1)
    ):
        raise _fail(
            what,
            f"staging rows must be contiguous and hold {lay.block_bytes} bytes, got "
            f"{staging.shape[1]} (stride {staging.stride(1)})",
        )
    if layers is None:
        selected = list(range(len(bufs)))
    else:
        if len(bufs) % 2:
            raise _fail(what, "layers needs kv_buffers as K buffers then V buffers")
        n_attn = len(bufs) // 2
        sel = _layers(layers, len(list(layers)), n_attn, what)
        selected = [b for layer in sel for b in (layer, n_attn + layer)]
    return _KvPlan(bufs, slots, staging, lay, selected)


def _kv_cuda(p: _KvPlan, to_staging: bool) -> None:
    lib = STATE.lib
    assert lib is not None
    n, rows = p.slots.shape
    dev = p.staging.device
    bufs = [p.buffers[b] for b in p.selected]
    ptrs = [b.data_ptr() for b in bufs]
    strides = [b.stride(0) * b.element_size() for b in bufs]
    row_bytes = [p.layout.row_bytes[b] for b in p.selected]
    offsets = [p.layout.offsets[b] for b in p.selected]
    pitch = p.staging.stride(0) if n > 1 else p.staging.shape[1]
    vec = _widest([*ptrs, *strides, *row_bytes, *offsets, p.staging.data_ptr(), pitch])
    guard, stream, ctas = _launch_ctx(dev)
    with guard:
        slots = p.slots.to(dev, non_blocking=True)
        step = STATE.max_buffers
        for g in range(0, len(ptrs), step):
            sl = slice(g, g + step)
            rc = lib.sgl_kext_kv_copy(
                int(to_staging),
                len(ptrs[sl]),
                int64_array(ptrs[sl]),
                int64_array(strides[sl]),
                int64_array(row_bytes[sl]),
                int64_array(offsets[sl]),
                slots.data_ptr(),
                n,
                rows,
                p.staging.data_ptr(),
                pitch,
                vec,
                ctas,
                stream,
            )
            check(rc, "kv_blocks_to_staging" if to_staging else "staging_to_kv_blocks")


def _ref_args(p: _KvPlan) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int]]:
    sel = p.selected
    return (
        [p.buffers[b] for b in sel],
        p.slots,
        [p.layout.offsets[b] for b in sel],
        [p.layout.row_bytes[b] for b in sel],
    )


def kv_blocks_to_staging(
    kv_buffers: Sequence[torch.Tensor],
    slot_lists: Any,
    staging: torch.Tensor,
    *,
    layout: Any = None,
    layers: Sequence[int] | None = None,
    impl: str = "auto",
) -> int:
    """Gather blocks of every K/V buffer into ``staging`` (one launch); returns bytes moved.

    ``kv_buffers``: ``[K0..K(n-1), V0..V(n-1)]``, each ``[slots, ...]`` with contiguous rows
    (SGLang's ``k_buffer + v_buffer``). ``slot_lists``: ``[blocks, rows]`` token slots (rows 64,
    fewer for a tail), any page size. ``staging``: ``[blocks, >= block_bytes]`` uint8 on the same
    device, written in the slab bundle layout (``layout.bundle_layout``, or ``layout`` given:
    a ``BundleLayout`` or ``store.layout.SlabLayout``). ``layers``: only these attention
    layers' K and V planes (default all; e.g. one layer at a time in forward order). Source
    slots may repeat.
    """
    return _kv_op(kv_buffers, slot_lists, staging, layout, layers, impl, to_staging=True)


def staging_to_kv_blocks(
    staging: torch.Tensor,
    kv_buffers: Sequence[torch.Tensor],
    slot_lists: Any,
    *,
    layout: Any = None,
    layers: Sequence[int] | None = None,
    impl: str = "auto",
) -> int:
    """Scatter ``staging`` (the layout of ``kv_blocks_to_staging``) into the blocks' slots of
    every K/V buffer (or those of ``layers``), one launch; destination slots must be distinct.
    Returns bytes moved."""
    return _kv_op(kv_buffers, slot_lists, staging, layout, layers, impl, to_staging=False)


def _kv_op(
    kv_buffers: Sequence[torch.Tensor],
    slot_lists: Any,
    staging: torch.Tensor,
    layout: Any,
    layers: Sequence[int] | None,
    impl: str,
    *,
    to_staging: bool,
) -> int:
    """Both KV block ops: validate, then the CUDA kernel or the torch reference."""
    what = "kv_blocks_to_staging" if to_staging else "staging_to_kv_blocks"
    p = _kv_plan(kv_buffers, slot_lists, staging, layout, layers, not to_staging, what)
    use = _use_cuda(impl, staging.device, what)
    n, rows = p.slots.shape
    if n == 0:
        return 0
    if use:
        _kv_cuda(p, to_staging)
    elif to_staging:
        reference.kv_blocks_to_staging(*_ref_args(p), staging)
    else:
        reference.staging_to_kv_blocks(*_ref_args(p), staging)
    return n * rows * sum(p.layout.row_bytes[b] for b in p.selected)


# --------------------------------------------------------------------------- state taps
def gather_state_taps(
    h: torch.Tensor | Sequence[torch.Tensor],
    ssm_states: torch.Tensor,
    taps: Any,
    *,
    layers: Sequence[int] | None = None,
    impl: str = "auto",
) -> int:
    """Copy per-chunk recurrent states into SSM pool slots, converting dtype; one launch for
    every layer given. Returns the number of states written (taps x layers).

    ``h``: per linear layer ``[B, NT, H, V, K]`` (``chunk_gated_delta_rule_fwd_h``'s ``h``: the
    state at the start of each 64-token chunk), stacked ``[L, B, NT, H, V, K]`` or a list of L;
    ``[H, V, K]`` contiguous. ``ssm_states``: ``[layers, slots, H, V, K]`` (MambaPool
    ``temporal``; any strides on the first two dims). ``taps``: ``[n, 2]`` rows
    ``(chunk, slot)`` (``StateTap``), chunk a flat index into ``[B, NT]``. ``layers``: the pool
    layer of each h (default 0..L-1). Dtypes: float32 / float16 / bfloat16 each side.
    """
    what = "gather_state_taps"
    hs = _per_layer(h, 5, what, "h")
    if not isinstance(ssm_states, torch.Tensor) or ssm_states.dim() != 5:
        raise _fail(what, "ssm_states must be [layers, slots, H, V, K]")
    dev = _same_device([hs[0], ssm_states], what)
    sc, dc = _float_dtype(hs[0], what, "h"), _float_dtype(ssm_states, what, "ssm_states")
    if hs[0].shape[2:] != ssm_states.shape[2:]:
        raise _fail(
            what,
            f"state shape {list(hs[0].shape[2:])} of h differs from the pool's "
            f"{list(ssm_states.shape[2:])}",
        )
    if not _inner_contiguous(hs[0], 2) or not _inner_contiguous(ssm_states, 2):
        raise _fail(what, "the [H, V, K] state of h and of the pool must be contiguous")
    lay = _layers(layers, len(hs), ssm_states.shape[0], what)
    t = _table(taps, 2, what, "taps")
    b, nt = hs[0].shape[0], hs[0].shape[1]
    _in_range(t[:, 0], 0, b * nt, what, "chunk")
    _in_range(t[:, 1], 0, ssm_states.shape[1], what, "slot")
    _distinct(t[:, 1], what, "slot")
    use = _use_cuda(impl, dev, what)
    n = t.shape[0]
    if n == 0:
        return 0
    if not use:
        reference.gather_state_taps(hs, ssm_states, t[:, 0], t[:, 1], lay)
        return n * len(hs)
    lib = STATE.lib
    assert lib is not None
    row = hs[0][0, 0].numel()
    src_off = (t[:, 0] // nt) * hs[0].stride(0) + (t[:, 0] % nt) * hs[0].stride(1)
    dst_off = t[:, 1] * ssm_states.stride(1)
    ss, ds = hs[0].element_size(), ssm_states.element_size()
    src_ptr = [x.data_ptr() for x in hs]
    dst_ptr = [ssm_states[i].data_ptr() for i in lay]
    if sc == dc:  # raw copy in 16-byte units when everything is aligned to 16 bytes
        vec = _widest([row * ss, *src_ptr, *dst_ptr], (16,)) == 16 and bool(
            ((src_off * ss) % 16 == 0).all() and ((dst_off * ds) % 16 == 0).all()
        )
        unit = 16 // ss if vec else 1
    else:  # converting packs of N = 16 / max(sizes) elements
        unit = 16 // max(ss, ds)
        vec = (
            row % unit == 0
            and all(v % (ss * unit) == 0 for v in src_ptr)
            and all(v % (ds * unit) == 0 for v in dst_ptr)
            and bool((src_off % unit == 0).all() and (dst_off % unit == 0).all())
        )
        unit = unit if vec else 1
    offs = torch.stack([src_off // unit, dst_off // unit], 1).contiguous()
    guard, stream, ctas = _launch_ctx(dev)
    with guard:
        offs_dev = offs.to(dev, non_blocking=True)
        step = STATE.max_layers
        for g in range(0, len(hs), step):
            sl = slice(g, g + step)
            rc = lib.sgl_kext_state_taps(
                len(src_ptr[sl]),
                int64_array(src_ptr[sl]),
                int64_array(dst_ptr[sl]),
                sc,
                dc,
                offs_dev.data_ptr(),
                n,
                row,
                int(vec),
                ctas,
                stream,
            )
            check(rc, what)
    return n * len(hs)


# ---------------------------------------------------------------------------- conv taps
def _intervals(ptrs: Sequence[int], offs: torch.Tensor, extent: int) -> list[tuple[int, int]]:
    return [(p + int(o), p + int(o) + extent) for p in ptrs for o in offs.tolist()]


def _extent(t: torch.Tensor) -> int:
    """Bytes spanned by one slot / row of a [rows, D, W] view (from its first byte)."""
    return ((t.shape[-2] - 1) * t.stride(-2) + (t.shape[-1] - 1) * t.stride(-1) + 1) * (
        t.element_size()
    )


def gather_conv_taps(
    mixed_qkv: torch.Tensor | Sequence[torch.Tensor],
    conv_states: torch.Tensor,
    taps: Any,
    incoming_conv: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    layers: Sequence[int] | None = None,
    impl: str = "auto",
) -> int:
    """Write the conv window at each tap into conv pool slots; one launch for every layer given.
    Returns the number of windows written (taps x layers).

    ``mixed_qkv``: per linear layer the pass's pre-convolution inputs ``[T, D]`` (tokens of all
    requests back to back, as the GDN layer hands them to its conv), stacked ``[L, T, D]`` or a
    list of L; any strides. ``conv_states``: ``[layers, slots, D, W]`` with ``W`` = kernel - 1
    (SGLang's GDN MambaPool ``conv[0]``; a window-first pool passes ``.transpose(-1, -2)``).
    ``taps``: ``[n, 5]`` rows ``(start, length, pos, incoming, slot)`` (``ConvTap``): the window
    column ``j`` is the input at request position ``pos - W + j``, taken from
    ``incoming_conv[l][incoming]`` (``[rows, D, W]`` per layer, same forms as ``mixed_qkv``; e.g.
    ``conv_states[layer:layer+1]`` before the layer's conv updates it) where that position is
    before the pass start. ``incoming`` is ignored (may be -1) for taps with ``pos >= W``.
    Refused: positions outside ``0..length``, segments outside ``mixed_qkv``, out-of-range or
    duplicate slots, and destination slots overlapping an incoming state the same launch reads.
    """
    what = "gather_conv_taps"
    xs = _per_layer(mixed_qkv, 2, what, "mixed_qkv")
    if not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 4:
        raise _fail(what, "conv_states must be [layers, slots, D, W]")
    xc = _float_dtype(xs[0], what, "mixed_qkv")
    dc = _float_dtype(conv_states, what, "conv_states")
    n_tok, dim = xs[0].shape
    w = conv_states.shape[-1]
    if conv_states.shape[2] != dim or w < 1:
        raise _fail(
            what,
            f"conv_states [.., D, W] = {list(conv_states.shape[2:])} does not "
            f"match mixed_qkv's D = {dim}",
        )
    incs = None
    if incoming_conv is not None:
        incs = _per_layer(incoming_conv, 3, what, "incoming_conv")
        if len(incs) != len(xs):
            raise _fail(what, f"incoming_conv has {len(incs)} layers for {len(xs)}")
        if tuple(incs[0].shape[1:]) != (dim, w):
            raise _fail(what, f"incoming_conv rows must be [D, W] = [{dim}, {w}]")
    ic = _float_dtype(incs[0], what, "incoming_conv") if incs is not None else dc
    dev = _same_device([xs[0], conv_states, *(incs[:1] if incs else [])], what)
    lay = _layers(layers, len(xs), conv_states.shape[0], what)
    t = _table(taps, 5, what, "taps")
    start, length, pos, in_row, slot = t.unbind(1)
    _in_range(start, 0, n_tok + 1, what, "start")
    _in_range(length, 0, n_tok + 1, what, "length")
    if t.shape[0] and bool((start + length > n_tok).any()):
        k = int((start + length > n_tok).nonzero()[0, 0])
        raise _fail(
            what,
            f"tap {k}: segment [{int(start[k])}, {int(start[k] + length[k])}) "
            f"is outside mixed_qkv's {n_tok} tokens",
        )
    bad = (pos < 0) | (pos > length)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise _fail(what, f"tap {k}: position {int(pos[k])} is outside 0..{int(length[k])}")
    _in_range(slot, 0, conv_states.shape[1], what, "slot")
    _distinct(slot, what, "slot")
    needs_in = pos < w
    if bool(needs_in.any()):
        if incs is None:
            k = int(needs_in.nonzero()[0, 0])
            raise _fail(what, f"tap {k} at position {int(pos[k])} < W = {w} needs incoming_conv")
        _in_range(in_row[needs_in], 0, incs[0].shape[0], what, "incoming row")
        _check_alias(conv_states, incs, lay, slot, in_row[needs_in], what)
    use = _use_cuda(impl, dev, what)
    n = t.shape[0]
    if n == 0:
        return 0
    if not use:
        reference.gather_conv_taps(xs, conv_states, t, incs, lay)
        return n * len(xs)
    lib = STATE.lib
    assert lib is not None
    in_stride0 = incs[0].stride(0) if incs is not None else 0
    dev_taps = torch.stack(
        [
            pos,
            start + pos - w,
            torch.where(needs_in, in_row, 0) * in_stride0,
            slot * conv_states.stride(1),
        ],
        1,
    ).contiguous()
    x_ptr = [x.data_ptr() for x in xs]
    in_ptr = [x.data_ptr() for x in incs] if incs is not None else [0] * len(xs)
    d_ptr = [conv_states[i].data_ptr() for i in lay]
    strides = [
        xs[0].stride(0),
        xs[0].stride(1),
        incs[0].stride(1) if incs else 0,
        incs[0].stride(2) if incs else 0,
        conv_states.stride(2),
        conv_states.stride(3),
    ]
    guard, stream, ctas = _launch_ctx(dev)
    with guard:
        taps_dev = dev_taps.to(dev, non_blocking=True)
        step = STATE.max_layers
        for g in range(0, len(xs), step):
            sl = slice(g, g + step)
            rc = lib.sgl_kext_conv_taps(
                len(x_ptr[sl]),
                int64_array(x_ptr[sl]),
                int64_array(in_ptr[sl]),
                int64_array(d_ptr[sl]),
                taps_dev.data_ptr(),
                n,
                dim,
                w,
                int64_array(strides),
                xc,
                ic,
                dc,
                ctas,
                stream,
            )
            check(rc, what)
    return n * len(xs)


def _check_alias(
    conv_states: torch.Tensor,
    incs: list[torch.Tensor],
    layers: list[int],
    slots: torch.Tensor,
    in_rows: torch.Tensor,
    what: str,
) -> None:
    """Refuse a destination slot whose bytes overlap an incoming state read by the same launch
    (possible when incoming_conv is a view of conv_states): the kernel would race."""
    base = conv_states.untyped_storage().data_ptr()
    if all(x.untyped_storage().data_ptr() != base for x in incs):
        return
    es, ie = conv_states.element_size(), incs[0].element_size()
    dst_ptr = [conv_states[i].data_ptr() for i in layers]
    writes = sorted(_intervals(dst_ptr, slots * conv_states.stride(1) * es, _extent(conv_states)))
    reads = _intervals(
        [x.data_ptr() for x in incs], in_rows * incs[0].stride(0) * ie, _extent(incs[0])
    )
    starts = [a for a, _ in writes]
    for a, e in reads:
        k = bisect.bisect_left(starts, e) - 1  # the last write starting before this read ends
        if k >= 0 and writes[k][1] > a:
            raise _fail(
                what,
                "a destination slot overlaps an incoming conv state read by the "
                "same launch (incoming_conv aliases conv_states)",
            )
