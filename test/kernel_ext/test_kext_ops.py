"""sgl_kernel_ext's torch references against straightforward loops, on the CPU.

Random inputs across dtypes, page sizes and tap positions (the pass start, within kernel-1 of it,
the last position); the staging layout against the host tier's own slab copies; round trips
staging -> blocks -> staging bit-exact. The CUDA kernels are checked against these references
by benchmark/gpu/stage_kernels.py on a GPU.
"""

from __future__ import annotations

import pytest
import sgl_kernel_ext as kx
import torch
from kext_loops import conv_taps, kv_to_staging, staging_to_kv, state_taps

from sglang_hybrid.index import HostSlabPool
from sglang_hybrid.store.host_memory import HostMemory
from sglang_hybrid.store.layout import build_layout
from sglang_hybrid.store.transfer import BlockCopy, SlabCopier

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rand(shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


def _kv_buffers(dtype, n_layers=2, slots=1024, heads=(2, 3), head_dim=(8, 5), g=None):
    """K then V buffers; layer 1 has a different row size (heads x head_dim) than layer 0."""
    ks = [_rand((slots, heads[i], head_dim[i]), dtype, g) for i in range(n_layers)]
    vs = [_rand((slots, heads[i], head_dim[i]), dtype, g) for i in range(n_layers)]
    return ks + vs


def _paged_blocks(n_blocks, page, slots, g, rows=64):
    """Slot lists as a paged allocator hands them out: pages of ``page`` consecutive slots in
    random page order (page 64: whole blocks consecutive; page 1: fully scattered)."""
    n_pages = slots // page
    order = torch.randperm(n_pages, generator=g)
    per = -(-rows // page)
    out = []
    for b in range(n_blocks):
        pages = order[b * per : (b + 1) * per]
        s = (pages[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:rows]
        out.append(s)
    return torch.stack(out)


# ------------------------------------------------------------------ layout and KV blocks
def test_bundle_layout_is_the_slab_layout():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        kv = _kv_buffers(dtype, n_layers=3, heads=(2, 3, 1), head_dim=(8, 5, 4), g=g)
        lay = build_layout(kv, [torch.zeros(2, 4, 3)])
        mine = kx.bundle_layout(kv)
        assert mine.block_bytes == lay.block_bytes and mine.slab_bytes == lay.slab_bytes
        for p in lay.planes:
            assert mine.offsets[p.buffer] == p.offset and mine.row_bytes[p.buffer] == p.row_bytes
        assert kx.from_slab_layout(lay, len(kv)) == mine


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_kv_blocks_to_staging_matches_loop_and_host_slabs(dtype, page):
    g = torch.Generator().manual_seed(page)
    kv = _kv_buffers(dtype, g=g)
    lay = build_layout(kv, [torch.zeros(2, 4, 3)])
    slots = _paged_blocks(5, page, 1024, g)
    slots[3] = slots[1]  # a gather may read the same blocks twice
    staging = torch.zeros(5, lay.slab_bytes, dtype=torch.uint8)
    moved = kx.kv_blocks_to_staging(kv, slots, staging, impl="reference")
    assert moved == 5 * lay.block_bytes
    want = torch.zeros_like(staging)
    kv_to_staging(kv, slots, want, lay.planes)
    assert torch.equal(staging, want)
    # The store's own copier writes the same bytes into host slabs: staging copies as-is.
    pool = HostSlabPool(16 * lay.slab_bytes, lay.slab_bytes, lay.image_bytes)
    mem = HostMemory(pool, pin=False)
    copier = SlabCopier(lay, mem, kv, [torch.zeros(2, 4, 3)])
    ids = pool.alloc(5)
    copier.blocks([BlockCopy(s, i) for s, i in zip(slots, ids)], to_host=True)
    for b, i in enumerate(ids):
        assert torch.equal(mem.slab(i)[: lay.block_bytes], staging[b, : lay.block_bytes])
    # ... and a staging row placed in a slab restores through the store's copier.
    fresh = [torch.zeros_like(t) for t in kv]
    back = SlabCopier(lay, mem, fresh, [torch.zeros(2, 4, 3)])
    back.blocks([BlockCopy(slots[0], ids[0])], to_host=False)
    for t, f in zip(kv, fresh):
        assert torch.equal(t[slots[0]], f[slots[0]])


@pytest.mark.parametrize("page", [1, 16, 64])
def test_staging_to_blocks_matches_loop_and_round_trips(page):
    g = torch.Generator().manual_seed(10 + page)
    kv = _kv_buffers(torch.float32, g=g)
    lay = kx.bundle_layout(kv)
    slots = _paged_blocks(4, page, 1024, g)
    # Random bytes, NaN and denormal patterns included: copies are bytes, never values.
    staging = torch.randint(0, 256, (4, lay.slab_bytes), generator=g, dtype=torch.uint8)
    got = [t.clone() for t in kv]
    want = [t.clone() for t in kv]
    kx.staging_to_kv_blocks(staging, got, slots, impl="reference")
    staging_to_kv(staging, want, slots, build_layout(kv, [torch.zeros(1, 1)]).planes)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    again = torch.zeros_like(staging)
    kx.kv_blocks_to_staging(got, slots, again, impl="reference")
    assert torch.equal(again[:, : lay.block_bytes], staging[:, : lay.block_bytes])
    assert not again[:, lay.block_bytes :].any()  # the slab's padding is never written


def test_tails_strided_buffers_and_a_slab_layout_argument():
    g = torch.Generator().manual_seed(3)
    # Buffers whose slots are not adjacent (row stride > row bytes), as views into a wider one.
    wide = [_rand((300, 4, 8), torch.bfloat16, g) for _ in range(2)]
    kv = [w[:, 1:3] for w in wide]
    lay = build_layout(kv, [torch.zeros(1, 1)])
    slots = torch.randperm(300, generator=g)[:40].reshape(2, 20)  # two 20-row tails
    staging = torch.zeros(2, lay.slab_bytes, dtype=torch.uint8)
    kx.kv_blocks_to_staging(kv, slots, staging, layout=lay, impl="reference")
    want = torch.zeros_like(staging)
    kv_to_staging(kv, slots, want, lay.planes)
    assert torch.equal(staging, want)
    back = [torch.zeros_like(w) for w in wide]
    kx.staging_to_kv_blocks(staging, [b[:, 1:3] for b in back], slots, impl="reference")
    for w, b in zip(wide, back):
        assert torch.equal(w[slots.reshape(-1), 1:3], b[slots.reshape(-1), 1:3])
        assert not b[:, 0].any() and not b[:, 3].any()


def test_kv_one_layer_at_a_time_fills_the_same_bundle():
    g = torch.Generator().manual_seed(4)
    kv = _kv_buffers(torch.bfloat16, n_layers=3, heads=(2, 3, 1), head_dim=(8, 5, 4), g=g)
    slots = _paged_blocks(3, 16, 1024, g)
    lay = kx.bundle_layout(kv)
    whole = torch.zeros(3, lay.slab_bytes, dtype=torch.uint8)
    kx.kv_blocks_to_staging(kv, slots, whole)
    parts = torch.zeros_like(whole)
    moved = [kx.kv_blocks_to_staging(kv, slots, parts, layers=[layer]) for layer in (2, 0, 1)]
    assert torch.equal(parts, whole) and sum(moved) == 3 * lay.block_bytes
    back = [torch.zeros_like(t) for t in kv]
    kx.staging_to_kv_blocks(whole, back, slots, layers=[1])  # only layer 1's K and V
    for b, (t, f) in enumerate(zip(kv, back)):
        assert torch.equal(t[slots.reshape(-1)], f[slots.reshape(-1)]) == (b % 3 == 1)


# --------------------------------------------------------------------------- state taps
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_state_taps_match_loop(src, dst):
    g = torch.Generator().manual_seed(7)
    b, nt, h, v, k = 1, 6, 2, 4, 8
    hs = [_rand((b, nt, h, v, k), src, g) for _ in range(3)]
    pool = _rand((4, 10, h, v, k), dst, g)
    taps = [(0, 3), (5, 0), (2, 9), (3, 4)]  # the pass start, the last chunk, any order
    layers = [2, 0, 3]
    got, want = pool.clone(), pool.clone()
    assert kx.gather_state_taps(hs, got, taps, layers=layers, impl="reference") == 12
    state_taps(hs, want, taps, layers)
    assert torch.equal(got, want)
    # The stacked-over-layers form and one layer at a time give the same bytes.
    stacked = pool.clone()
    kx.gather_state_taps(torch.stack(hs), stacked, torch.tensor(taps), layers=layers)
    assert torch.equal(stacked, want)
    single = pool.clone()
    for x, layer in zip(hs, layers):
        kx.gather_state_taps(x, single, [kx.StateTap(c, s) for c, s in taps], layers=[layer])
    assert torch.equal(single, want)


def test_state_taps_batch_of_two_and_chunk_helper():
    g = torch.Generator().manual_seed(8)
    hs = _rand((2, 3, 1, 2, 4), torch.bfloat16, g)  # B = 2 (non-varlen layout)
    pool = torch.zeros(1, 4, 1, 2, 4)
    kx.gather_state_taps(hs, pool, [(4, 1)])  # b = 1, i = 1
    assert torch.equal(pool[0, 1], hs[1, 1].float())
    # varlen: requests of 130 and 64 tokens -> chunks [0, 1, 2 | 3]
    assert kx.state_tap_chunks([130, 64], [0, 0, 1], [0, 128, 0]) == [0, 2, 3]
    with pytest.raises(kx.KernelArgError, match="multiple of 64"):
        kx.state_tap_chunks([130], [0], [130])


# ---------------------------------------------------------------------------- conv taps
CONV_DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
]


@pytest.mark.parametrize(("src", "dst"), CONV_DTYPES)
def test_conv_taps_match_loop_at_every_kind_of_position(src, dst):
    g = torch.Generator().manual_seed(5)
    w, d = 3, 6  # kernel 4
    lens = [9, 2, 5]  # the second request is shorter than kernel - 1
    n_tok = sum(lens)
    xs = [_rand((n_tok, d), src, g) for _ in range(2)]
    pool = _rand((3, 12, d, w), dst, g)
    incoming = [pool[1:2].squeeze(0).clone(), pool[0].clone()]  # saved before the pass
    spec = [  # (request, position, incoming row, destination slot)
        (0, 0, 1, 2),  # the pass start: the incoming state as it is
        (0, 1, 1, 3),  # within kernel-1 of the start: two columns incoming, one from the pass
        (0, 2, 1, 4),
        (0, 3, 1, 5),  # exactly kernel-1 in: all from the pass
        (0, 9, 1, 6),  # the request's last position
        (1, 0, 10, 7),  # a request shorter than kernel-1: every window reaches back
        (1, 1, 10, 8),
        (1, 2, 10, 9),
        (2, 5, -1, 11),  # the last position, no incoming state needed
    ]
    reqs, poss, ins, dsts = zip(*spec)
    taps = kx.conv_taps_for(lens, reqs, poss, ins, dsts)
    layers = [1, 0]
    got, want = pool.clone(), pool.clone()
    assert kx.gather_conv_taps(xs, got, taps, incoming, layers=layers, impl="reference") == 18
    conv_taps(xs, want, taps, incoming, layers)
    assert torch.equal(got, want)
    stacked = pool.clone()
    kx.gather_conv_taps(
        torch.stack(xs), stacked, torch.tensor(taps), torch.stack(incoming), layers=layers
    )
    assert torch.equal(stacked, want)


def test_conv_taps_reading_the_pool_itself_and_strided_inputs():
    g = torch.Generator().manual_seed(6)
    w, d = 3, 4
    proj = _rand((12, 3 * d), torch.bfloat16, g)
    x = proj[:, d : 2 * d]  # a column slice of a projection: token stride 3*d
    pool = _rand((2, 8, d, w), torch.bfloat16, g)
    taps = [(0, 12, 1, 2, 5), (0, 12, 7, -1, 6)]
    got, want = pool.clone(), pool.clone()
    kx.gather_conv_taps(x, got, taps, got[1:2], layers=[1])  # incoming = the live pool slot
    conv_taps([x], want, taps, [pool[1].clone()], [1])
    assert torch.equal(got, want)
    # A window-first pool ([slots, W, D] per layer) passes its transpose.
    wf = pool.transpose(-1, -2).contiguous()
    kx.gather_conv_taps(x, wf.transpose(-1, -2), taps, pool[1:2], layers=[1])
    assert torch.equal(wf.transpose(-1, -2)[1, 5:7], want[1, 5:7])


# ---------------------------------------------------------------------- torch operators
def test_registered_operators_run_the_reference_on_cpu():
    if not kx.extension_status()["torch_ops_registered"]:
        pytest.skip("CUDA library not built here: no torch operators registered")
    g = torch.Generator().manual_seed(9)
    kv = _kv_buffers(torch.bfloat16, g=g)
    slots = _paged_blocks(2, 16, 1024, g)
    lay = kx.bundle_layout(kv)
    a = torch.zeros(2, lay.slab_bytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    torch.ops.sgl_kernel_ext.kv_blocks_to_staging(kv, slots, a)
    kx.kv_blocks_to_staging(kv, slots, b, impl="reference")
    assert torch.equal(a, b)
    hs = [_rand((1, 3, 1, 2, 4), torch.bfloat16, g)]
    p1, p2 = torch.zeros(1, 3, 1, 2, 4), torch.zeros(1, 3, 1, 2, 4)
    torch.ops.sgl_kernel_ext.gather_state_taps(hs, p1, torch.tensor([[2, 1]]), [0])
    kx.gather_state_taps(hs, p2, [(2, 1)], impl="reference")
    assert torch.equal(p1, p2)
    with pytest.raises(kx.KernelArgError, match="duplicate destination slot"):
        torch.ops.sgl_kernel_ext.gather_state_taps(hs, p1, torch.tensor([[2, 1], [0, 1]]), [0])
