"""Every tensor the cache hands to SGLang's pools and allocators is on the pool's device (issue
#10), checked on the CPU by ``device_audit`` (a host-made tensor meeting a pool tensor raises, as
it would on a GPU), through SGLang's helpers and through its real Scheduler with the host tier.

The device-to-host reads each cache method makes are counted and bounded (docs/sglang-backend.md
lists them). Since issue #35 none of them waits for the device (the stream sanitizer,
``test_stream_sanitizer.py``, checks that under SGLang's overlap loop): a tail copy's fresh
pages are copied to the request's host row mirror asynchronously (counted here as a read), and a
checkpoint reads the request's state slot id from that mirror, or, where no batch was built
through SGLang (the helpers path here), from the device once per admission.
"""

from __future__ import annotations

import random

import pytest
import torch
from device_audit import DeviceAudit, HostTensorOnDevice, audit_cache_methods
from direct import Driver, build_pools, hybrid_cache

from sglang_hybrid.sglang.cache import HybridRadixCache

rng = random.Random(5)
MOST_READS = {"checkpoint": 1, "before_chunked_abort": 1, "prefix_device_indices": 1}


def check_reads(audit, must_run: tuple[str, ...] = ("match_prefix", "checkpoint", "evict")) -> None:
    ran = set(audit.most_reads)  # every audited call records its count, zero included
    assert set(must_run) <= ran, f"the workload never reached {set(must_run) - ran}"
    print(
        f"\ndevice->host reads: total {dict(audit.reads)}, most per call {dict(audit.most_reads)}"
    )
    over = {m: n for m, n in audit.most_reads.items() if n > MOST_READS.get(m, 0)}
    assert not over, f"cache methods reading device values beyond the documented ones: {over}"


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_device_discipline_audit_catches_a_host_tensor_freed_into_an_allocator() -> None:
    """The mechanism: what the backend used to free at an endpoint (``torch.tensor([old])``)
    and at a restore under pressure (slot ids decoded on the host) is refused; the same ids made
    on the pool's device pass."""
    pools = build_pools(page=1)
    mamba = pools.r2t.mamba_allocator
    got = mamba.alloc(2)
    with DeviceAudit(scope=(__file__,)) as audit:
        with pytest.raises(HostTensorOnDevice, match="cat"):
            mamba.free(torch.tensor([int(got[0])], dtype=torch.int64))
        mamba.free(torch.tensor([int(got[0])], dtype=torch.int64, device=torch.device("cpu")))
        slots = pools.alloc.alloc(8)
        with pytest.raises(HostTensorOnDevice):
            pools.alloc.free(torch.from_numpy(slots.numpy().copy()))
        pools.alloc.free(slots)
    assert audit.reads  # int() of a device tensor is a read, counted


@pytest.mark.parametrize("page", [1, 16, 64])
def test_device_discipline_helpers_path(page: int) -> None:
    """Repeats, tails, multi-turn endpoints (the state slot handed over, the displaced snapshot
    slot freed), an abort mid-prefill and eviction under pressure, through SGLang's helpers."""
    pools = build_pools(page=page, kv_tokens=4096, mamba=16)
    with audit_cache_methods(HybridRadixCache) as audit:
        cache = hybrid_cache(pools, chunk=256)
        d = Driver(cache, pools, chunk=256)
        base = toks(700)
        d.serve("a", base, max_new=40)
        d.serve("b", base, max_new=2)  # repeat: prompt-tail tap
        conv = base
        for t in range(4):  # multi-turn: endpoints, supersession, slot handover
            out = d.serve(f"c{t}", conv, max_new=30)
            conv = conv + out.output + toks(50)
        d.serve("x", toks(900), abort_after_chunks=2)
        for i in range(6):  # pressure: the pool is too small for all of it
            d.serve(f"p{i}", toks(900), max_new=20)
        d.check_idle()
    check_reads(audit)


@pytest.mark.parametrize("page", [1, 64])
def test_device_discipline_scheduler_host_tier(build, page: int) -> None:
    """Write-through, restores from the host (pages allocated and freed under pressure), the
    state image into the request's slot, prefetch for a blocked head, in SGLang's Scheduler."""
    with audit_cache_methods(HybridRadixCache) as audit:
        h = build(
            page=page,
            total=2048,
            running=2,
            mamba=8,
            chunk=256,
            opts={"host_cache_mib": 16, "device_snapshot_slots": 2},
        )
        prompt = toks(300)
        first = h.run(prompt, max_new=80)
        for _ in range(6):
            h.run(toks(500), max_new=70)
        r = h.run(prompt + list(first.output_ids) + toks(30), max_new=4)
        assert r.cached_tokens == len(prompt) + len(first.output_ids) - 1
        assert h.cache.host_tier.restored_bytes > 0
        for i in range(4):  # several at once: admissions wait for room, restore, release
            h.s.submit(f"w{i}", toks(600), 8)
        h.step_all()
    check_reads(audit, ("match_prefix", "checkpoint", "init_load_back", "prefetch_head"))
