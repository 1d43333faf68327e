"""The CPU stream model (``sglang_hybrid.cpu.stream_model``, issue #35): its rules, and what it
finds in the cache under SGLang's overlap loop.

The first tests drive the model directly: each rule (a read not ordered after another stream's
write, a write over another stream's pending read, a free without ``record_stream``, a host sync
inside a budget, a host read of an asynchronous copy) fails where it should and passes once the
order CUDA requires is there. The scheduler tests run SGLang's real Scheduler with the overlap
loop under the model.

Defects 1 and 2 of the issue are caught on *preserved reproductions*: the functions as they were
before the fix (``DevicePools.copy_kv`` without a wait or ``record_stream``, a commit reading its
slot ids from the device, a copy-on-write source made from Python data, the inline copy queue
that never waited), installed over today's code for one scenario. The fix replaced those
functions, so running the scenario on today's code alone would not show that the model can see
the defect; keeping the old bodies here keeps each test meaningful after the fix (it fails if the
model stops catching them), and the same scenario on today's code must show no violation at all.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections import deque
from typing import Any

import pytest
import torch

from sglang_hybrid.cpu.stream_model import StreamModel, StreamViolation


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


# ==================================================================== the rules
def test_stream_sanitizer_orders_a_read_after_another_streams_write() -> None:
    with StreamModel() as m:
        a = torch.zeros(16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        a.add_(1)  # written on the default stream after the side stream's wait
        with (
            pytest.raises(StreamViolation, match=r"\[race\].*uses memory written on"),
            torch.cuda.stream(side),
        ):
            a * 2
        ev = torch.cuda.Event()
        ev.record()
        side.wait_event(ev)
        with torch.cuda.stream(side):
            b = a * 2  # ordered now
        # the host reads on the default stream, which is not ordered after the side stream
        with pytest.raises(StreamViolation, match="tolist"):
            b.tolist()
        side.synchronize()
        assert b.tolist() == [2.0] * 16
        assert m.residency(b) == "device"


def test_stream_sanitizer_orders_a_write_after_another_streams_read() -> None:
    with StreamModel():
        a = torch.zeros(16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a.sum()
        with pytest.raises(StreamViolation, match="may still be reading"):
            a.fill_(3)
        torch.cuda.current_stream().wait_stream(side)
        a.fill_(3)


def test_stream_sanitizer_tracks_the_slots_of_a_pool_buffer_apart() -> None:
    """Two streams on different slots of one pool buffer are not a race; on one slot they are
    (index ops are followed to the rows they select)."""
    with StreamModel():
        kv = torch.zeros(4096, 2, 16, device="cuda")
        state = torch.zeros(4, 256, 32, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        kv.index_copy_(0, torch.arange(8, device="cuda"), torch.ones(8, 2, 16, device="cuda"))
        state[:, 3] = 1.0
        with torch.cuda.stream(side):
            kv[100:164].sum()
            kv.index_select(0, torch.arange(200, 264, device="cuda"))
            state[:, 4].sum()
            with pytest.raises(StreamViolation, match="race"):
                kv.index_select(0, torch.tensor([7], device="cuda"))
            with pytest.raises(StreamViolation, match="race"):
                state.index_select(1, torch.tensor([3], device="cuda"))


def test_stream_sanitizer_catches_a_planted_missing_record_stream() -> None:
    """An index tensor made on one stream, read by a copy on another and dropped: the caching
    allocator hands its memory to the next allocation on its own stream while the copy may still
    read it. ``record_stream`` (or ordering the allocating stream after the read) fixes it."""

    def planted(record: bool, wait: bool) -> None:
        with StreamModel():
            buf = torch.zeros(4096, 2, 16, device="cuda")
            side = torch.cuda.Stream()
            idx = torch.arange(64, device="cuda")  # made on the default stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                buf.index_select(0, idx)
            if record:
                idx.record_stream(side)
            del idx
            gc.collect()
            if wait:
                torch.cuda.current_stream().wait_stream(side)
            torch.empty(64, device="cuda")  # the next allocation on the default stream

    with pytest.raises(StreamViolation, match=r"\[free\].*record_stream"):
        planted(record=False, wait=False)
    planted(record=True, wait=False)
    planted(record=False, wait=True)


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t[0].item(),
        lambda t: int(t[0]),
        lambda t: bool(t[0]),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: t.nonzero(),
        lambda t: t.to("cpu"),
        lambda t: torch.tensor([1, 2], device="cuda"),
        lambda t: t.copy_(torch.arange(16)),  # from pageable memory
        lambda t: torch.cuda.synchronize(),
    ],
)
def test_stream_sanitizer_fails_a_host_sync_inside_a_budget(sync) -> None:
    with StreamModel() as m:
        t = torch.arange(16, device="cuda")
        sync(t)  # outside a budget: counted, allowed
        with (
            pytest.raises(StreamViolation, match=r"\[host_sync\].*inside 'pass'"),
            m.budget("pass"),
        ):
            sync(t)


def test_stream_sanitizer_allows_what_never_waits_inside_a_budget() -> None:
    with StreamModel() as m, m.budget("pass"):
        t = torch.arange(16, device="cuda")
        host = torch.arange(16).pin_memory()
        t.copy_(host, non_blocking=True)  # from pinned memory
        back = t.to("cpu", non_blocking=True)  # into pinned memory
        t[3] = 7  # a Python scalar: a fill
        ev = torch.cuda.Event()
        ev.record()
        ev.query()
        assert m.residency(back) == "pinned"
    assert not m.budget_syncs()


def test_stream_sanitizer_orders_host_reads_of_asynchronous_copies() -> None:
    """A device-to-host copy into pinned memory has not landed when it returns: the host reads
    it only after an event, a stream synchronize or a query that answered done."""
    with StreamModel():
        t = torch.ones(16, device="cuda")
        back = t.to("cpu", non_blocking=True)
        with pytest.raises(StreamViolation, match="host"):
            back.numpy()
        ev = torch.cuda.Event()
        ev.record()
        assert not ev.query()  # work runs later than it is launched
        assert ev.query()
        assert back.numpy().sum() == 16
        with pytest.raises(StreamViolation, match="numpy"):
            t.numpy()  # an error on a GPU


def test_stream_sanitizer_residency_follows_how_code_names_its_device() -> None:
    """``device="cuda"`` is device memory (backed by the CPU), ``"cpu"`` written as a literal is
    host memory, pinned when asked; the backend's pools read as ``cuda:0`` under the model."""
    from sglang_hybrid.store.device import pool_device

    class Pool:
        device = "cpu"

    assert pool_device(Pool()) == torch.device("cpu")
    with StreamModel() as m:
        assert m.residency(torch.zeros(2, device="cuda")) == "device"
        assert m.residency(torch.zeros(2, device="cpu")) == "host"
        assert m.residency(torch.zeros(2, pin_memory=True)) == "pinned"
        assert pool_device(Pool()) == torch.device("cuda", 0)
        assert torch.cuda.Stream is m.cuda.Stream
    assert pool_device(Pool()) == torch.device("cpu")
    assert torch.cuda.Stream is not m.cuda.Stream


# ==================================================================== SGLang's overlap loop
def _tail_resume(h) -> Any:
    """A conversation whose second turn resumes from an endpoint inside a block (its tail is
    copied to the request's pages while the batch is built, on the forward stream), with a
    chunked prompt (checkpoints while a chunk is in flight) and a decode."""
    a = _prompt(1, 200)
    seq = a + list(h.run(a, max_new=80).output_ids)  # an endpoint at 280 or 281, inside a block
    return h.run(seq + _prompt(2, 300), max_new=6)


def _overlap(build, model: StreamModel, **kw: Any) -> Any:
    return build(
        chunk=128,
        opts={"tap_mode": "split", **kw.pop("opts", {})},
        disable_overlap_schedule=False,
        stream_model=model,
        **kw,
    )


def test_stream_sanitizer_runs_sglangs_overlap_loop_as_on_cuda(build) -> None:
    """Under the model the scheduler and the cache take their CUDA branches: two streams, the
    WAR barrier, the cache's copies on the forward stream, the host tier's copies on a stream
    queue. A resume with a tail copy and chunked checkpoints makes no race, no free without
    ``record_stream`` and no host sync in any per-pass entry point of the cache."""
    from sglang_hybrid.store.copy_queue import StreamQueue

    m = StreamModel(fail_on_sync=False)
    h = _overlap(build, m, opts={"host_cache_mib": 16})
    s = h.s.scheduler
    assert s.schedule_stream is not s.forward_stream and s._war_barrier_enabled
    assert h.cache.device.type == "cuda"
    r = _tail_resume(h)
    assert h.cache.pools.stream is s.forward_stream
    assert isinstance(h.cache.host_tier.queue, StreamQueue)
    assert r.cached_tokens % 64, "the second turn should resume inside a block (a tail copy)"
    assert m.budget_syncs() == {}, m.sync_sites


# ---------------------------------------------------------------- defect 1 (preserved)
def _copy_kv_before_35(self, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``DevicePools.copy_kv`` before the fix: on the forward stream, no wait for the schedule
    stream that made its indices, no ``record_stream``."""
    if not dst.numel():
        return
    with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
        dst, src = dst.to(self.device, torch.int64), src.to(self.device, torch.int64)
        for buf in self.kv_buffers:
            buf.index_copy_(0, dst, buf.index_select(0, src))


def _copy_kv_waiting_without_record(self, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Half the fix: the forward stream waits, but the indices are not kept for it."""
    if self.stream is not None:
        self.stream.wait_stream(torch.cuda.current_stream())
    _copy_kv_before_35(self, dst, src)


@pytest.mark.parametrize(
    ("copy_kv", "kind"),
    [(_copy_kv_before_35, "race"), (_copy_kv_waiting_without_record, "free")],
    ids=["no-wait", "no-record-stream"],
)
def test_stream_sanitizer_catches_defect_1(build, monkeypatch, copy_kv, kind: str) -> None:
    """A tail copy on the forward stream reading indices the schedule stream made: without the
    wait it reads them before they are written (race); without ``record_stream`` their memory
    goes to the next scheduling tensor while the copy may still read it (free)."""
    from sglang_hybrid.store.device import DevicePools

    monkeypatch.setattr(DevicePools, "copy_kv", copy_kv)
    h = _overlap(build, StreamModel(fail_on_sync=False))
    with pytest.raises(StreamViolation, match=rf"\[{kind}\]") as caught:
        _tail_resume(h)
    assert "forward stream" in str(caught.value)


# ---------------------------------------------------------------- defect 2 (preserved)
def _commit_slots_before_35(self, handle, lane, key, row, up_to) -> None:
    """The block commit before the fix: the slot ids read from the device row."""
    from sglang_hybrid.index import BLOCK_TOKENS
    from sglang_hybrid.store.handles import block_handles

    start, end = len(lane.path), up_to // BLOCK_TOKENS
    if end <= start:
        return
    host = row[BLOCK_TOKENS * start : BLOCK_TOKENS * end].to("cpu", torch.int32)
    handles = block_handles(host)
    self.cache.index.commit(lane, key, up_to, handles.__getitem__)


def _cow_source_before_35(self, req, source) -> bool:
    """The copy-on-write source before the fix: a device tensor made from Python data."""
    kv = req.kv
    if source is None:
        return self._prepare_state_slot_today(req, source)
    if not kv.holds_mamba:
        dst = self.mamba_allocator.alloc(1)
        if dst is None:
            return False
        kv.mamba_pool_idx = dst[0]
    kv.mamba_needs_clear = False
    kv.mamba_cow_src_index = torch.tensor(
        [self.slot_id(source.device_slot)], dtype=torch.int64, device=self.device
    )
    return True


@pytest.mark.parametrize("where", ["checkpoint", "match_prefix"])
def test_stream_sanitizer_catches_defect_2(build, monkeypatch, where: str) -> None:
    """Host syncs inside the cache's per-pass entry points: a commit reading its slot ids from
    the device, a copy-on-write source made from Python data. Under overlap scheduling each
    waits for the prefill in flight."""
    from sglang_hybrid.sglang.cache import HybridRadixCache
    from sglang_hybrid.sglang.publish import Publisher

    if where == "checkpoint":
        monkeypatch.setattr(Publisher, "_commit", _commit_slots_before_35)
    else:
        today = HybridRadixCache._prepare_state_slot
        monkeypatch.setattr(HybridRadixCache, "_prepare_state_slot_today", today, raising=False)
        monkeypatch.setattr(HybridRadixCache, "_prepare_state_slot", _cow_source_before_35)
    h = _overlap(build, StreamModel())
    with pytest.raises(StreamViolation, match=rf"\[host_sync\].*inside '{where}'"):
        _tail_resume(h)


# ---------------------------------------------------------------- defect 3 (preserved)
class _InlineQueueBefore35:
    """``InlineQueue`` before the fix: runs each operation on the caller's stream and calls it
    done; ``wait`` does nothing."""

    synchronous = True

    def __init__(self) -> None:
        self._done: deque = deque()

    def issue(self, op) -> None:
        self._done.append(op())

    def finished(self) -> int:
        return len(self._done)

    def retire(self, k: int) -> list:
        return [self._done.popleft() for _ in range(k)]

    def wait(self, k: int) -> None:
        return None

    def order_after(self, stream) -> None:
        return None

    def close(self) -> None:
        return None

    def __len__(self) -> int:
        return len(self._done)


@pytest.mark.parametrize("before_fix", [True, False], ids=["before-fix", "today"])
def test_stream_sanitizer_catches_defect_3(build, before_fix: bool) -> None:
    """``--hybrid-host-copy inline`` with a cache file: the save drains the host tier and reads
    the pinned slabs. Before the fix the inline queue ran each copy on the caller's stream with
    nothing ordering it after the forward (under the overlap loop the write-through's read of the
    KV rows raced the forward's write of them) and reported device-to-host copies done when they
    were launched (the save's read of the slabs raced the copies); the model stops at the first
    of the two. Today each operation is ordered after the forward and waited for."""
    m = StreamModel(fail_on_sync=False)
    h = _overlap(build, m, opts={"host_cache_mib": 16, "host_copy": "inline"})
    host = h.cache.host_tier
    if before_fix:
        host.queue = _InlineQueueBefore35()
    a = _prompt(3, 300)

    def run_and_save() -> None:
        h.run(a, max_new=8)  # write-through at release: device -> pinned slabs
        assert host.written_bytes > 0
        host.drain()  # what persistence.save does (persistence.py): drain, then read
        for chunk in host.memory.chunks:
            chunk.numpy()

    if before_fix:
        with pytest.raises(StreamViolation, match=r"\[race\]"):
            run_and_save()
    else:
        run_and_save()
