"""Stage I: in-pass taps through SGLang's own prefill tracking (issue #36, docs/inpass-capture.md).

``sglang_hybrid.sglang.track`` fills the five ``ForwardBatch`` tracking fields SGLang's
``extra_buffer`` strategy fills, with the cache's snapshot slots as destinations; SGLang's GDN
backend turns them into its track metadata and copies one state per request inside the pass,
and ``gdn_taps`` gathers the request's other grid taps from the same per-chunk states. This stage
runs that path with SGLang's own code on the device, per GDN prefill kernel:

- Triton (``TritonGDNKernel``, always): three requests of different lengths packed in one
  extend, taps on each request's 64-token grid (one tracked, others gathered) and one off it
  (gathered and recomputed); every captured SSM state against the state a pass ending at the
  tap leaves (bf16 rounding of ``h``: rel <= 1e-2) and every conv window bit for bit;
- FlashInfer (``FlashInferGDNKernel``, when the carried FlashInfer has its GDN prefill): the
  same batch, the checkpoint plan from ``track.around_checkpoint_plan`` (against SGLang's own
  ``maybe_build_flashinfer_checkpoint_plan`` on the same batch), the off-grid taps recomputed by
  the Triton kernel from the fp32 checkpoints, states against a pass of FlashInfer ending there
  (rel <= 1e-5, bitwise reported); this is the
  record ``inpass.VERIFIED[("flashinfer", ...)]`` waits for, together with a model-runner run
  under breakable prefill graphs (which this check cannot make: SGLang's model runner needs
  ``sgl_kernel``, which is not carried; the plan's survival of a fresh ``ForwardBatch`` is
  ``test/sglang/test_inpass_track.py``'s);
- timing: the extend with and without tracking (FlashInfer writes every request's checkpoints).

The GDN backend is SGLang's ``GDNAttnBackend`` built without a model runner (its track-metadata
and state-copy methods read a handful of attributes); its two conv-window lines from
``forward_extend`` are repeated here. ``mamba_cache_chunk_size`` (64 at pages <= 64) is pinned,
as it reads the process's server args. In the CPU smoke mode the Triton kernel is the torch
stand-in (``torch_gdn.py``: equal-length requests only, so one request per extend there).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from common import Ctx, add_paths, log, timed_ms

CHUNK = 64
W = 4  # conv width: W - 1 = 3 pre-conv rows per conv state


def _pin_chunk_size() -> None:
    from sglang.srt import runtime_context
    from sglang.srt.layers.attention.linear.kernels import gdn_flashinfer
    from sglang.srt.model_executor import forward_batch_info

    for mod in (runtime_context, gdn_flashinfer, forward_batch_info):
        mod.mamba_cache_chunk_size = lambda: CHUNK  # type: ignore[attr-defined]


def _kernels(ctx: Ctx) -> dict[str, Any]:
    """Extend kernels with TritonGDNKernel.extend's call (keyword q, k, v, g, beta, ...)."""
    out: dict[str, Any] = {}
    if ctx.cuda:
        from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

        out["triton"] = TritonGDNKernel()
        try:
            from sglang.srt.layers.attention.linear.kernels.gdn_flashinfer import (
                FlashInferGDNKernel,
                is_flashinfer_gdn_prefill_available,
            )

            if is_flashinfer_gdn_prefill_available():
                out["flashinfer"] = FlashInferGDNKernel()
            else:
                ctx.note("flashinfer", "FlashInfer's GDN prefill is not available here")
        except Exception as e:  # recorded: the stage still checks Triton
            ctx.note("flashinfer", f"not importable: {e!r}")
        return out
    import torch_gdn

    class StandIn:  # TritonGDNKernel.extend over the torch stand-in, one request per call
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kw):
            cu = query_start_loc.tolist()
            if len(cu) != 2:
                raise NotImplementedError("the stand-in runs one request per extend")
            return torch_gdn.chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                initial_state=ssm_states,
                initial_state_indices=cache_indices,
                use_qk_l2norm_in_kernel=True,
            )

    out["triton"] = StandIn()
    return out


class FlaKernel:
    """``TritonGDNKernel.extend``'s call of SGLang's FLA ``chunk_gated_delta_rule`` (on CUDA; the
    CPU build of SGLang imports ``sgl_kernel``'s kernel instead, so the interpreter test calls the
    FLA function through this)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kw):
        return self.fn(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=ssm_states,
            initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc,
            head_first=False,
            use_qk_l2norm_in_kernel=True,
        )


def _inputs(
    n: int, hk: int, h: int, d: int, device: str, seed: int, bf16: bool
) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16 if bf16 else torch.float32
    return {
        "q": torch.randn(1, n, hk, d, generator=g).to(dt).to(device),
        "k": torch.randn(1, n, hk, d, generator=g).to(dt).to(device),
        "v": (0.5 * torch.randn(1, n, h, d, generator=g)).to(dt).to(device),
        "g": (-torch.nn.functional.softplus(torch.randn(1, n, h, generator=g)) * 0.3).to(device),
        "beta": torch.sigmoid(torch.randn(1, n, h, generator=g)).to(dt).to(device),
    }


def _backend(kernel: Any, conv: torch.Tensor, device: str) -> Any:
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    be = object.__new__(GDNAttnBackend)
    be._mamba_chunk_size, be.device, be.conv_states_shape = CHUNK, device, conv.shape
    be.kernel_dispatcher = SimpleNamespace(extend_kernel=kernel)
    return be


def one_kernel(
    ctx: Ctx,
    name: str,
    kernel: Any,
    *,
    packed: bool | None = None,
    dims: tuple[int, int, int] | None = None,
    bf16: bool | None = None,
    recompute: Any = None,
) -> dict[str, Any]:
    """Capture the taps of one packed extend through SGLang's tracking and gdn_taps (``packed``:
    three requests in the extend, else one; ``dims``: key heads, value heads, head dim;
    ``recompute``: the off-grid recompute's kernel, SGLang's Triton one; default ``kernel``)."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from sglang_hybrid.cpu.taps import TAPS_ATTR
    from sglang_hybrid.sglang import gdn_taps, track

    dev = ctx.device
    hk, h, d = dims or ((4, 8, 128) if ctx.cuda and not ctx.quick else (1, 2, 32))
    packed = ctx.cuda if packed is None else packed  # the CPU stand-in: one request per extend
    bf16 = ctx.cuda if bf16 is None else bf16
    lens = (330, 200, 257) if packed else (330,)
    prefix = (0, 100, 64) if packed else (0,)
    # Taps: request 0 at 64, 192 (tracked: the deepest on its grid) and 100 (off the grid:
    # recomputed from 64); request 1 at 164 (tracked) and 130 (30 past its start: recomputed from
    # its incoming state); request 2 at 128 and 256 (its grid from 64).
    wanted = [[64, 192, 100], [164, 130], [128, 256]][: len(lens)]
    slots = iter(range(8, 64))
    taps = [[(p, next(slots)) for p in row] for row in wanted]
    n = sum(lens)
    x = _inputs(n, hk, h, d, dev, seed=3, bf16=bf16)
    ssm = torch.zeros(64, h, d, d, dtype=torch.float32, device=dev)
    conv = torch.zeros(64, 16, W - 1, dtype=torch.bfloat16 if bf16 else torch.float32)
    conv = conv.to(dev)
    gen = torch.Generator(device="cpu").manual_seed(4)
    for i in range(len(lens)):
        ssm[i] = (0.1 * torch.randn(h, d, d, generator=gen)).to(dev)  # incoming states
    incoming = ssm[: len(lens)].clone()
    mixed_qkv = torch.randn(n, 16, generator=gen).to(conv.dtype).to(dev)
    reqs = [SimpleNamespace(rid=f"r{i}", **{TAPS_ATTR: t}) for i, t in enumerate(taps)]
    mode = ForwardMode.EXTEND
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(lens),
        input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
        req_pool_indices=torch.arange(len(lens), device=dev),
        seq_lens=torch.tensor([p + e for p, e in zip(prefix, lens)], device=dev),
        out_cache_loc=torch.zeros(n, dtype=torch.int64, device=dev),
        seq_lens_sum=sum(prefix) + n,
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
        extend_seq_lens_cpu=list(lens),
        extend_prefix_lens_cpu=list(prefix),
    )
    kname = "TritonGDNKernel" if name == "triton" else "FlashInferGDNKernel"
    layer_cache = SimpleNamespace(conv=[conv], temporal=ssm)
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=layer_cache),
        mamba_map={0: 0},
        mamba2_layer_cache=lambda _i: layer_cache,
    )
    be = _backend(type(kname, (), {})(), conv, dev)
    runner = SimpleNamespace(
        attn_backend=SimpleNamespace(linear_attn_backend=be), req_to_token_pool=pool
    )
    batch = SimpleNamespace(forward_mode=mode, reqs=reqs, prefix_lens=prefix, extend_lens=lens)
    track.after_init_new(fb, ForwardBatch, batch, runner)
    plan = getattr(fb, track.PLAN_ATTR)
    cache_indices = torch.arange(len(lens), dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    chunk_idx, h_src, h_dst, h_rows, f_src, f_dst, *_ = be._init_track_ssm_indices_from_cpu(
        cache_indices.long(), fb
    )
    rows = torch.tensor([i for i, m in enumerate(fb.mamba_prefill_track_mask_cpu) if m], device=dev)
    meta = ForwardMetadata(
        query_start_loc=qsl,
        mamba_cache_indices=cache_indices,
        track_conv_indices=be._init_track_conv_indices(qsl, fb, rows),
        track_ssm_h_src=h_src,
        track_ssm_h_dst=h_dst,
        track_ssm_final_src=f_src,
        track_ssm_final_dst=f_dst,
        track_chunk_idx=chunk_idx,
        track_ssm_h_batch_src=h_rows,
        has_mamba_track_mask=True,
    )
    extend_kw: dict[str, Any] = {}
    if name == "flashinfer":
        from sglang.srt.layers.attention.linear.kernels import gdn_flashinfer

        theirs = ForwardMetadata(**{**meta.__dict__})
        sglangs = gdn_flashinfer.maybe_build_flashinfer_checkpoint_plan
        getattr(sglangs, "__wrapped__", sglangs)(fb, theirs, dev)
        track.around_checkpoint_plan(sglangs, fb, meta, dev)
        ctx.check(
            "flashinfer: the cache's host-side checkpoint plan equals SGLang's",
            meta.track_ssm_h_src.tolist() == theirs.track_ssm_h_src.tolist()
            and meta.num_state_checkpoints == theirs.num_state_checkpoints,
            ours=meta.track_ssm_h_src.tolist(),
            sglangs=theirs.track_ssm_h_src.tolist(),
        )
        extend_kw = dict(
            state_checkpoint_cu_starts=meta.state_checkpoint_cu_starts,
            num_state_checkpoints=meta.num_state_checkpoints,
            state_checkpoint_every_n_tokens=meta.state_checkpoint_every_n_tokens,
        )
    # GDNAttnBackend.forward_extend's conv-window lines, then the extend (wrapped by gdn_taps
    # for the other taps), then SGLang's own state copy.
    conv[fb.mamba_track_indices[rows]] = mixed_qkv[meta.track_conv_indices].transpose(1, 2)
    call = dict(x, ssm_states=ssm, cache_indices=cache_indices, query_start_loc=qsl, **extend_kw)
    extras = plan.extras
    windows = mixed_qkv[extras.conv_rows] if extras is not None else None
    out = kernel.extend(**call)
    hs = out[2] if isinstance(out, tuple) and len(out) > 2 else None
    be._track_mamba_state_extend(fb, hs, ssm, meta)
    if extras is not None:
        at_start = incoming[extras.off_rows] if extras.at_pass_start else None
        gdn_taps.capture_layer(extras, conv, ssm, windows, hs, at_start)
        gdn_taps.advance(extras, recompute or kernel, ssm, call)
    # Each tap against a pass of the same request ending there, from the same incoming state.
    worst, bitwise, conv_ok = 0.0, True, True
    start = 0
    for r, (req_taps, pre, length) in enumerate(zip(taps, prefix, lens)):
        for p, slot in req_taps:
            o = p - pre
            ref = torch.zeros(64, h, d, d, dtype=torch.float32, device=dev)
            ref[0] = incoming[r]
            one = {k: v[:, start : start + o] for k, v in x.items()}
            kernel.extend(
                **one,
                ssm_states=ref,
                cache_indices=torch.zeros(1, dtype=torch.int32, device=dev),
                query_start_loc=torch.tensor([0, o], dtype=torch.int32, device=dev),
            )
            scale = max(ref[0].abs().max().item(), 1e-12)
            err = (ssm[slot] - ref[0]).abs().max().item() / scale
            worst = max(worst, err)
            bitwise = bitwise and bool(torch.equal(ssm[slot], ref[0]))
            conv_ok = conv_ok and bool(
                torch.equal(conv[slot], mixed_qkv[start + o - (W - 1) : start + o].T)
            )
        start += length
    bound = 1e-2 if name == "triton" and bf16 else 1e-5
    ctx.check(
        f"{name}: every tap captured inside the pass (SGLang's tracked row and gdn_taps' "
        f"others) is the state of a pass ending there (rel <= {bound:g}); conv windows exact",
        worst <= bound and conv_ok,
        worst_rel=worst,
        bitwise=bitwise,
        taps=sum(len(t) for t in taps),
    )
    times: dict[str, float] = {}
    if ctx.cuda:
        plain = dict(x, ssm_states=ssm.clone(), cache_indices=cache_indices, query_start_loc=qsl)
        times["extend_ms"] = timed_ms(lambda: kernel.extend(**plain), dev, events=True)
        tracked = dict(plain, **extend_kw)
        times["extend_tracked_ms"] = timed_ms(lambda: kernel.extend(**tracked), dev, events=True)
        t0, t1 = times["extend_ms"], times["extend_tracked_ms"]
        log(f"    {name}: extend {t0:.3f} ms, with tracking {t1:.3f} ms")
    return {"worst_rel": worst, "bitwise": bitwise, **times}


def run(ctx: Ctx) -> None:
    add_paths()
    _pin_chunk_size()
    results: dict[str, Any] = {}
    ctx.result["kernels"] = results
    kernels = _kernels(ctx)
    for name, kernel in kernels.items():
        log(f"  {name}")
        results[name] = one_kernel(ctx, name, kernel, recompute=kernels["triton"])
        ctx.flush()


def dry(ctx: Ctx) -> None:
    """Imports of every entry point used; what the check would run."""
    add_paths()
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kernels import gdn_flashinfer  # noqa: F401
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata  # noqa: F401

    from sglang_hybrid.sglang import gdn_taps, track  # noqa: F401

    for m in ("_init_track_ssm_indices_from_cpu", "_init_track_conv_indices"):
        assert callable(getattr(GDNAttnBackend, m)), m
    assert callable(GDNAttnBackend._track_mamba_state_extend)
    ctx.note("plan", {"kernels": ["triton", "flashinfer (if carried)"], "requests": 3})
    ctx.check("SGLang's GDN track entry points and the cache's hooks import", True)
