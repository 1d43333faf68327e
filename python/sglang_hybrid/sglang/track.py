"""In-pass taps on SGLang's GPU worker through its own prefill tracking (issue #36).

SGLang's ``extra_buffer`` strategy has the GDN layers copy one state per request inside a prefill
pass into a tracking slot: the scheduler fills five ``ForwardBatch`` fields
(``mamba_track_indices`` / ``_mask`` / ``_seqlens`` and their host lists
``mamba_prefill_track_mask_cpu`` / ``mamba_track_seqlens_cpu``), the linear backend turns them into
its metadata (``MambaAttnBackendBase._forward_metadata``: ``track_conv_indices``,
``track_ssm_h_src`` / ``_dst``, ...) and every GDN layer's ``forward_extend`` copies the conv
window out of ``mixed_qkv`` and the SSM state out of the extend kernel's per-chunk states
(``_track_mamba_state_extend``). The GDN side reads those five fields only: it never asks which
radix-cache strategy filled them (docs/inpass-capture.md). This cache keeps SGLang's
``no_buffer`` strategy (no ping-pong slots, no SGLang cache protocol) and fills the fields itself,
with its own snapshot slots as destinations:

- ``after_init_new`` (AFTER ``ForwardBatch.init_new``): per request of an extend batch, the deepest
  reserved tap at ``prefix + 64 k`` strictly inside the pass becomes its tracked row (seqlen
  ``p + 1``: SGLang's own way of asking for the state from the per-chunk states rather than the
  final one); the request's other taps go to ``gdn_taps`` (the same per-chunk states, and a
  short recompute off the grid). FlashInfer computes its checkpoints only for a tracked batch, so
  a pass whose taps all lie off the grid tracks the chunk start below one of them. The plan rides
  on the live ``ForwardBatch``.
- ``after_init_forward_metadata`` (AFTER ``GDNAttnBackend.init_forward_metadata``, which runs on
  the live batch eagerly and before a breakable prefill graph's replay): the plan moves onto the
  backend's per-pass metadata. The GDN layer of a breakable graph replay sees a fresh
  ``ForwardBatch`` (``prefill_cuda_graph_runner``), never the metadata's owner, so this survives
  the replay; under ``full`` prefill graphs neither hook runs and nothing is reported.
- ``around_forward_extend`` (AROUND ``GDNAttnBackend.forward_extend``): runs ``gdn_taps``' gathers
  around the layer and counts the layers that ran with the plan; after the last linear layer of
  the pass the tracked taps (when the metadata carried SGLang's tracking) and the gathered ones
  (unless a layer failed) are appended to ``req.hybrid_state_taps_done``. A pass whose only
  taps lie off every request's grid (the Triton kernel) runs ``gdn_taps`` alone. A tap never
  reported goes back unpublished (``publish._settle_inpass``).
- ``around_checkpoint_plan`` (AROUND FlashInfer's ``maybe_build_flashinfer_checkpoint_plan``):
  the same metadata from the host lists the batch carries, without SGLang's four device-to-host
  reads (a stream sync per tracked pass), for batches this cache planned.

Unverified on a GPU (benchmark/gpu/stage_inpass.py); ``inpass.py`` says when ``auto`` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from ..cpu.taps import TAPS_ATTR, mark_tap_done
from . import gdn_taps
from .inpass import CHUNK

PLAN_ATTR = "hybrid_pass_plan"  # on the live ForwardBatch, then on the backend's metadata


@dataclass(slots=True)
class PassPlan:
    """One extend pass's in-pass taps (see the module contract)."""

    tracked: list[tuple[Any, int]]  # (req, position): SGLang's tracking copies these
    extras: gdn_taps.PassTaps | None  # the other taps: gdn_taps' gathers
    layers: int  # linear layers a pass runs
    seen: set[int] = field(default_factory=set)  # layers that ran with the plan
    tracking: bool = False  # the backend's metadata carries SGLang's tracking of ``tracked``
    reported: bool = False


def _kernel(model_runner: Any) -> str:
    backend = getattr(getattr(model_runner, "attn_backend", None), "linear_attn_backend", None)
    kernel = getattr(getattr(backend, "kernel_dispatcher", None), "extend_kernel", None)
    return {"TritonGDNKernel": "triton", "FlashInferGDNKernel": "flashinfer"}.get(
        type(kernel).__name__, ""
    )


def split_rows(
    reqs: list[Any], prefix_lens: list[int], extend_lens: list[int], kernel: str
) -> tuple[list[int], list[int], list[tuple[Any, int]], list[list[tuple[int, int]]]]:
    """Per row: the tracked tap's slot and SGLang's track seqlen (-1: none), the tracked
    ``(req, position)`` pairs, and each row's other taps for ``gdn_taps``."""
    slots: list[int] = []
    seqlens: list[int] = []
    tracked: list[tuple[Any, int]] = []
    rest: list[list[tuple[int, int]]] = []
    for req, prefix, ext in zip(reqs, prefix_lens, extend_lens, strict=True):
        inside = sorted(
            (int(p), int(s))
            for p, s in getattr(req, TAPS_ATTR, None) or ()
            if prefix < int(p) < prefix + ext
        )
        grid = [t for t in inside if (t[0] - prefix) % CHUNK == 0]
        if grid:
            p, slot = grid[-1]  # the deepest: the one SGLang's single tracked row should take
            slots.append(slot)
            seqlens.append(p + 1)  # past the boundary: the state comes from the chunk states
            tracked.append((req, p))
            inside.remove((p, slot))
        else:
            slots.append(-1)
            seqlens.append(-1)
        rest.append(inside)
    if kernel == "flashinfer" and not tracked:
        _ask_for_checkpoints(prefix_lens, rest, slots, seqlens)
    return slots, seqlens, tracked, rest


def _ask_for_checkpoints(
    prefix_lens: list[int], rest: list[list[tuple[int, int]]], slots: list[int], seqlens: list[int]
) -> None:
    """FlashInfer writes its per-chunk checkpoints only when a row is tracked: with no grid tap
    in the pass, track the chunk start below an off-grid tap into that tap's own slot (the
    gather writes the same state there again and advances it; it is reported by ``gdn_taps``)."""
    for row, taps in enumerate(rest):
        for p, slot in reversed(taps):
            c = CHUNK * ((p - prefix_lens[row]) // CHUNK)
            if c:
                slots[row], seqlens[row] = slot, prefix_lens[row] + c + 1
                return


def after_init_new(fb: Any, cls: Any, batch: Any, model_runner: Any, *a: Any, **k: Any) -> None:
    if not batch.forward_mode.is_extend() or batch.forward_mode.is_target_verify():
        return
    if not any(getattr(r, TAPS_ATTR, None) for r in batch.reqs):
        return
    kernel = _kernel(model_runner)
    if not kernel or fb.mamba_track_indices is not None:  # no per-chunk states; or SGLang's own
        return
    prefix = list(fb.extend_prefix_lens_cpu or [int(x) for x in batch.prefix_lens])
    extend = list(fb.extend_seq_lens_cpu or [int(x) for x in batch.extend_lens])
    slots, seqlens, tracked, rest = split_rows(batch.reqs, prefix, extend, kernel)
    if not tracked and not any(rest):
        return
    pool = model_runner.req_to_token_pool
    conv = pool.mamba_pool.mamba_cache.conv[0]
    device = conv.device
    if any(s >= 0 for s in slots):  # else only off-grid taps from the pass start, or Triton's
        mask = [s >= 0 for s in slots]
        fb.mamba_track_indices = _h2d(slots, torch.int64, device)
        fb.mamba_track_mask = _h2d(mask, torch.bool, device)
        fb.mamba_track_seqlens = _h2d(seqlens, torch.int64, device)
        fb.mamba_prefill_track_mask_cpu = mask
        fb.mamba_track_seqlens_cpu = seqlens
    extras = None
    if any(rest):
        extras = gdn_taps.plan_pass(
            batch.reqs,
            rest,
            prefix,
            extend,
            int(conv.shape[-1]) + 1,
            device,
            layout="chunks" if kernel == "triton" else "checkpoints",
        )
    setattr(fb, PLAN_ATTR, PassPlan(tracked, extras, len(pool.mamba_map)))


def _h2d(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without a sync: staged in pinned memory on CUDA, as SGLang
    stages its own per-batch metadata."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def after_init_forward_metadata(result: Any, backend: Any, forward_batch: Any, *a: Any) -> None:
    meta = getattr(backend, "forward_metadata", None)
    if meta is None:
        return
    plan: PassPlan | None = getattr(forward_batch, PLAN_ATTR, None)
    # A fresh metadata object every pass: a plan never outlives its pass.
    setattr(meta, PLAN_ATTR, plan)
    if plan is not None:
        plan.tracking = bool(getattr(meta, "has_mamba_track_mask", False))


def around_forward_extend(
    orig: Any, backend: Any, layer: Any, forward_batch: Any, mixed_qkv: Any, *a: Any, **kw: Any
) -> Any:
    meta = getattr(backend, "forward_metadata", None)
    plan: PassPlan | None = getattr(meta, PLAN_ATTR, None)
    if (
        plan is None
        or plan.reported
        or forward_batch.forward_mode.is_target_verify()
        or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    ):
        return orig(backend, layer, forward_batch, mixed_qkv, *a, **kw)
    if plan.extras is not None:
        out = gdn_taps.capture_around(
            orig, plan.extras, backend, layer, forward_batch, mixed_qkv, *a, **kw
        )
    else:
        out = orig(backend, layer, forward_batch, mixed_qkv, *a, **kw)
    plan.seen.add(int(layer.layer_id))
    if len(plan.seen) == plan.layers:  # every linear layer of the pass ran with the plan
        plan.reported = True
        if plan.tracking:  # SGLang's tracking copied them in every layer
            for req, p in plan.tracked:
                mark_tap_done(req, p)
        if plan.extras is not None and not plan.extras.failed:
            for req, p in plan.extras.done:
                mark_tap_done(req, p)
    return out


def checkpoint_plan(
    extend_lens: list[int],
    prefix_lens: list[int],
    mask: list[bool],
    seqlens: list[int],
    every: int,
) -> tuple[list[int], list[int]]:
    """FlashInfer's packed checkpoints for a tracked batch: ``(cu_starts, sources)``; each
    request's extend has ``len // every`` checkpoints, the k-th the state after ``every * k``
    tokens, and a tracked row asking for ``every * k + 1`` reads checkpoint k."""
    cu = list(accumulate((e // every for e in extend_lens), initial=0))
    src = []
    for i, tracked in enumerate(mask):
        rel = seqlens[i] - prefix_lens[i]
        if tracked and rel % every:
            j = cu[i] + rel // every - 1
            if j < cu[i]:
                raise ValueError("a tracked GDN state precedes the first FlashInfer checkpoint")
            src.append(j)
    return cu, src


def around_checkpoint_plan(orig: Any, forward_batch: Any, meta: Any, device: Any) -> None:
    if getattr(forward_batch, PLAN_ATTR, None) is None:
        return orig(forward_batch, meta, device)  # not ours: SGLang's own path
    if meta.track_ssm_h_src is None or meta.track_ssm_h_src.numel() == 0:
        return None
    from sglang.srt.runtime_context import mamba_cache_chunk_size

    every = mamba_cache_chunk_size()
    cu, src = checkpoint_plan(
        list(forward_batch.extend_seq_lens_cpu),
        list(forward_batch.extend_prefix_lens_cpu),
        list(forward_batch.mamba_prefill_track_mask_cpu),
        list(forward_batch.mamba_track_seqlens_cpu),
        every,
    )
    if len(src) != meta.track_ssm_h_dst.numel():
        raise ValueError("FlashInfer checkpoint sources do not match the tracked rows")
    dev = torch.device(device)
    meta.track_ssm_h_src = _h2d(src, torch.int64, dev)
    meta.state_checkpoint_cu_starts = _h2d(cu, torch.int64, dev)
    meta.num_state_checkpoints = cu[-1]
    meta.state_checkpoint_every_n_tokens = every
    return None
