"""In-pass taps through SGLang's own prefill tracking (``sglang/track.py``, ``sglang/inpass.py``).

The cache fills the five ``ForwardBatch`` fields SGLang's ``extra_buffer`` strategy fills; these
tests hand them to SGLang 0.5.23's own code that reads them: a real ``ForwardBatch``, the GDN
backend's host-side track plan and conv indices (``MambaAttnBackendBase._init_track_*``, run on a
``GDNAttnBackend`` built without a model runner), its state copy (``_track_mamba_state_extend``),
and FlashInfer's checkpoint plan (``maybe_build_flashinfer_checkpoint_plan``). The per-chunk
states come from the plain-torch GDN with the Triton kernel's signature (``torch_gdn.py``); the
states SGLang copies are compared with the state of a pass that ends at the tap. One lookup is
stubbed: ``mamba_cache_chunk_size`` (64 at pages <= 64) reads the process's server args.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt import runtime_context
from sglang.srt.layers.attention.linear import gdn_backend
from sglang.srt.layers.attention.linear.kernels import gdn_flashinfer
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sglang_hybrid.cpu.taps import TAPS_ATTR, TAPS_DONE_ATTR
from sglang_hybrid.sglang import inpass, track

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "gpu"))
import torch_gdn

W = 4  # conv width: SGLang's conv state keeps W - 1 = 3 pre-conv rows
HEADS, DIM, CONV_DIM, SLOTS = 2, 8, 6, 12


@pytest.fixture(autouse=True)
def _chunk_64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forward_batch_info, "mamba_cache_chunk_size", lambda: 64)
    monkeypatch.setattr(gdn_flashinfer, "mamba_cache_chunk_size", lambda: 64)
    monkeypatch.setattr(runtime_context, "mamba_cache_chunk_size", lambda: 64)


def _kernel(name: str) -> object:
    return type(name, (), {})()


def _runner(kernel: str, layers: int = 1, graphs: object = None) -> SimpleNamespace:
    caches = {
        i: SimpleNamespace(
            conv=[torch.zeros(SLOTS, CONV_DIM, W - 1)],
            temporal=torch.zeros(SLOTS, HEADS, DIM, DIM),
        )
        for i in range(layers)
    }
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=caches[0]),
        mamba_map={i: i for i in range(layers)},
        mamba2_layer_cache=caches.__getitem__,
    )
    linear = object.__new__(gdn_backend.GDNAttnBackend)
    linear.kernel_dispatcher = SimpleNamespace(extend_kernel=_kernel(kernel))
    return SimpleNamespace(
        attn_backend=SimpleNamespace(linear_attn_backend=linear),
        req_to_token_pool=pool,
        prefill_cuda_graph_runner=graphs,
    )


def _batch(taps: list[list[tuple[int, int]]], prefix: list[int], ext: list[int]):
    reqs = [SimpleNamespace(rid=f"r{i}", **{TAPS_ATTR: t}) for i, t in enumerate(taps)]
    mode = ForwardMode.EXTEND
    batch = SimpleNamespace(forward_mode=mode, reqs=reqs, prefix_lens=prefix, extend_lens=ext)
    bs, n = len(reqs), sum(ext)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.tensor([p + e for p, e in zip(prefix, ext, strict=True)]),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        seq_lens_sum=sum(prefix) + n,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens_cpu=list(ext),
        extend_prefix_lens_cpu=list(prefix),
    )
    return reqs, batch, fb


def test_the_deepest_tap_on_each_requests_grid_is_sglangs_tracked_row() -> None:
    taps = [[(64, 7), (128, 8), (100, 9)], [(150, 3)], [(164, 4), (228, 5)], []]
    prefix, ext = [0, 100, 100, 0], [300, 200, 200, 10]
    reqs, batch, _fb = _batch(taps, prefix, ext)
    slots, seqlens, tracked, rest = track.split_rows(batch.reqs, prefix, ext, "triton")
    # Row 1's only tap (150) is 50 past its start: off its grid, no tracked row.
    assert slots == [8, -1, 5, -1] and seqlens == [129, -1, 229, -1]
    assert tracked == [(reqs[0], 128), (reqs[2], 228)]
    assert rest == [[(64, 7), (100, 9)], [(150, 3)], [(164, 4)], []]
    # FlashInfer: the same split (its other taps are gathered and recomputed the same way).
    assert track.split_rows(batch.reqs, prefix, ext, "flashinfer")[3] == rest
    # With no grid tap in the pass, FlashInfer must still be asked for its checkpoints: the
    # chunk start below an off-grid tap is tracked into that tap's own slot, not reported.
    _, batch, _ = _batch([[(100, 7)], [(150, 3), (250, 4)]], [0, 100], [192, 200])
    slots, seqlens, tracked, rest = track.split_rows(batch.reqs, [0, 100], [192, 200], "flashinfer")
    assert tracked == [] and slots == [7, -1] and seqlens == [65, -1]
    assert rest == [[(100, 7)], [(150, 3), (250, 4)]]
    slots, _, _, _ = track.split_rows(batch.reqs, [0, 100], [192, 200], "triton")
    assert slots == [-1, -1]  # Triton's h exists without tracking


def test_the_fields_drive_sglangs_own_track_plan_to_the_tapped_states() -> None:
    """Two requests in one pass (one resuming at 100); SGLang's metadata and copy put the state
    and conv window of each tracked tap into its slot: equal to a pass ending there."""
    prefix, ext, n = [0, 100], [192, 200], 392
    taps = [[(128, 7)], [(164, 9)]]
    _reqs, batch, fb = _batch(taps, prefix, ext)
    runner = _runner("TritonGDNKernel")
    track.after_init_new(fb, ForwardBatch, batch, runner)
    assert fb.mamba_prefill_track_mask_cpu == [True, True]
    assert fb.mamba_track_seqlens_cpu == [129, 165] and fb.mamba_track_indices.tolist() == [7, 9]

    backend = runner.attn_backend.linear_attn_backend
    backend._mamba_chunk_size, backend.device = 64, "cpu"
    cache = runner.req_to_token_pool.mamba2_layer_cache(0)
    ssm, conv = cache.temporal, cache.conv[0]
    backend.conv_states_shape = conv.shape
    cache_indices = torch.tensor([0, 1])
    g = torch.Generator().manual_seed(1)
    ssm[1] = torch.randn(HEADS, DIM, DIM, generator=g)  # the second request's incoming state
    incoming = ssm[[0, 1]].clone()
    qsl = torch.tensor([0, 192, n])
    assert backend._has_cpu_prefill_track_metadata(fb)
    mask_rows = torch.tensor([0, 1])
    (chunk_idx, h_src, h_dst, h_rows, final_src, final_dst, *_) = (
        backend._init_track_ssm_indices_from_cpu(cache_indices, fb)
    )
    assert h_src.tolist() == [2, 3 + 1] and h_dst.tolist() == [7, 9] and final_src.numel() == 0
    meta = ForwardMetadata(
        query_start_loc=qsl,
        mamba_cache_indices=cache_indices,
        track_conv_indices=backend._init_track_conv_indices(qsl, fb, mask_rows),
        track_ssm_h_src=h_src,
        track_ssm_h_dst=h_dst,
        track_ssm_final_src=final_src,
        track_ssm_final_dst=final_dst,
        track_chunk_idx=chunk_idx,
        track_ssm_h_batch_src=h_rows,
        has_mamba_track_mask=True,
    )
    # What GDNAttnBackend.forward_extend does with them: the conv windows before the layer's
    # convolution (its two lines, as in SGLang), the extend, then SGLang's own state copy.
    mixed_qkv = torch.randn(n, CONV_DIM, generator=g)
    conv[fb.mamba_track_indices[mask_rows]] = mixed_qkv[meta.track_conv_indices].transpose(1, 2)
    q, k, v = (torch.randn(1, n, HEADS, DIM, generator=g) for _ in range(3))
    decay, beta = -torch.rand(1, n, HEADS, generator=g), torch.rand(1, n, HEADS, generator=g)
    hs = []
    for i, (lo, hi) in enumerate(((0, 192), (192, n))):
        *_, h = torch_gdn.chunk_gated_delta_rule(
            q[:, lo:hi],
            k[:, lo:hi],
            v[:, lo:hi],
            decay[:, lo:hi],
            beta[:, lo:hi],
            initial_state=ssm,
            initial_state_indices=cache_indices[i : i + 1],
        )
        hs.append(h)
    backend._track_mamba_state_extend(fb, torch.cat(hs, dim=1), ssm, meta)
    for row, (start, p, slot) in enumerate(((0, 128, 7), (192, 164, 9))):
        cut = ssm.clone()
        cut[11] = incoming[row]
        lo = start
        hi = start + p - prefix[row]
        torch_gdn.chunk_gated_delta_rule(
            q[:, lo:hi],
            k[:, lo:hi],
            v[:, lo:hi],
            decay[:, lo:hi],
            beta[:, lo:hi],
            initial_state=cut,
            initial_state_indices=torch.tensor([11]),
        )
        assert torch.equal(ssm[slot], cut[11]), f"row {row}: the state at {p}"
        assert torch.equal(conv[slot], mixed_qkv[hi - 3 : hi].T), f"row {row}: conv at {p}"


def test_our_checkpoint_plan_is_sglangs_without_the_host_reads() -> None:
    prefix, ext = [0, 100, 64], [300, 200, 130]
    taps = [[(128, 7), (256, 8)], [], [(128, 2)]]
    _reqs, batch, fb = _batch(taps, prefix, ext)
    track.after_init_new(fb, ForwardBatch, batch, _runner("FlashInferGDNKernel"))
    n_dst = sum(fb.mamba_prefill_track_mask_cpu)

    def meta() -> ForwardMetadata:
        return ForwardMetadata(
            query_start_loc=torch.zeros(4, dtype=torch.int32),
            mamba_cache_indices=torch.arange(3),
            track_ssm_h_src=torch.zeros(n_dst, dtype=torch.int64),
            track_ssm_h_dst=torch.zeros(n_dst, dtype=torch.int64),
        )

    theirs, ours = meta(), meta()
    gdn_flashinfer.maybe_build_flashinfer_checkpoint_plan(fb, theirs, "cpu")
    track.around_checkpoint_plan(
        gdn_flashinfer.maybe_build_flashinfer_checkpoint_plan, fb, ours, "cpu"
    )
    assert ours.track_ssm_h_src.tolist() == theirs.track_ssm_h_src.tolist() == [3, 4 + 3 + 0]
    assert ours.state_checkpoint_cu_starts.tolist() == theirs.state_checkpoint_cu_starts.tolist()
    assert ours.num_state_checkpoints == theirs.num_state_checkpoints == 4 + 3 + 2
    assert ours.state_checkpoint_every_n_tokens == 64
    # A batch this cache did not plan goes to SGLang's own function.
    called = []
    other = SimpleNamespace()
    track.around_checkpoint_plan(lambda *a: called.append(a), other, ours, "cpu")
    assert called == [(other, ours, "cpu")]


def test_taps_are_reported_once_every_layer_ran_even_on_a_fresh_forward_batch() -> None:
    """Breakable prefill graphs hand the GDN layer a new ForwardBatch; the plan rides on the
    backend's metadata, built from the live batch."""
    reqs, batch, fb = _batch([[(128, 7)]], [0], [192])
    runner = _runner("FlashInferGDNKernel", layers=3)
    track.after_init_new(fb, ForwardBatch, batch, runner)
    backend = runner.attn_backend.linear_attn_backend
    backend.forward_metadata = SimpleNamespace(has_mamba_track_mask=True)
    track.after_init_forward_metadata(None, backend, fb)
    static = SimpleNamespace(forward_mode=ForwardMode.EXTEND)  # no plan on it
    calls = []

    def orig(be, layer, forward_batch, mixed_qkv, **kw):
        calls.append(layer.layer_id)
        return "out"

    for layer in range(3):
        assert getattr(reqs[0], TAPS_DONE_ATTR, None) is None
        out = track.around_forward_extend(
            orig, backend, SimpleNamespace(layer_id=layer), static, None, a=None, b=None
        )
        assert out == "out"
    assert calls == [0, 1, 2] and reqs[0].hybrid_state_taps_done == [128]
    # Without the tracking metadata (e.g. a path that ignored the fields) nothing is reported;
    # nor when the layers ran without the plan (full prefill graphs: no hook at replay).
    reqs, batch, fb = _batch([[(128, 7)]], [0], [192])
    track.after_init_new(fb, ForwardBatch, batch, runner)
    backend.forward_metadata = SimpleNamespace(has_mamba_track_mask=False)
    track.after_init_forward_metadata(None, backend, fb)
    for layer in range(3):
        track.around_forward_extend(orig, backend, SimpleNamespace(layer_id=layer), static, None)
    assert getattr(reqs[0], TAPS_DONE_ATTR, None) is None
    reqs, batch, fb = _batch([[(128, 7)]], [0], [192])
    track.after_init_new(fb, ForwardBatch, batch, runner)
    backend.forward_metadata = SimpleNamespace(has_mamba_track_mask=True)
    for layer in range(3):
        track.around_forward_extend(orig, backend, SimpleNamespace(layer_id=layer), static, None)
    assert getattr(reqs[0], TAPS_DONE_ATTR, None) is None


def test_no_fields_without_a_kernel_with_per_chunk_states() -> None:
    _, batch, fb = _batch([[(128, 7)]], [0], [192])
    track.after_init_new(fb, ForwardBatch, batch, _runner("CuteDSLGDNKernel"))
    assert fb.mamba_track_indices is None and getattr(fb, track.PLAN_ATTR, None) is None


def test_off_grid_taps_alone_run_gdn_taps_without_sglangs_tracking() -> None:
    _reqs, batch, fb = _batch([[(100, 7)]], [0], [192])
    runner = _runner("TritonGDNKernel", layers=2)
    track.after_init_new(fb, ForwardBatch, batch, runner)
    assert fb.mamba_track_indices is None  # no tracked row: SGLang's fields stay unset
    plan = getattr(fb, track.PLAN_ATTR)
    assert plan.tracked == [] and plan.extras is not None and plan.extras.off_dst.tolist() == [7]
    backend = runner.attn_backend.linear_attn_backend
    backend.forward_metadata = SimpleNamespace(has_mamba_track_mask=False)
    track.after_init_forward_metadata(None, backend, fb)
    assert getattr(backend.forward_metadata, track.PLAN_ATTR) is plan and not plan.tracking


def _graphs(name: str) -> object:
    return type("PrefillCudaGraphRunner", (), {"prefill_backend_name": name})()


def test_capture_of_reports_kernel_graph_backend_and_exactness() -> None:
    tri = inpass.capture_of(SimpleNamespace(model_runner=_runner("TritonGDNKernel")))
    assert (tri.grid, tri.kernel, tri.graph, tri.exact) == (1, "triton", "disabled", False)
    fi = inpass.capture_of(
        SimpleNamespace(model_runner=_runner("FlashInferGDNKernel", graphs=_graphs("breakable")))
    )
    assert (fi.grid, fi.kernel, fi.graph, fi.exact) == (1, "flashinfer", "breakable", True)
    full = inpass.capture_of(
        SimpleNamespace(model_runner=_runner("FlashInferGDNKernel", graphs=_graphs("full")))
    )
    assert full.grid == 0 and "full prefill CUDA graphs" in full.reason
    cute = inpass.capture_of(SimpleNamespace(model_runner=_runner("CuteDSLGDNKernel")))
    assert cute.grid == 0 and cute.kernel == "CuteDSLGDNKernel"
    assert inpass.capture_of(SimpleNamespace()).grid == 0


def test_auto_takes_in_pass_capture_only_where_exact_and_verified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Today: nothing verified on a GPU, so an H200 with SGLang's defaults splits where it pays.
    choice = inpass.resolve_mode("auto", inpass.H200_DEFAULT)
    assert (choice.mode, choice.grid) == ("split", 0)
    assert "stage_inpass.py" in choice.message and "flashinfer" in choice.message
    assert inpass.replay_default() == choice
    tri = inpass.H200_DEFAULT._replace(kernel="triton", grid=1, exact=False)
    monkeypatch.setitem(inpass.VERIFIED, tri.key, "a check")
    assert inpass.resolve_mode("auto", tri).mode == "split"  # bf16 states: never by default
    assert inpass.resolve_mode("zero-split", tri).grid == 1  # but on request
    monkeypatch.setitem(inpass.VERIFIED, inpass.H200_DEFAULT.key, "stage I on an H200")
    assert inpass.resolve_mode("auto", inpass.H200_DEFAULT)[:2] == ("zero-split", 1)
    assert inpass.replay_default().mode == "zero-split"
    with pytest.raises(ValueError, match="captures no state"):
        inpass.resolve_mode("zero-split", inpass.H200_DEFAULT._replace(grid=0))


def test_the_split_threshold_flag() -> None:
    import argparse

    from sglang_hybrid.sglang.flags import add_cli_args, options_from_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    base = ["--hybrid-host-cache-mib", "0"]
    assert options_from_namespace(parser.parse_args(base)).split_threshold == 1.0
    opts = options_from_namespace(parser.parse_args([*base, "--hybrid-split-threshold", "0"]))
    assert opts.split_threshold == 0.0
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--hybrid-split-threshold", bad])
