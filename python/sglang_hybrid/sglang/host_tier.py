"""The host tier under ``--radix-cache hybrid`` (spec §5.4, §6.4-6.6, §7.6, §9.3).

The index decides (which slabs, which victims, what is dead); ``store/`` moves the bytes; this
module joins them to SGLang's pools:

- write-through: a lane's device-only blocks go to host in one batch when it releases them, and
  a snapshot's image (and tail) as soon as it is published; both through GDSF-bounded host
  eviction in the index;
- restore: when admission picks a source with host-only parts, those blocks and the tail land in
  freshly allocated device pages and the image in the lane's own state slot, in forward order
  (prelude, then layer by layer), marked Filling until the copies retire;
- prefetch for a blocked FIFO head (§6.6): its host-only path blocks are copied into device pages
  taken from the free pool and from host-backed cached blocks, never from a last copy;
- stats: host bytes held by KV vs images, bytes restored.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..index import BLOCK_TOKENS, BlockNode, PrefixIndex, Residency, Snapshot
from ..store.device import DevicePools, handle_to_slots, slots_to_handle
from ..store.host_memory import HostMemory
from ..store.layout import SlabLayout
from ..store.transfer import BlockCopy, SlabCopier, TransferBatch
from .pages import alloc_evicting, free_dropped
from .skips import Skips

logger = logging.getLogger(__name__)
R = Residency
PREFETCH_BLOCKS = 256


class Restored(NamedTuple):
    nbytes: int
    tokens: int  # prefix tokens whose KV came back from the host


class RestoreFailed(RuntimeError):
    """A restore copy failed; its destinations were handed back (nothing stays Filling)."""


class HostUsage(NamedTuple):
    kv_bytes: int
    image_bytes: int
    free_bytes: int


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
    ) -> None:
        assert index.host is not None
        self.index = index
        self.layout = layout
        self.pools = pools
        self.allocator = allocator
        self.page_size = page_size
        self.memory = HostMemory(index.host)
        self.copier = SlabCopier(layout, self.memory, pools.kv_buffers, state_tensors)
        self.order = forward_order
        self.skips = skips
        self.written_bytes = 0
        self.restored_bytes = 0
        self.restored_blocks = 0
        self.prefetched_blocks = 0

    # ================================================================ write-through
    def write_lane(self, lane: Any) -> int:
        """The lane's device-only blocks, in one batch, before they become evictable (§7.6).

        A failed copy leaves the blocks device-only (their slabs go back): write-through is an
        optimisation, never a reason to fail the request that released them.
        """
        planned = self.index.plan_writes(lane)
        if not planned:
            return 0
        items = [BlockCopy(handle_to_slots(n.device, "cpu"), slab) for n, slab in planned]  # type: ignore[arg-type]
        try:
            moved = self._run(items, to_host=True)
        except Exception as exc:  # any copy error: keep serving (issue #11)
            self.index.abort_writes(planned)
            self.skips.note("write_through_failed", f"{len(planned)} blocks: {exc}")
            return 0
        self.index.complete_writes(planned)
        self.written_bytes += moved
        return moved

    def write_snapshot(self, s: Snapshot, state_slot: int) -> int:
        """Image (and tail) of a just-published snapshot; skipped when GDSF refuses (§9.3)."""
        plan = self.index.plan_image_write(s)
        if plan is None:
            return 0
        slabs, tail_slab = plan
        tail = None
        if tail_slab >= 0:
            tail = BlockCopy(handle_to_slots(s.tail_device, "cpu")[: s.tail_len], tail_slab)  # type: ignore[arg-type]
        try:
            moved = self._run([], to_host=True, image=(state_slot, slabs), tail=tail)
        except Exception as exc:
            self.index.abort_image_write(s)
            self.skips.note("write_through_failed", f"snapshot {s.id}: {exc}")
            return 0
        self.index.complete_image_write(s)
        self.written_bytes += moved
        return moved

    def _run(
        self,
        blocks: list[BlockCopy],
        *,
        to_host: bool,
        image: tuple[int, Any] | None = None,
        tail: BlockCopy | None = None,
    ) -> int:
        """One batch in forward order, waited for (the copies are synchronous; issue #13)."""
        batch = TransferBatch(self.copier, self.order)
        batch.add_blocks(blocks)
        if tail is not None:
            batch.add_tail(tail)
        if image is not None:
            batch.add_image(*image)
        moved = batch.run(to_host=to_host)
        batch.synchronize()
        return moved

    # ================================================================ restore
    def restore(
        self, path: list[BlockNode], source: Snapshot, state_slot: int | None
    ) -> Restored | None:
        """Host-only path blocks, tail and image of ``source`` back on the device (§6.4-6.5).

        ``path`` is pinned by the caller's lane. Destinations are fresh device pages (blocks and
        tail) and the lane's own state slot (the image). None: no room for the pages even after
        evicting (nothing was touched). :class:`RestoreFailed`: a copy failed; every destination
        was handed back and the caller resumes from a device source or recomputes.
        """
        missing = [n for n in path if n.device_state is R.ABSENT]
        tail_missing = bool(source.tail) and source.tail_device_state is R.ABSENT
        tail_tokens = -(-source.tail_len // self.page_size) * self.page_size
        need = BLOCK_TOKENS * len(missing) + (tail_tokens if tail_missing else 0)
        dst = self._alloc(need) if need else None
        if need and dst is None:
            self.skips.note("restore_abandoned", f"no room for {need} device tokens")
            return None
        # Slot ids are copy metadata and index handles: one device->host read for the batch.
        host_dst = dst.cpu() if dst is not None else None
        items = []
        for i, node in enumerate(missing):
            slots = host_dst[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]  # type: ignore[index]
            self.index.begin_node_fill(node, slots_to_handle(slots))
            items.append(BlockCopy(slots, node.host_slab))
        tail = None
        if tail_missing:
            slots = host_dst[BLOCK_TOKENS * len(missing) :]  # type: ignore[index]
            self.index.begin_tail_fill(source, slots_to_handle(slots), tail_tokens)
            tail = BlockCopy(slots[: source.tail_len], source.tail_host_slab)
        image = None
        if not source.image_on_device:
            assert state_slot is not None, "a host-only image needs the lane's state slot"
            image = (state_slot, source.host_slabs)
        try:
            moved = self._run(items, to_host=False, image=image, tail=tail)
        except Exception as exc:  # the request recomputes instead (issue #11)
            for node in missing:
                self.index.abort_node_fill(node)
            if tail_missing:
                self.index.abort_tail_fill(source)
            self._free(self.index.drain_freed_device())
            self.skips.note("restore_abandoned", f"copy failed: {exc}")
            raise RestoreFailed(str(exc)) from exc
        for node in missing:
            self.index.finish_node_fill(node)
        if tail_missing:
            self.index.finish_tail_fill(source)
        self.restored_bytes += moved
        self.restored_blocks += len(missing)
        tokens = BLOCK_TOKENS * len(missing) + (source.tail_len if tail_missing else 0)
        return Restored(moved, tokens)

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
    def prefetch(self, path: list[BlockNode], source: Snapshot | None) -> int:
        """Copy up to 256 host-only blocks of a blocked head's path into spare device pages.

        Pages come from the free pool and from host-backed cached blocks (never a last copy);
        the blocks then sit in the device LRU like any cached block. Returns blocks copied.
        """
        if source is None:
            return 0
        k = source.frontier // BLOCK_TOKENS
        missing = [n for n in path[:k] if n.device_state is R.ABSENT][:PREFETCH_BLOCKS]
        if not missing:
            return 0
        held = path[:k]
        self.index.pin_for_prefetch(held)  # the head's path stays put meanwhile
        try:
            room = self.allocator.available_size() + self._backed_evictable()
            count = min(len(missing), room // BLOCK_TOKENS)
            if count <= 0:
                return 0
            dst = self._alloc(count * BLOCK_TOKENS, backed_only=True)
            if dst is None:
                return 0
            host_dst = dst.cpu()
            items = []
            for i, node in enumerate(missing[:count]):
                slots = host_dst[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
                self.index.begin_node_fill(node, slots_to_handle(slots))
                items.append(BlockCopy(slots, node.host_slab))
            try:
                self.restored_bytes += self._run(items, to_host=False)
            except Exception as exc:
                for node in missing[:count]:
                    self.index.abort_node_fill(node)
                self._free(self.index.drain_freed_device())
                self.skips.note("restore_abandoned", f"prefetch copy failed: {exc}")
                return 0
            for node in missing[:count]:
                self.index.finish_node_fill(node)
            self.prefetched_blocks += count
            return count
        finally:
            self.index.unpin_for_prefetch(held)

    def _backed_evictable(self) -> int:
        return sum(self.index.lru.backed.values())

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
