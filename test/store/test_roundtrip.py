"""Device -> host -> device round trips are bit-exact (spec §11.2) on SGLang's real pools."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang"))

from direct import build_pools

from sglang_hybrid.index import HostSlabPool
from sglang_hybrid.store.device import DevicePools
from sglang_hybrid.store.host_memory import HostMemory
from sglang_hybrid.store.layout import build_layout
from sglang_hybrid.store.transfer import BlockCopy, SlabCopier, TransferBatch


def _setup(page: int, dtype: torch.dtype, chunk_bytes: int = 4 << 30):
    pools = build_pools(page, kv_tokens=2048, dtype=dtype)
    dev = DevicePools(pools.kv, pools.r2t.mamba_pool, "cpu")
    state = [*pools.r2t.mamba_pool.mamba_cache.conv, pools.r2t.mamba_pool.mamba_cache.temporal]
    layout = build_layout(dev.kv_buffers, state)
    slabs = HostSlabPool(
        64 * layout.slab_bytes, layout.slab_bytes, layout.image_bytes, chunk_bytes=chunk_bytes
    )
    mem = HostMemory(slabs, pin=False)
    return pools, dev, state, layout, slabs, SlabCopier(layout, mem, dev.kv_buffers, state)


def _fill_random(ts: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_and_images_round_trip_bit_exact(page: int, dtype: torch.dtype) -> None:
    pools, dev, state, layout, slabs, copier = _setup(page, dtype)
    assert (
        len(layout.planes) == 2 * len(pools.kv.full_kv_pool.k_buffer)
        and layout.slab_bytes % 4096 == 0
    )
    _fill_random(dev.kv_buffers + state, seed=page)
    # Three blocks: two on consecutive slots (one run), one scattered (page 1) or paged.
    perm = torch.randperm(1024, generator=torch.Generator().manual_seed(1))[:64] + 1024
    src = [
        torch.arange(64, 128),
        torch.arange(128, 192),
        perm if page == 1 else torch.arange(512, 576),
    ]
    dst_slabs = slabs.alloc(3)
    items = [BlockCopy(s, b) for s, b in zip(src, dst_slabs)]
    snap = [b.clone() for b in dev.kv_buffers]
    order = [
        ("state", 0),
        ("state", 1),
        ("state", 2),
        ("kv", 0),
        ("state", 3),
        ("state", 4),
        ("state", 5),
        ("kv", 1),
    ]
    batch = TransferBatch(copier, order)
    batch.add_blocks(items)
    img = slabs.alloc(layout.image_slabs)
    batch.add_image(5, img)
    moved = batch.run(to_host=True)
    assert moved == 3 * layout.block_bytes + layout.image_bytes
    want_state = [t[:, 5].clone() for t in state]
    # Restore into other slots and slot 9, then compare bytes.
    dst = [torch.arange(1100, 1164), torch.arange(1164, 1228), torch.arange(1300, 1364)]
    back = TransferBatch(copier, order)
    back.add_blocks([BlockCopy(d, b) for d, b in zip(dst, dst_slabs)])
    back.add_image(9, img)
    back.run(to_host=False)
    for buf, orig in zip(dev.kv_buffers, snap):
        for s, d in zip(src, dst):
            assert torch.equal(buf[d].view(torch.uint8), orig[s].view(torch.uint8))
    for t, w in zip(state, want_state):
        assert torch.equal(t[:, 9].view(torch.uint8), w.view(torch.uint8))


def test_tail_copies_only_its_rows() -> None:
    _, dev, _, _, slabs, copier = _setup(1, torch.float32)
    _fill_random(dev.kv_buffers, seed=4)
    slab = slabs.alloc(1)[0]
    src = torch.tensor([7, 300, 301, 50])  # 4 tail rows, scattered
    copier.blocks([BlockCopy(src, slab)], to_host=True)
    dst = torch.tensor([900, 901, 902, 903])
    before = [b[904].clone() for b in dev.kv_buffers]
    copier.blocks([BlockCopy(dst, slab)], to_host=False)
    for b, keep in zip(dev.kv_buffers, before):
        assert torch.equal(b[dst], b[src]) and torch.equal(b[904], keep)


def test_runs_never_cross_a_chunk() -> None:
    _, dev, state, layout, _, _ = _setup(1, torch.float32)
    # Three slabs per chunk: a run of four consecutive slabs must split at the chunk edge.
    slabs = HostSlabPool(
        12 * layout.slab_bytes,
        layout.slab_bytes,
        layout.image_bytes,
        chunk_bytes=3 * layout.slab_bytes,
    )
    mem = HostMemory(slabs, pin=False)
    copier = SlabCopier(layout, mem, dev.kv_buffers, state)
    _fill_random(dev.kv_buffers, seed=5)
    ids = slabs.alloc(4)
    assert [slabs.address(i).chunk for i in ids] == [0, 0, 0, 1]
    items = [BlockCopy(torch.arange(64 * k, 64 * k + 64), s) for k, s in enumerate(ids)]
    copier.blocks(items, to_host=True)
    out = [BlockCopy(torch.arange(1024 + 64 * k, 1088 + 64 * k), s) for k, s in enumerate(ids)]
    copier.blocks(out, to_host=False)
    for b in dev.kv_buffers:
        assert torch.equal(b[1024:1280], b[0:256])


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_blocks_write_the_same_slab_bytes_and_round_trip(page, dtype) -> None:
    """The staged path (``sgl_kernel_ext``: one gather into a slab-shaped staging buffer, one copy
    per slab run; here its torch references) leaves exactly the bytes the per-block path leaves,
    across a chunk edge, and restores bit-exactly layer by layer."""
    pytest.importorskip("sgl_kernel_ext")
    _, dev, state, layout, _, _ = _setup(page, dtype)
    slabs = HostSlabPool(
        12 * layout.slab_bytes,
        layout.slab_bytes,
        layout.image_bytes,
        chunk_bytes=3 * layout.slab_bytes,
    )
    mem_a, mem_b = HostMemory(slabs, pin=False), HostMemory(slabs, pin=False)
    plain = SlabCopier(layout, mem_a, dev.kv_buffers, state, staging="never")
    staged = SlabCopier(layout, mem_b, dev.kv_buffers, state, staging="always")
    assert staged.kx is not None and plain.kx is None
    _fill_random(dev.kv_buffers, seed=7)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(2))[:64] + 1024
    src = [
        torch.arange(0, 64),
        torch.arange(64, 128),
        perm if page == 1 else torch.arange(640, 704),
        torch.arange(192, 256),
    ]
    ids = slabs.alloc(4)  # chunks [0, 0, 0, 1]: two slab runs
    order = [("kv", 0), ("state", 0), ("kv", 1)]
    for copier in (plain, staged):
        b = TransferBatch(copier, order)
        b.add_blocks([BlockCopy(s, i) for s, i in zip(src, ids)])
        assert b.run(to_host=True) == 4 * layout.block_bytes
    for i in ids:
        assert torch.equal(mem_a.slab(i)[: layout.block_bytes], mem_b.slab(i)[: layout.block_bytes])
    dst = [torch.arange(1600 + 64 * k, 1664 + 64 * k) for k in range(4)]
    back = TransferBatch(staged, order)
    back.add_blocks([BlockCopy(d, i) for d, i in zip(dst, ids)])
    assert back.run(to_host=False) == 4 * layout.block_bytes
    for buf in dev.kv_buffers:
        for s, d in zip(src, dst):
            assert torch.equal(buf[d].view(torch.uint8), buf[s].view(torch.uint8))
