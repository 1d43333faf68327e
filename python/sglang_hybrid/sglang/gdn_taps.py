"""In-pass taps gathered from the GDN prefill's per-chunk states, beyond SGLang's one per request.

SGLang's own prefill tracking (``track.py``) copies one state per request per pass. The extend
kernel that state comes from computes more: the Triton kernel returns ``h``, the state at the
start of every 64-token chunk of every request of the pass (bf16, ``[1, chunks, H, V, K]``,
``ceil(len / 64)`` per request), and FlashInfer's returns, once tracking asks for checkpoints,
the state after every 64 tokens of every request (the kernel's state dtype, fp32 on SM90,
``len // 64`` per request). The conv state at a position is the ``W - 1`` pre-convolution rows of
``mixed_qkv`` before it. So the request's other taps on its chunk grid cost gathers, and a tap
between chunk starts costs a recompute over its < 64 tokens since the chunk start below it (one
more call of SGLang's Triton extend kernel over the packed segments; with FlashInfer's prefill
it starts from the fp32 checkpoint, so the state differs from a pass ending there by fp32
rounding only). Contract:

- ``plan_pass(reqs, taps, ...)``: the gathers of one pass as device tensors made once per pass
  (no sync), for the ``(position, slot)`` taps of each row; ``layout`` is ``"chunks"`` (Triton's
  ``h``) or ``"checkpoints"`` (FlashInfer's);
- ``capture_around(orig, plan, backend, layer, ...)``: runs the layer with its extend call caught,
  copies the taps' pre-conv rows before it and gathers the states after it (``capture_layer``,
  ``advance``); a layer without per-chunk states or with an unknown call shape marks the plan
  failed, so its taps are never reported and go back unpublished (``publish._settle_inpass``).

``track.py`` builds the plan with SGLang's tracked row, keeps it across breakable prefill graph
replays and reports the taps once every linear layer ran. Unverified on a GPU: stage C of the
GPU check compares ``h[:, i]`` with the state of a pass cut at ``64 i``, stage I
(``stage_inpass.py``) the whole path; ``h`` from Triton is in the activation dtype, so its states
are the bf16 rounding of the exact ones (``inpass.py``: ``auto`` does not take that path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CHUNK = 64  # FLA's chunk size in SGLang's GDN prefill kernels


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
    at_pass_start: bool = False  # some off-grid tap starts from the request's incoming state
    needs_states: bool = True  # some tap reads a per-chunk state (all but pass-start recomputes)
    failed: bool = False


def plan_pass(
    reqs: list[Any],
    taps: list[list[tuple[int, int]]],
    prefix_lens: list[int],
    extend_lens: list[int],
    conv_width: int,
    device: torch.device | str,
    layout: str = "chunks",
) -> PassTaps | None:
    """The plan for one extend pass, or None when no row has a tap inside it. ``taps[i]``: row
    i's ``(position, slot)`` pairs. A tap closer than ``conv_width - 1`` tokens to its pass's
    start is left out (its conv window would reach into the incoming conv state): never reported
    done, its slot goes back unpublished."""
    if layout not in ("chunks", "checkpoints"):
        raise ValueError(f"unknown per-chunk state layout {layout!r}")
    checkpoints = layout == "checkpoints"
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
    rows = zip(reqs, taps, prefix_lens, extend_lens, strict=True)
    for row, (req, row_taps, prefix, ext) in enumerate(rows):
        for p, slot in row_taps:
            o = int(p) - prefix
            c = CHUNK * (o // CHUNK)
            if not keep <= o < ext:
                continue
            conv_rows.append(list(range(token_start + o - keep, token_start + o)))
            conv_dst.append(int(slot))
            # Triton: chunk j of the row starts after 64 j tokens; FlashInfer: checkpoint j - 1
            # of the row is the state after 64 j tokens.
            shift = 1 if checkpoints else 0
            if o == c:
                grid_chunks.append(chunk_start + o // CHUNK - shift)
                grid_dst.append(int(slot))
            else:
                off_dst.append(int(slot))
                off_chunks.append(chunk_start + c // CHUNK - shift if c else -1)
                off_rows.append(row)
                seg_rows.extend(range(token_start + c, token_start + o))
                seg_cu.append(len(seg_rows))
            done.append((req, int(p)))
        token_start += ext
        chunk_start += ext // CHUNK if checkpoints else -(-ext // CHUNK)
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
        at_pass_start=-1 in off_chunks,
        needs_states=bool(grid_dst) or any(c >= 0 for c in off_chunks),
    )


def _ids(x: list[int], device: torch.device | str) -> torch.Tensor:
    # SGLang's own per-batch metadata goes to the device the same way: no stream sync.
    return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)


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
        # Without per-chunk states (FlashInfer makes none without a tracked row) only taps that
        # recompute from the request's incoming state can be taken.
        if plan.needs_states or incoming is None:
            plan.failed = True
            return
        ssm_states[plan.off_dst] = incoming.to(ssm_states.dtype)
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


def capture_around(
    orig: Any,
    plan: PassTaps,
    backend: Any,
    layer: Any,
    forward_batch: Any,
    mixed_qkv: Any,
    *a: Any,
    **kw: Any,
) -> Any:
    """``GDNAttnBackend.forward_extend`` (``orig``) with this layer's taps gathered."""
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
        out = orig(backend, layer, forward_batch, mixed_qkv, *a, **kw)
    finally:
        del dispatcher.extend
    h = None if seen.get("unknown") else seen.get("h")
    capture_layer(plan, cache.conv[0], cache.temporal, windows, h, seen.get("incoming"))
    if not plan.failed and plan.off_dst.numel():
        kernel = recompute_kernel(dispatcher)
        if kernel is None:
            plan.failed = True
        else:
            advance(plan, kernel, cache.temporal, seen["kw"])
    return out


def recompute_kernel(dispatcher: Any) -> Any:
    """SGLang's Triton GDN extend kernel for the off-grid recompute: the extend kernel itself,
    else the Triton instance SGLang's dispatcher keeps beside FlashInfer's (its tree-verify
    kernel, and FlashInfer's own alignment fallback); None when there is none."""
    extend = getattr(dispatcher, "extend_kernel", None)
    for k in (
        extend,
        getattr(dispatcher, "tree_verify_kernel", None),
        getattr(extend, "_alignment_fallback_kernel", None),
    ):
        if type(k).__name__ == "TritonGDNKernel":
            return k
    return None
