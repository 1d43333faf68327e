"""A save at an orderly stop reads device-only slabs from the device (issue #38): the bytes
``persistence.DeviceSlabs`` produces for a block, a state image and a tail are the bytes the host
tier's write-through puts in its slabs, so a restarted server restores them as any host slab.

Real pools of SGLang's scheduler with the model worker (the KV and the states hold computed
values, not zeros); the comparison takes snapshots and blocks that have both copies.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from sched_args import scheduler_args

from sglang_hybrid.index.node import Residency
from sglang_hybrid.index.persist import (
    SOURCE_BLOCK,
    SOURCE_IMAGE,
    SOURCE_TAIL,
    SaveSource,
    export_for_save,
)
from sglang_hybrid.sglang.hints import checkpoint_envelope
from sglang_hybrid.sglang.persistence import DeviceSlabs

R = Residency


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def test_device_slabs_equal_what_the_host_tier_writes(make_scheduler, qwen3_next_dir: Path) -> None:
    args = scheduler_args("hybrid", chunk=128, opts={"host_cache_mib": 16})
    sched = make_scheduler(qwen3_next_dir, worker="model", **args)
    for seed in range(3):  # endpoints wherever they fall: snapshots with tails
        sched.submit(f"r{seed}", _ids(seed, 150 + 70 * seed), 1, kv_hints=checkpoint_envelope())
        sched.run_until_idle()
    cache = sched.tree_cache
    cache.host_tier.drain()
    index, memory, layout = cache.index, cache.host_tier.memory, cache.host_tier.layout
    both = [
        s
        for s in index.snapshots.values()
        if s.host_state is R.RESIDENT and s.device_state is R.RESIDENT
    ]
    assert any(s.tail for s in both), "the scenario needs a snapshot with a tail on both tiers"
    sources: dict[int, SaveSource] = {}
    want: dict[int, tuple[int, int]] = {}  # virtual id -> (host slab, rows: -1 = whole slab)
    for s in both:
        for k, slab in enumerate(s.host_slabs):
            sources[len(sources)] = SaveSource(SOURCE_IMAGE, s.device_slot, k, snapshot=s.id)
            want[len(want)] = (slab, -1)
        if s.tail and s.tail_device_state is R.RESIDENT and s.tail_host_state is R.RESIDENT:
            sources[len(sources)] = SaveSource(SOURCE_TAIL, s.tail_device, tokens=s.tail_len)
            want[len(want)] = (s.tail_host_slab, s.tail_len)
        node = s.anchor
        while not node.is_root:
            if node.host_state is R.RESIDENT and node.device_state is R.RESIDENT:
                sources[len(sources)] = SaveSource(SOURCE_BLOCK, node.device)
                want[len(want)] = (node.host_slab, 64)
            node = node.parent
    assert {src.what for src in sources.values()} == {SOURCE_BLOCK, SOURCE_IMAGE, SOURCE_TAIL}
    reader = DeviceSlabs(cache, sources)
    image_bytes = layout.image_bytes
    for i, (slab, rows) in want.items():
        got = torch.frombuffer(bytearray(reader.read(i)), dtype=torch.uint8)
        host = memory.slab(slab)
        if rows < 0:  # an image slab: the image's bytes in it (the last one is partly used)
            k = sources[i].part
            n = min(layout.slab_bytes, image_bytes - k * layout.slab_bytes)
            assert torch.equal(got[:n], host[:n]), (i, "image", k)
        else:  # KV rows: each plane's first ``rows`` rows
            for p in layout.planes:
                end = p.offset + rows * p.row_bytes
                assert torch.equal(got[p.offset : end], host[p.offset : end]), (i, p)
        assert got.any(), i  # computed values, not an all-zero pool
    # And a save's export names every such slab when the host copies are gone: its records
    # adopt like a host export (persistence writes their bytes through ``DeviceSlabs``).
    saved = export_for_save(index, index.host.n_slabs)
    assert len(saved.records.snapshots) == len(index.snapshots)
