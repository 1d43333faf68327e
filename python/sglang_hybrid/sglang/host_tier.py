"""The host tier under ``--radix-cache hybrid`` (spec §5.4, §6.4-6.6, §7.6, §9.3, §11.1).

The index decides (which slabs, which victims, what is dead); ``store/`` moves the bytes; this
module joins them to SGLang's pools and keeps every copy off the scheduler thread: the thread
*issues* an operation onto one FIFO copy queue (``store/copy_queue.py``: a CUDA stream, a worker
thread on the CPU) and *polls* it once per scheduler iteration (``poll``), never waits for it.

- write-through: a lane's device-only blocks go to host in one operation when it releases them,
  a snapshot's image (and tail) as soon as it is published. The lane stays open (its path
  pinned, nothing on it evictable) and the snapshot pinned (its slot kept) until their copies
  have retired. Bytes in flight are bounded (``--hybrid-host-write-mib``): beyond the bound an
  operation waits in a backlog, still unissued; under device pressure the backlog is shed
  (``shed``: the blocks stay device-only and evictable), so no decode waits for a write.
- restore: host-only blocks, tail and image of the source SGLang's admission accepted land in
  freshly allocated device pages and the request's own state slot; the destinations are Filling
  and the request is held out of admission passes (``holding``) until the operation retires.
- prefetch for a blocked FIFO head (§6.6): its host-only path blocks, into spare device pages.

Ranks agree (issue #10): each TP rank polls its own queue, and the number of operations retired
is the MIN over the TP group (one all-reduce on the group's CPU group, only while operations are
in flight, which every rank knows alike), as SGLang's HiCache does for its write-backs.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..index import BLOCK_TOKENS, BlockNode, Lane, PrefixIndex, Snapshot
from ..index.node import FastResidency
from ..store.copy_queue import CopyMode, ThreadQueue, make_queue
from ..store.device import DevicePools, DeviceSlots
from ..store.host_memory import HostMemory
from ..store.layout import SlabLayout
from ..store.transfer import BlockCopy, SlabCopier, TransferBatch
from .host_ops import Counters, HostUsage, Op, PendingRestore, block_copies, host_or_device
from .pages import alloc_evicting, ceil_to, free_dropped
from .skips import Skips

logger = logging.getLogger(__name__)
R = FastResidency  # Residency, read faster (index/node.py)
PREFETCH_BLOCKS = 256


class HostTier:
    def __init__(
        self,
        index: PrefixIndex,
        layout: SlabLayout,
        pools: DevicePools,
        allocator: Any,
        state_tensors: list[torch.Tensor],
        forward_order: list[tuple[str, int]],
        page_size: int,
        skips: Skips,
        *,
        copy_mode: CopyMode = "async",
        write_limit_bytes: int = 512 << 20,
        group: Any = None,
    ) -> None:
        assert index.host is not None
        self.index = index
        self.layout = layout
        self.pools = pools
        self.allocator = allocator
        self.page_size = page_size
        # Pinned when the pools are on a GPU (copies overlap compute; async device-to-host).
        self.memory = HostMemory(index.host, pin=pools.device.type == "cuda")
        self.queue = make_queue(copy_mode, pools.device)
        # A copy worker thread (the CPU's asynchronous queue) re-takes the GIL after every torch
        # call: it gathers blocks through one staging buffer (sgl_kernel_ext's torch reference,
        # two calls per plane) rather than per block and plane.
        staging = "always" if isinstance(self.queue, ThreadQueue) else "auto"
        self.copier = SlabCopier(
            layout, self.memory, pools.kv_buffers, state_tensors, staging=staging
        )
        self.order = forward_order
        self.skips = skips
        self.write_limit = max(0, write_limit_bytes)
        self.group = group
        self.world = 1
        if group is not None:
            import torch.distributed as dist

            self.world = dist.get_world_size(group)
        self.ops: deque[Op] = deque()  # issued, in queue order
        self.backlog: deque[Op] = deque()  # write-through beyond the bound, not yet issued
        self.write_bytes = 0  # write-through bytes issued and not yet retired
        self.restores: dict[str, PendingRestore] = {}  # rid -> restore of a waiting request
        self._holds: dict[int, int] = {}  # lane id -> operations keeping it open
        self._closing: dict[int, Lane] = {}  # lanes released once their operations retire
        self.c = Counters()
        self.l3: Any = None  # ``--hybrid-l3``: told what landed (``l3_tier.py``)

    # ---------------------------------------------------------------- counters (stats())
    @property
    def written_bytes(self) -> int:
        return self.c.written_bytes

    @property
    def restored_bytes(self) -> int:
        return self.c.restored_bytes

    @property
    def restored_blocks(self) -> int:
        return self.c.restored_blocks

    @property
    def prefetched_blocks(self) -> int:
        return self.c.prefetched_blocks

    # ================================================================ the queue
    def _submit(self, op: Op) -> None:
        for lane in op.lanes:
            self._holds[lane.id] = self._holds.get(lane.id, 0) + 1
        if op.write_bytes and (self.backlog or not self._fits(op.write_bytes)):
            self.backlog.append(op)  # the oldest write waits, never the scheduler
            self.c.backlogged += 1
            return
        self._issue(op)

    def _fits(self, nbytes: int) -> bool:
        """Within the write-through bound (one operation alone always fits)."""
        return not self.write_bytes or self.write_bytes + nbytes <= self.write_limit

    def _issue(self, op: Op) -> None:
        self.ops.append(op)
        self.write_bytes += op.write_bytes
        self.c.peak_write_bytes = max(self.c.peak_write_bytes, self.write_bytes)
        self.c.ops_issued += 1
        self.queue.issue(op.run)
        if self.queue.synchronous:
            self._retire(len(self.ops))

    def poll(self) -> int:
        """Retire the operations every rank has finished; issue backlog the bound now allows;
        with an exclusive host, demote what the next pass may evict (``demote``). Called once
        per scheduler iteration (before the batch is chosen). Returns retired."""
        k = 0
        if self.ops:
            k = self._agree(self.queue.finished())
            if k:
                self._retire(k)
        if self.index.config.host_exclusive:
            self.demote()
        return k

    def _agree(self, k: int) -> int:
        """The MIN of ``k`` over the TP group: what every rank has finished."""
        if self.world <= 1:
            return k
        import torch.distributed as dist

        t = torch.tensor([k], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0])

    def _retire(self, k: int) -> None:
        results = self.queue.retire(k)
        for res in results:
            op = self.ops.popleft()
            self.write_bytes -= op.write_bytes
            if isinstance(res, BaseException):
                op.failed(res)
            else:
                op.done(res)
            self._unhold(op.lanes)
        while self.backlog and self._fits(self.backlog[0].write_bytes):
            self._issue(self.backlog.popleft())
        self._free(self.index.drain_freed_device())

    def wait_for(self, pending: PendingRestore) -> None:
        """Block until ``pending`` retired: an abort of its request, or SGLang matching it while
        it should have been held. Every rank blocks at the same point and retires the same
        operations (up to this one), so ranks stay in step."""
        while not (pending.done or pending.failed):
            pos = next(i for i, op in enumerate(self.ops) if op.kind == "restore:" + pending.rid)
            self.queue.wait(pos + 1)
            self._retire(pos + 1)

    def rebind(self, index: PrefixIndex) -> None:
        """A cache reset: the same host memory serves a fresh index. Everything in flight is
        finished first, so nothing lands in the old index's slabs afterwards."""
        if index.host is None:
            raise ValueError("a host tier needs an index with a host slab pool")
        self.drain()
        self.restores.clear()
        self.index = index
        self.memory.rebind(index.host)

    def drain(self) -> None:
        """Issue the backlog and wait for every operation (flush, orderly stop, tests)."""
        while self.ops or self.backlog:
            if not self.ops:
                self._issue(self.backlog.popleft())
                continue
            self.queue.wait(len(self.ops))
            self._retire(len(self.ops))

    def shed(self) -> int:
        """Device pressure: drop the write-through backlog (never issued; the blocks stay
        device-only and become evictable). Returns operations shed."""
        n = len(self.backlog)
        while self.backlog:
            op = self.backlog.popleft()
            op.failed(RuntimeError("shed under device pressure"))
            self._unhold(op.lanes)
        self.c.shed += n
        return n

    def close(self) -> None:
        self.drain()
        self.queue.close()

    def order_after(self, stream: Any) -> None:
        """Copies issued from now on wait (on the device) for ``stream``'s queued work too."""
        self.queue.order_after(stream)

    # ================================================================ lanes
    def release_lane(self, lane: Lane) -> None:
        """Write the lane's blocks through (§7.6), then release it once nothing copies from it."""
        self.write_lane(lane)
        if self._holds.get(lane.id):
            self._closing[lane.id] = lane
        else:
            self.index.release(lane)

    def _unhold(self, lanes: tuple[Lane, ...]) -> None:
        for lane in lanes:
            left = self._holds[lane.id] - 1
            if left:
                self._holds[lane.id] = left
                continue
            del self._holds[lane.id]
            closing = self._closing.pop(lane.id, None)
            if closing is not None:
                self.index.release(closing)

    # ================================================================ write-through
    def write_lane(self, lane: Lane) -> int:
        """Issue the lane's device-only blocks to host in one operation; returns bytes issued.

        A failed copy leaves the blocks device-only (their slabs go back): write-through is an
        optimisation, never a reason to fail the request that released them.
        """
        planned = self.index.transfers.plan_writes(lane)
        if not planned:
            return 0

        def done() -> None:
            self.index.transfers.complete_writes(planned)
            if self.l3 is not None:
                self.l3.wrote_blocks(planned)

        return self._write_blocks(
            planned, done, self.index.transfers.abort_writes, "blocks", (lane,), "write"
        )

    def demote(self) -> int:
        """Write the unbacked blocks next in the device's eviction order to host, so that the
        next pass evicts them as bookkeeping (``index/demotion.py``); returns bytes issued.

        The blocks are out of the LRU while their copy is in flight (host Filling), so their
        pages are not freed under it; one deleted meanwhile with its subtree frees them, and its
        copy's bytes land in a slab nobody reads. A demotion counts against the write-through
        bound and is shed with it under device pressure, as a failed copy is given back."""
        planned_at = self.index.tick  # a block hit after this returns to the MRU end
        planned = self.index.transfers.plan_demotions()
        # Making room may have deleted a subtree whose host copy was its last (§9.4): its
        # device pages go back to SGLang now, not at the next eviction.
        self._free(self.index.drain_freed_device())
        if not planned:
            return 0
        t = self.index.transfers
        return self._write_blocks(
            planned,
            lambda: t.complete_demotions(planned, planned_at),
            lambda p: t.abort_demotions(p, planned_at),
            "demoted blocks",
            (),
            "demote",
        )

    def _write_blocks(
        self,
        planned: list[tuple[BlockNode, int]],
        landed: Callable[[], None],
        abort: Callable[[list[tuple[BlockNode, int]]], None],
        what: str,
        lanes: tuple[Lane, ...],
        kind: str,
    ) -> int:
        """One operation copying ``planned`` blocks (device handle -> host slab) to the host."""
        # Handles are immutable bytes and the pages stay put (a lane's pins, or a demotion's
        # Filling host copy): the copy list is built on the copy worker, not here.
        handles = [n.device for n, _ in planned]
        slabs = [slab for _, slab in planned]
        nbytes = len(planned) * self.layout.block_bytes

        def done(moved: int) -> None:
            landed()
            self.c.written_bytes += moved
            if kind == "demote":
                self.c.demoted_bytes += moved

        def failed(exc: BaseException) -> None:
            abort(planned)
            self.skips.note("write_through_failed", f"{len(planned)} {what}: {exc}")

        run = lambda: self._run(block_copies(handles, slabs), to_host=True)  # noqa: E731
        self._submit(Op(run, done, failed, nbytes, lanes, kind))
        return nbytes

    def write_snapshot(self, s: Snapshot, state_slot: int, lane: Lane | None = None) -> int:
        """Issue a just-published snapshot's image (and tail); skipped when GDSF refuses (§9.3).
        ``s`` stays pinned and ``lane`` (whose path anchors it) open until the copy retires.

        With a shared L3 the lane's committed blocks are written first (``write_lane``, the
        blocks the snapshot anchors on among them), not only at release as §7.6 batches them:
        another server can resume from the snapshot only once its blocks are in the store too,
        and at release they reached it after the request's last token, when a fleet's next turn
        on another server had often looked already (``docs/l3.md``, "What moves, when"). Same
        blocks, same bytes, in one batch per published snapshot; release writes what is left.
        """
        early = 0
        if self.l3 is not None and lane is not None and not lane.closed:
            early = self.write_lane(lane)
        plan = self.index.transfers.plan_image_write(s)
        if plan is None:
            return early
        slabs, tail_slab = plan
        tail = None
        if tail_slab >= 0:  # host slot ids, or device ones used as indices (store.transfer)
            tail = BlockCopy(host_or_device(s.tail_device)[: s.tail_len], tail_slab)
        nbytes = self.layout.image_bytes + (self.layout.block_bytes if tail is not None else 0)

        def done(moved: int) -> None:
            self.index.transfers.complete_image_write(s)
            self.c.written_bytes += moved
            if self.l3 is not None:
                self.l3.wrote_snapshot(s)

        def failed(exc: BaseException) -> None:
            self.index.transfers.abort_image_write(s)
            self.skips.note("write_through_failed", f"snapshot {s.id}: {exc}")

        run = lambda: self._run([], to_host=True, image=(state_slot, slabs), tail=tail)  # noqa: E731
        lanes = (lane,) if lane is not None and not lane.closed else ()
        self._submit(Op(run, done, failed, nbytes, lanes))
        return early + nbytes

    def _run(
        self,
        blocks: list[BlockCopy],
        *,
        to_host: bool,
        image: tuple[int | torch.Tensor, Any] | None = None,
        tail: BlockCopy | None = None,
    ) -> int:
        """One operation's copies in forward order, on the queue's stream or thread."""
        batch = TransferBatch(self.copier, self.order)
        batch.add_blocks(blocks)
        if tail is not None:
            batch.add_tail(tail)
        if image is not None:
            batch.add_image(*image)
        return batch.run(to_host=to_host)

    # ================================================================ restore
    def restore(
        self,
        rid: str,
        handle: Any,
        lane: Lane,
        source: Snapshot,
        state_slot: torch.Tensor | None,
        staging: torch.Tensor | None = None,
    ) -> PendingRestore | None:
        """Issue the restore of ``source``'s host-only path blocks, tail and image (§6.4-6.5).

        ``lane`` (the handle's, opened by the caller) pins the path. Destinations are fresh
        device pages (blocks and tail) and ``state_slot`` (the image: the request's own slot
        inline, the ``staging`` slot the caller allocated when asynchronous; a one-element device
        index, never read on the host). None: no room for the pages even after evicting (nothing
        was touched). Otherwise the restore is
        tracked in ``restores`` until it retires: ``done``, or ``failed`` (every destination
        handed back; the request resumes from a device source or recomputes). With the inline
        queue it has retired when this returns.
        """
        path = lane.path
        missing = [n for n in path if n.device_state is R.ABSENT]
        tail_missing = bool(source.tail) and source.tail_device_state is R.ABSENT
        tail_tokens = ceil_to(source.tail_len, self.page_size)
        need = BLOCK_TOKENS * len(missing) + (tail_tokens if tail_missing else 0)
        dst = self._alloc(need) if need else None
        if need and dst is None:
            self.skips.note("restore_abandoned", f"no room for {need} device tokens")
            return None
        # The pages' slot ids stay on the device (handles and copy indices alike): reading
        # them would wait for the device (issue #35).
        items = self._begin_fills(missing, dst)
        tail = None
        if tail_missing:
            assert dst is not None  # tail_missing makes need > 0: dst was allocated above
            slots = dst[BLOCK_TOKENS * len(missing) :]
            self.index.transfers.begin_tail_fill(source, DeviceSlots(slots), tail_tokens)
            tail = BlockCopy(slots[: source.tail_len], source.tail_host_slab)
        image = None
        if not source.image_on_device:
            assert state_slot is not None, "a host-only image needs the lane's state slot"
            image = (state_slot, source.host_slabs)
        tokens = BLOCK_TOKENS * len(missing) + (source.tail_len if tail_missing else 0)
        pending = PendingRestore(
            rid, handle, tokens=tokens, image_on_device=image is None, staging=staging
        )

        def done(moved: int) -> None:
            for node in missing:
                self.index.transfers.finish_node_fill(node)
            if tail_missing:
                self.index.transfers.finish_tail_fill(source)
            self.c.restored_bytes += moved
            self.c.restored_blocks += len(missing)
            pending.nbytes, pending.done = moved, True

        def failed(exc: BaseException) -> None:  # the request recomputes instead (issue #11)
            for node in missing:
                self.index.transfers.abort_node_fill(node)
            if tail_missing:
                self.index.transfers.abort_tail_fill(source)
            # The lane maps blocks that have no device copy now: it goes at once, not when the
            # request is next matched (the handle's close then finds it closed).
            self.index.release(lane)
            self.skips.note("restore_abandoned", f"copy failed: {exc}")
            pending.failed = True

        run = lambda: self._run(items, to_host=False, image=image, tail=tail)  # noqa: E731
        self.restores[rid] = pending
        self._submit(Op(run, done, failed, kind="restore:" + rid))
        return pending

    def _begin_fills(self, nodes: list[BlockNode], slots: torch.Tensor | None) -> list[BlockCopy]:
        """Mark ``nodes`` Filling into consecutive 64-slot rows of ``slots`` (fresh device
        pages: their handles stay on the device); their copies."""
        if not nodes:
            return []
        assert slots is not None
        rows = slots[: BLOCK_TOKENS * len(nodes)].view(len(nodes), BLOCK_TOKENS)
        items = []
        for i, node in enumerate(nodes):
            self.index.transfers.begin_node_fill(node, DeviceSlots(rows[i]))
            items.append(BlockCopy(rows[i], node.host_slab))
        return items

    @property
    def filling(self) -> bool:
        """A restore or prefetch is landing: some device copies are Filling."""
        return any(op.kind not in ("write", "demote") for op in self.ops)

    def restoring(self) -> set[str]:
        """Request ids whose own restore has not retired."""
        return {rid for rid, p in self.restores.items() if not (p.done or p.failed)}

    def _alloc(self, tokens: int, *, backed_only: bool = False) -> torch.Tensor | None:
        """``tokens`` device slots, evicting cached blocks for them (never a pinned path)."""

        def make_room(n: int) -> None:
            self.index.evict_device(n, backed_only=backed_only)
            self._free(self.index.drain_freed_device())

        out = alloc_evicting(self.allocator, tokens, make_room)
        return out.to(torch.int64) if out is not None else None

    def _free(self, dropped: list[tuple[object, int]]) -> None:
        free_dropped(self.allocator, dropped, self.pools.device)

    # ================================================================ prefetch (§6.6)
    def prefetch(
        self, path: list[BlockNode], source: Snapshot | None, *, limit_tokens: int | None = None
    ) -> int:
        """Issue copies of up to 256 host-only blocks of a blocked head's path into spare pages.

        Pages come from the free pool and from host-backed cached blocks (never a last copy);
        the blocks join the device LRU when the copy retires. Returns blocks issued.
        """
        if source is None:
            return 0
        k = source.frontier // BLOCK_TOKENS
        missing = [n for n in path[:k] if n.device_state is R.ABSENT][:PREFETCH_BLOCKS]
        if not missing:
            return 0
        held = path[:k]
        self.index.transfers.pin_for_prefetch(held)  # the head's path stays put meanwhile
        room = self.allocator.available_size() + self._backed_evictable()
        if limit_tokens is not None:
            room = min(room, limit_tokens)
        count = min(len(missing), room // BLOCK_TOKENS)
        dst = self._alloc(count * BLOCK_TOKENS, backed_only=True) if count > 0 else None
        if dst is None:
            self.index.transfers.unpin_for_prefetch(held)
            return 0
        chosen = missing[:count]
        items = self._begin_fills(chosen, dst)

        def done(moved: int) -> None:
            for node in chosen:
                self.index.transfers.finish_node_fill(node)
            self.index.transfers.unpin_for_prefetch(held)
            self.c.restored_bytes += moved
            self.c.prefetched_blocks += count

        def failed(exc: BaseException) -> None:
            for node in chosen:
                self.index.transfers.abort_node_fill(node)
            self.index.transfers.unpin_for_prefetch(held)
            self.skips.note("restore_abandoned", f"prefetch copy failed: {exc}")

        run = lambda: self._run(items, to_host=False)  # noqa: E731
        self._submit(Op(run, done, failed, kind="prefetch"))
        return count

    def _backed_evictable(self) -> int:
        return self.index.lru.backed_tokens

    # ================================================================ stats
    def usage(self) -> HostUsage:
        host = self.index.host
        assert host is not None
        sb = host.slab_bytes
        image = sum(
            len(s.host_slabs) + (1 if s.tail_host_slab >= 0 else 0)
            for s in self.index.snapshots.values()
        )
        return HostUsage((host.used - image) * sb, image * sb, host.free * sb)

    def queue_stats(self) -> dict[str, int]:
        return {
            "host_ops_issued": self.c.ops_issued,
            "host_ops_in_flight": len(self.ops),
            "host_write_backlogged": self.c.backlogged,
            "host_write_shed": self.c.shed,
            "host_write_peak_bytes": self.c.peak_write_bytes,
            "host_demoted_bytes": self.c.demoted_bytes,
        }
