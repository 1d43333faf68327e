"""In-pass taps gathered from the GDN prefill's per-chunk states (``sglang/gdn_taps.py``).

SGLang's ``GDNAttnBackend`` cannot run here (its extend kernel is Triton on CUDA, its model
runner needs ``sgl_kernel``), so these tests drive the gathers' own code: the per-pass plan from
each row's taps, the gathers against a split run of a plain-torch GDN with the Triton kernel's
signature and ``h`` (``benchmark/gpu/torch_gdn.py``, the GPU check's CPU stand-in), FlashInfer's
checkpoint layout, and the layer wrapper with objects that carry exactly the attributes it reads.
On a GPU the facts these rest on (``h[:, i]`` is the state of a pass cut at ``64 i``) are checked
by stage C, the whole path by stage I (``stage_inpass.py``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from sglang_hybrid.sglang import gdn_taps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "gpu"))
import torch_gdn

W = 4  # conv width


def _plan(taps, prefix, ext, layout="chunks"):
    reqs = [SimpleNamespace(row=i) for i in range(len(taps))]
    return reqs, gdn_taps.plan_pass(reqs, taps, prefix, ext, W, "cpu", layout)


def test_plan_takes_every_tap_of_every_request_in_batch_order() -> None:
    taps = [
        [(64, 7), (100, 8), (256, 9), (1, 5)],  # 1: closer than W - 1 to the start
        [(164, 3), (150, 4)],  # prefix 100: 164 is its first chunk end, 150 is 50 in
        [],
    ]
    (a, b, _c), plan = _plan(taps, [0, 100, 0], [300, 200, 10])
    assert plan is not None
    assert plan.conv_dst.tolist() == [7, 8, 9, 3, 4]
    assert plan.conv_rows.tolist()[:2] == [[61, 62, 63], [97, 98, 99]]
    # a's chunks are 0..4 (300 tokens), b's start at 5: its offset 64 is chunk 5 + 1.
    assert plan.grid_dst.tolist() == [7, 9, 3] and plan.grid_chunks.tolist() == [1, 4, 6]
    # 100 starts from a's chunk 1 (token 64); b's 150 from its own pass start (incoming state).
    assert plan.off_dst.tolist() == [8, 4] and plan.off_chunks.tolist() == [1, -1]
    assert plan.off_rows.tolist() == [0, 1] and plan.at_pass_start
    assert plan.seg_rows.tolist() == [*range(64, 100), *range(300, 350)]
    assert plan.seg_cu.tolist() == [0, 36, 86]
    assert plan.done == [(a, 64), (a, 100), (a, 256), (b, 164), (b, 150)]  # not (a, 1)
    assert _plan([[]], [0], [10])[1] is None


def test_flashinfer_checkpoints_are_numbered_from_the_first_chunk_end() -> None:
    # Checkpoint k - 1 of a row is the state after 64 k tokens; a row has len // 64 of them.
    taps = [[(64, 7), (100, 8), (192, 9), (30, 6)], [(228, 3)]]
    (a, b), plan = _plan(taps, [0, 100], [250, 200])
    (a, b), ckpt = _plan(taps, [0, 100], [250, 200], "checkpoints")
    assert plan is not None and ckpt is not None
    assert plan.grid_chunks.tolist() == [1, 3, 6] and plan.off_chunks.tolist() == [1, -1]
    # a: 3 checkpoints (0, 1, 2); b's first is 3. 100 recomputes from checkpoint 0 (after 64),
    # 30 from the request's incoming state.
    assert ckpt.grid_chunks.tolist() == [0, 2, 4] and ckpt.grid_dst.tolist() == [7, 9, 3]
    assert ckpt.off_chunks.tolist() == [0, -1] and ckpt.off_dst.tolist() == [8, 6]
    assert ckpt.done == [(a, 64), (a, 100), (a, 192), (a, 30), (b, 228)]
    assert ckpt.needs_states and ckpt.at_pass_start
    (_,), start_only = _plan([[(30, 6)]], [0], [250], "checkpoints")
    assert start_only is not None and not start_only.needs_states
    try:
        gdn_taps.plan_pass([SimpleNamespace()], [[(64, 1)]], [0], [100], W, "cpu", "h")
    except ValueError as e:
        assert "layout" in str(e)
    else:
        raise AssertionError("an unknown layout must be refused")


class _Kernel:
    """The extend call of SGLang's TritonGDNKernel, with the plain-torch stand-in (one call per
    segment: the stand-in takes equal-length sequences only)."""

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kw):
        cu = query_start_loc.tolist()
        h = []
        for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
            _, _, hi_h = torch_gdn.chunk_gated_delta_rule(
                q[:, lo:hi],
                k[:, lo:hi],
                v[:, lo:hi],
                g[:, lo:hi],
                beta[:, lo:hi],
                initial_state=ssm_states,
                initial_state_indices=cache_indices[i : i + 1],
            )
            h.append(hi_h)
        return None, None, torch.cat(h, dim=1)


def _inputs(n: int, heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, heads, dim, generator=g) for _ in range(3))
    decay = -torch.rand(1, n, heads, generator=g)
    beta = torch.rand(1, n, heads, generator=g)
    return q, k, v, decay, beta


def test_gathered_states_equal_the_state_of_a_pass_cut_there() -> None:
    n, heads, dim = 192, 2, 8
    q, k, v, decay, beta = _inputs(n, heads, dim)
    ssm = torch.zeros(8, heads, dim, dim)  # [slots, H, V, K], SGLang's layout
    ssm[0] = torch.randn(heads, dim, dim)  # the request resumes from a state
    conv = torch.zeros(8, 6, W - 1)  # [slots, conv dim, W - 1]
    mixed_qkv = torch.randn(n, 6)
    incoming = ssm[[0]].clone()
    kernel = _Kernel()
    kw = dict(q=q, k=k, v=v, g=decay, beta=beta, cache_indices=torch.tensor([0]))
    kw["query_start_loc"] = torch.tensor([0, n])
    _, _, h = kernel.extend(**kw, ssm_states=ssm)
    _, plan = _plan([[(128, 2), (100, 3), (50, 4)]], [0], [n])
    assert plan is not None
    gdn_taps.capture_layer(plan, conv, ssm, mixed_qkv[plan.conv_rows], h, incoming)
    gdn_taps.advance(plan, kernel, ssm, kw)
    for pos, slot in ((128, 2), (100, 3), (50, 4)):
        # A pass that ends at pos, from the same incoming state, in slot 7.
        ssm[7] = incoming[0]
        cut = {name: x[:, :pos] for name, x in kw.items() if name in ("q", "k", "v", "g", "beta")}
        kernel.extend(
            **cut,
            ssm_states=ssm,
            cache_indices=torch.tensor([7]),
            query_start_loc=torch.tensor([0, pos]),
        )
        if pos % 64 == 0:
            assert torch.equal(ssm[slot], ssm[7])  # same chunks, same arithmetic: bitwise
        else:  # the chunk state advanced by the tokens since it: chunks cut differently
            torch.testing.assert_close(ssm[slot], ssm[7], rtol=1e-5, atol=1e-5)
        assert torch.equal(conv[slot], mixed_qkv[pos - 3 : pos].T)
    assert not torch.equal(ssm[2], ssm[3])


class _Dispatcher:
    def __init__(self, h):
        self.h = h
        self.extend_kernel = _Kernel()

    def extend(self, **kwargs):
        return "out", None, self.h


def _backend(h, layers: int):
    caches = {
        i: SimpleNamespace(conv=[torch.zeros(4, 6, W - 1)], temporal=torch.zeros(4, 2, 8, 8))
        for i in range(layers)
    }
    pool = SimpleNamespace(mamba2_layer_cache=caches.__getitem__)
    return SimpleNamespace(req_to_token_pool=pool, kernel_dispatcher=_Dispatcher(h)), caches


def _orig(backend, layer, forward_batch, mixed_qkv, *a, **k):
    # What SGLang's forward_extend does with the dispatcher: one keyword extend call per layer.
    n = mixed_qkv.shape[0]
    q, kk, v, g, beta = _inputs(n, 2, 8)
    call = dict(q=q, k=kk, v=v, g=g, beta=beta, cache_indices=torch.tensor([0]))
    return backend.kernel_dispatcher.extend(**call, query_start_loc=torch.tensor([0, n]))[0]


def test_the_layer_wrapper_gathers_around_sglangs_extend_call() -> None:
    h = torch.randn(1, 3, 2, 8, 8)
    backend, caches = _backend(h, 2)
    _, plan = _plan([[(128, 3)]], [0], [192])
    assert plan is not None
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False))
    mixed_qkv = torch.randn(192, 6)
    for layer in range(2):
        out = gdn_taps.capture_around(
            _orig, plan, backend, SimpleNamespace(layer_id=layer), fb, mixed_qkv
        )
        assert out == "out"
        assert "extend" not in vars(backend.kernel_dispatcher)  # the method is back
        assert torch.equal(caches[layer].temporal[3], h[0, 2])
        assert torch.equal(caches[layer].conv[0][3], mixed_qkv[125:128].T)
    assert not plan.failed


def test_without_per_chunk_states_only_pass_start_recomputes_go_on() -> None:
    conv, ssm = torch.zeros(4, 6, W - 1), torch.zeros(4, 2, 8, 8)
    _, plan = _plan([[(30, 1)]], [0], [100], "checkpoints")
    assert plan is not None
    incoming = torch.randn(1, 2, 8, 8)
    gdn_taps.capture_layer(plan, conv, ssm, torch.randn(1, W - 1, 6), None, incoming)
    assert not plan.failed and torch.equal(ssm[1], incoming[0])
    _, plan = _plan([[(64, 1)]], [0], [100], "checkpoints")
    assert plan is not None
    gdn_taps.capture_layer(plan, conv, ssm, torch.randn(1, W - 1, 6), None, incoming)
    assert plan.failed


def test_the_recompute_kernel_is_sglangs_triton_one() -> None:
    triton = type("TritonGDNKernel", (), {})()
    flashinfer = type("FlashInferGDNKernel", (), {"_alignment_fallback_kernel": triton})()
    assert gdn_taps.recompute_kernel(SimpleNamespace(extend_kernel=triton)) is triton
    assert gdn_taps.recompute_kernel(SimpleNamespace(extend_kernel=flashinfer)) is triton
    assert gdn_taps.recompute_kernel(SimpleNamespace(extend_kernel=object())) is None


def test_a_layer_without_per_chunk_states_fails_the_plan() -> None:
    backend, _ = _backend(None, 1)  # e.g. FlashInfer without checkpoints: no h
    _, plan = _plan([[(64, 1)]], [0], [100])
    assert plan is not None
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False))
    gdn_taps.capture_around(
        _orig, plan, backend, SimpleNamespace(layer_id=0), fb, torch.randn(100, 6)
    )
    assert plan.failed  # track.py then reports none of its taps: their slots go back unpublished
