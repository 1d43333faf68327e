"""The ops' CUDA path up to the launch, on the CPU: pointer tables, per-tap offsets scaled to the
kernels' vector units, dtype codes, strides and launch groups, run against a CPU emulation of
the C entry points (``kext_emulator.py``: the kernels' address arithmetic, asserting alignment
wherever they load vectors), compared bit for bit with the references. The kernels themselves
run only on a GPU (benchmark/gpu/stage_kernels.py)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import sgl_kernel_ext as kx
import torch
from kext_emulator import Emulator
from sgl_kernel_ext import ops

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def emu(monkeypatch):
    e = Emulator()
    monkeypatch.setattr(ops.STATE, "lib", e)
    monkeypatch.setattr(ops.STATE, "max_layers", 2)  # forces several launches per call
    monkeypatch.setattr(ops.STATE, "max_buffers", 2)
    monkeypatch.setattr(ops, "_use_cuda", lambda impl, device, what: impl != "reference")
    monkeypatch.setattr(ops, "_launch_ctx", lambda device: (nullcontext(), 0, 64))
    return e


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 5])  # rows of 64 or 128 bytes, and of 20 or 40
def test_kv_glue(emu, dtype, head_dim):
    g = _g(head_dim)
    kv = [torch.randn(200, 2, head_dim, generator=g).to(dtype) for _ in range(6)]
    slots = torch.randperm(200, generator=g)[:192].reshape(3, 64)
    lay = kx.bundle_layout(kv)
    a = torch.zeros(3, lay.slab_bytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    kx.kv_blocks_to_staging(kv, slots, a, impl="cuda")
    kx.kv_blocks_to_staging(kv, slots, b, impl="reference")
    assert torch.equal(a, b)
    vec = 16 if head_dim == 16 else {2: 4, 4: 8}[dtype.itemsize]  # rows of 20 or 40 bytes
    assert emu.calls == [("kv", 2, vec)] * 3  # 6 buffers in groups of 2
    back_a = [torch.zeros_like(t) for t in kv]
    back_b = [torch.zeros_like(t) for t in kv]
    kx.staging_to_kv_blocks(a, back_a, slots, impl="cuda")
    kx.staging_to_kv_blocks(a, back_b, slots, impl="reference")
    assert all(torch.equal(x, y) for x, y in zip(back_a, back_b))
    part = torch.zeros_like(a)
    for layer in (2, 0, 1):
        kx.kv_blocks_to_staging(kv, slots, part, layers=[layer], impl="cuda")
    assert torch.equal(part, b)
    # A staging view at an odd byte offset: vectors narrow to what the addresses allow.
    wide = torch.zeros(3, lay.slab_bytes + 1, dtype=torch.uint8)
    kx.kv_blocks_to_staging(kv, slots, wide[:, 1:], impl="cuda")
    assert emu.calls[-1][2] == 1
    assert torch.equal(wide[:, 1:], b)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_state_glue(emu, src, dst):
    g = _g(1)
    hs = torch.randn(3, 2, 5, 2, 4, 8, generator=g).to(src)  # stacked: L=3, B=2, NT=5
    pool = torch.randn(4, 7, 2, 4, 8, generator=g).to(dst)
    taps = [(0, 6), (9, 0), (4, 3)]
    a, b = pool.clone(), pool.clone()
    kx.gather_state_taps(hs, a, taps, layers=[3, 1, 0], impl="cuda")
    kx.gather_state_taps(hs, b, taps, layers=[3, 1, 0], impl="reference")
    assert torch.equal(a, b)
    assert emu.calls == [("state", 2, 1), ("state", 1, 1)]  # aligned: vector packs
    # Misaligned: a row of 3 elements and an h view starting one element in.
    base = torch.randn(1 + 2 * 5 * 3, generator=g).to(src)
    h = base[1:].view(2, 5, 1, 1, 3)
    p = torch.randn(1, 4, 1, 1, 3, generator=g).to(dst)
    a, b = p.clone(), p.clone()
    kx.gather_state_taps(h, a, [(7, 2), (0, 0)], impl="cuda")
    assert emu.calls[-1] == ("state", 1, 0)  # misaligned: element by element
    kx.gather_state_taps(h, b, [(7, 2), (0, 0)], impl="reference")
    assert torch.equal(a, b)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float32])
def test_conv_glue(emu, src, dst):
    g = _g(2)
    w, d, lens = 3, 5, [7, 2, 4]
    n_tok = sum(lens)
    proj = torch.randn(3, n_tok, 2 * d, generator=g).to(src)
    x = proj[:, :, d:]  # strided tokens
    pool = torch.randn(3, 12, d, w, generator=g).to(dst)
    spec = [(0, 0, 1, 2), (0, 1, 1, 3), (0, 3, 1, 4), (0, 7, 1, 5), (1, 1, 0, 6), (2, 4, -1, 7)]
    reqs, poss, ins, slots = zip(*spec)
    taps = kx.conv_taps_for(lens, reqs, poss, ins, slots)
    incoming = torch.randn(3, 5, d, w, generator=g).to(src).transpose(-1, -2).contiguous()
    incoming = incoming.transpose(-1, -2)  # window-first storage seen as [rows, D, W]
    a, b = pool.clone(), pool.clone()
    kx.gather_conv_taps(x, a, taps, incoming, layers=[2, 0, 1], impl="cuda")
    kx.gather_conv_taps(x, b, taps, incoming, layers=[2, 0, 1], impl="reference")
    assert torch.equal(a, b)
    assert emu.calls == [("conv", 2, 0), ("conv", 1, 0)]
    # The pool's own layer as the incoming state (no slot both read and written).
    a, b = pool.clone(), pool.clone()
    kx.gather_conv_taps(x[0], a, taps, a[1:2], layers=[1], impl="cuda")
    kx.gather_conv_taps(x[0], b, taps, b[1:2].clone(), layers=[1], impl="reference")
    assert torch.equal(a, b)
