"""Zero-split taps on SGLang's own GPU worker: states gathered from its GDN prefill.

SGLang 0.5.23's Triton GDN prefill (``TritonGDNKernel``, behind ``GDNAttnBackend.forward_extend``)
returns ``h``: the recurrent state at the start of every 64-token chunk of every sequence of the
pass. The conv state at a position is the ``W - 1`` pre-convolution inputs before it, rows of the
``mixed_qkv`` the backend convolves. So a tap inside a pass costs gathers, not a pass that ends
there; a tap between chunk starts adds a recompute over its < 64 tokens since the chunk start
below it (SGLang's own extra_buffer tracking does the same for unaligned positions). Contract:

- ``grid_of(worker)``: 1 (any position) when the worker runs SGLang's ``GDNAttnBackend`` (inside
  its hybrid backend) with the Triton extend kernel on CUDA, else 0 (no capture: taps split).
- ``after_init_new`` (AFTER ``ForwardBatch.init_new``): for an extend batch whose requests carry
  ``req.hybrid_state_taps`` (``cpu/taps.py``: the cache's reservations), attaches a ``PassTaps``
  plan to the forward batch: conv source rows, chunk indices into ``h``, the recompute's token
  rows and ``cu_seqlens``, destination slots, as device tensors made once per pass (no sync).
- ``around_forward_extend`` (AROUND ``GDNAttnBackend.forward_extend``): with a plan, copies the
  taps' pre-conv rows before the layer runs, catches ``h`` (and, for taps whose chunk start is
  the pass's start, the requests' incoming states) from the extend kernel call, then writes the
  conv windows, the chunk states, and advances the off-grid ones with one more call of the same
  kernel over their packed segments (``advance``). Once every linear layer of the pass captured,
  each tap's position is appended to ``req.hybrid_state_taps_done``; a layer without ``h``
  (another kernel), an unknown call shape or a graph capture marks nothing, so the cache returns
  those slots unpublished (``publish._settle_inpass``) and nothing wrong is ever published.

Unverified on a GPU (no run of SGLang's model runner here: ``sgl_kernel`` does not travel to the
lent H200). The facts it rests on are checked by the GPU check where one runs: ``h[:, i]`` against
the state of a pass cut at ``64 i`` with SGLang's own kernel, and this module's plan and gathers on
two packed sequences (stage C), the gather ops (stage K). ``h`` is in the activation dtype (bf16),
so a captured state is the bf16 rounding of the exact one, as in SGLang's own extra_buffer
tracking; hence ``--hybrid-tap-mode auto`` keeps ``split`` on GPUs (``plugin._resolve_tap_mode``)
and this path runs only when asked for explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cpu.taps import TAPS_ATTR, TAPS_DONE_ATTR

CHUNK = 64  # FLA's chunk size in SGLang's Triton GDN prefill
PLAN_ATTR = "hybrid_pass_taps"


@dataclass(slots=True)
class PassTaps:
    """The taps of one extend pass, ready to gather (see the module contract)."""

    conv_rows: torch.Tensor  # [n, W - 1] token rows of mixed_qkv, per tap
    conv_dst: torch.Tensor  # [n] destination slots of every tap
    grid_chunks: torch.Tensor  # [m] index into h (chunks of all sequences, in batch order)
    grid_dst: torch.Tensor  # [m] slots of the taps on a chunk start
    off_dst: torch.Tensor  # [r] slots of the taps between chunk starts
    off_chunks: torch.Tensor  # [r] h index of the chunk start below each (-1: the pass start)
    off_rows: torch.Tensor  # [r] batch row of each (its incoming state when off_chunks is -1)
    seg_rows: torch.Tensor  # token rows from each chunk start up to its tap, concatenated
    seg_cu: torch.Tensor  # [r + 1] cumulative segment lengths (cu_seqlens of the recompute)
    done: list[tuple[Any, int]]  # (req, position) to report once every layer captured
    layers_left: int  # linear layers still to capture this pass
    at_pass_start: bool = False  # some off-grid tap starts from the request's incoming state
    failed: bool = False
    seen: set[int] = field(default_factory=set)  # layer ids captured (a layer counts once)


def grid_of(worker: Any) -> int:
    """The capture grid SGLang's worker offers (1: any position, from the Triton GDN prefill's
    ``h`` and a short recompute; 0: none)."""
    runner = getattr(worker, "model_runner", None)
    backend = getattr(runner, "attn_backend", None)
    linear = getattr(backend, "linear_attn_backend", None)
    if linear is None or type(linear).__name__ != "GDNAttnBackend":
        return 0
    kernel = getattr(getattr(linear, "kernel_dispatcher", None), "extend_kernel", None)
    if type(kernel).__name__ != "TritonGDNKernel" or not torch.cuda.is_available():
        return 0
    return 1


def plan_pass(
    reqs: list[Any],
    prefix_lens: list[int],
    extend_lens: list[int],
    conv_width: int,
    n_linear_layers: int,
    device: torch.device | str,
) -> PassTaps | None:
    """The plan for one extend pass, or None when no request has a tap inside it. A tap closer
    than ``conv_width - 1`` tokens to its pass's start is left out (its conv window would
    reach into the incoming conv state): never reported done, its slot goes back unpublished."""
    keep = conv_width - 1
    conv_rows: list[list[int]] = []
    conv_dst: list[int] = []
    grid_chunks: list[int] = []
    grid_dst: list[int] = []
    off_dst: list[int] = []
    off_chunks: list[int] = []
    off_rows: list[int] = []
    seg_rows: list[int] = []
    seg_cu = [0]
    done: list[tuple[Any, int]] = []
    token_start = chunk_start = 0
    for row, (req, prefix, ext) in enumerate(zip(reqs, prefix_lens, extend_lens, strict=True)):
        for p, slot in getattr(req, TAPS_ATTR, None) or ():
            o = int(p) - prefix
            if not keep <= o < ext:
                continue
            conv_rows.append(list(range(token_start + o - keep, token_start + o)))
            conv_dst.append(int(slot))
            c = CHUNK * (o // CHUNK)
            if o == c:
                grid_chunks.append(chunk_start + o // CHUNK)
                grid_dst.append(int(slot))
            else:
                off_dst.append(int(slot))
                off_chunks.append(chunk_start + c // CHUNK if c else -1)
                off_rows.append(row)
                seg_rows.extend(range(token_start + c, token_start + o))
                seg_cu.append(len(seg_rows))
            done.append((req, int(p)))
        token_start += ext
        chunk_start += -(-ext // CHUNK)
    if not done:
        return None
    return PassTaps(
        conv_rows=torch.tensor(conv_rows, dtype=torch.int64).to(device, non_blocking=True),
        conv_dst=_ids(conv_dst, device),
        grid_chunks=_ids(grid_chunks, device),
        grid_dst=_ids(grid_dst, device),
        off_dst=_ids(off_dst, device),
        off_chunks=_ids(off_chunks, device),
        off_rows=_ids(off_rows, device),
        seg_rows=_ids(seg_rows, device),
        seg_cu=_ids(seg_cu, device),
        done=done,
        layers_left=n_linear_layers,
        at_pass_start=-1 in off_chunks,
    )


def _ids(x: list[int], device: torch.device | str) -> torch.Tensor:
    # SGLang's own per-batch metadata goes to the device the same way: no stream sync.
    return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)


def after_init_new(fb: Any, cls: Any, batch: Any, model_runner: Any, *a: Any, **k: Any) -> None:
    if not batch.forward_mode.is_extend() or batch.forward_mode.is_target_verify():
        return
    if not any(getattr(r, TAPS_ATTR, None) for r in batch.reqs):
        return
    pool = model_runner.req_to_token_pool
    conv = pool.mamba_pool.mamba_cache.conv[0]
    plan = plan_pass(
        batch.reqs,
        [int(x) for x in batch.prefix_lens],
        [int(x) for x in batch.extend_lens],
        int(conv.shape[-1]) + 1,
        len(pool.mamba_map),
        conv.device,
    )
    setattr(fb, PLAN_ATTR, plan)


def capture_layer(
    plan: PassTaps,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    windows: torch.Tensor,
    h: torch.Tensor | None,
    incoming: torch.Tensor | None = None,
) -> None:
    """One linear layer's gathers: ``windows`` (``mixed_qkv[plan.conv_rows]``, the pre-conv rows
    ``[n, W - 1, dim]``) into the conv slots; the chunk states of ``h`` (``[1, chunks, H, V,
    K]``, or without the leading 1) into the slots of the taps on a chunk start, and the chunk
    start below each other tap into its slot (``incoming[i]``, the request's state before the
    pass, where that is the pass's start); ``advance`` then brings those to their positions.
    No ``h``: the pass failed."""
    conv_states[plan.conv_dst] = windows.transpose(1, 2).to(conv_states.dtype)
    if h is None:
        plan.failed = True
        return
    states = h.squeeze(0) if h.dim() == ssm_states.dim() + 1 else h
    if plan.grid_dst.numel():
        ssm_states[plan.grid_dst] = states[plan.grid_chunks].to(ssm_states.dtype)
    if plan.off_dst.numel():
        base = states[plan.off_chunks.clamp(min=0)].to(ssm_states.dtype)
        if incoming is not None:
            at_start = (plan.off_chunks < 0).view(-1, *([1] * (base.dim() - 1)))
            base = torch.where(at_start, incoming.to(base.dtype), base)
        ssm_states[plan.off_dst] = base


def advance(plan: PassTaps, kernel: Any, ssm_states: torch.Tensor, kw: dict[str, Any]) -> None:
    """The recompute: run the extend kernel over each off-grid tap's tokens since its chunk
    start (< 64), from the state ``capture_layer`` put in its slot, updating the slot in place
    (the kernel's own write-back); its output is discarded. ``kw``: the layer's extend call."""
    if not plan.off_dst.numel():
        return
    rows = plan.seg_rows
    kernel.extend(
        q=kw["q"][:, rows],
        k=kw["k"][:, rows],
        v=kw["v"][:, rows],
        g=kw["g"][:, rows],
        beta=kw["beta"][:, rows],
        ssm_states=ssm_states,
        cache_indices=plan.off_dst.to(kw["cache_indices"].dtype),
        query_start_loc=plan.seg_cu.to(kw["query_start_loc"].dtype),
    )


def finish_layer(plan: PassTaps, layer_id: int) -> None:
    """Count a layer captured; after the last one, report the taps done (unless one failed)."""
    if layer_id in plan.seen:
        return
    plan.seen.add(layer_id)
    plan.layers_left -= 1
    if plan.layers_left == 0 and not plan.failed:
        for req, p in plan.done:
            done = getattr(req, TAPS_DONE_ATTR, None)
            if done is None:
                done = []
                setattr(req, TAPS_DONE_ATTR, done)
            done.append(p)


def around_forward_extend(
    orig: Any, backend: Any, layer: Any, forward_batch: Any, mixed_qkv: Any, *a: Any, **k: Any
) -> Any:
    plan: PassTaps | None = getattr(forward_batch, PLAN_ATTR, None)
    if (
        plan is None
        or forward_batch.forward_mode.is_target_verify()
        or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    ):
        return orig(backend, layer, forward_batch, mixed_qkv, *a, **k)
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    dispatcher = backend.kernel_dispatcher
    inner = dispatcher.extend
    seen: dict[str, Any] = {}

    def extend(*args: Any, **kwargs: Any) -> Any:
        if args or "q" not in kwargs:  # not the keyword call this hook knows: capture nothing
            seen["unknown"] = True
            return inner(*args, **kwargs)
        if plan.at_pass_start:  # before the kernel writes the requests' states in place
            rows = kwargs["cache_indices"][plan.off_rows]
            seen["incoming"] = kwargs["ssm_states"][rows].clone()
        out = inner(**kwargs)
        seen["h"] = out[2] if isinstance(out, tuple) and len(out) > 2 else None
        seen["kw"] = kwargs
        return out

    windows = mixed_qkv[plan.conv_rows]  # a copy of the pre-conv rows, before the layer runs
    dispatcher.extend = extend  # this call only: the instance attribute shadows the method
    try:
        out = orig(backend, layer, forward_batch, mixed_qkv, *a, **k)
    finally:
        del dispatcher.extend
    h = None if seen.get("unknown") else seen.get("h")
    capture_layer(plan, cache.conv[0], cache.temporal, windows, h, seen.get("incoming"))
    if not plan.failed:
        advance(plan, dispatcher.extend_kernel, cache.temporal, seen["kw"])
    finish_layer(plan, int(layer.layer_id))
    return out
