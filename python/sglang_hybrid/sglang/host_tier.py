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

logger = logging.getLogger(__name__)
R = Residency
PREFETCH_BLOCKS = 256


class Restored(NamedTuple):
    nbytes: int
    tokens: int  # prefix tokens whose KV came back from the host


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
        self.written_bytes = 0
        self.restored_bytes = 0
        self.restored_blocks = 0
        self.prefetched_blocks = 0

    # ================================================================ write-through
    def write_lane(self, lane: Any) -> int:
        """The lane's device-only blocks, in one batch, before they become evictable (§7.6)."""
        planned = self.index.plan_writes(lane)
        if not planned:
            return 0
        items = [BlockCopy(handle_to_slots(n.device), slab) for n, slab in planned]  # type: ignore[arg-type]
        batch = TransferBatch(self.copier, self.order)
        batch.add_blocks(items)
        moved = batch.run(to_host=True)
        batch.synchronize()
        self.index.complete_writes(planned)
        self.written_bytes += moved
        return moved

    def write_snapshot(self, s: Snapshot, state_slot: int) -> int:
        """Image (and tail) of a just-published snapshot; skipped when GDSF refuses (§9.3)."""
        plan = self.index.plan_image_write(s)
        if plan is None:
            return 0
        slabs, tail_slab = plan
        batch = TransferBatch(self.copier, self.order)
        batch.add_image(state_slot, slabs)
        if tail_slab >= 0:
            batch.add_tail(BlockCopy(handle_to_slots(s.tail_device)[: s.tail_len], tail_slab))  # type: ignore[arg-type]
        moved = batch.run(to_host=True)
        batch.synchronize()
        self.index.complete_image_write(s)
        self.written_bytes += moved
        return moved

    # ================================================================ restore
    def restore(self, path: list[BlockNode], source: Snapshot, state_slot: int | None) -> Restored:
        """Host-only path blocks, tail and image of ``source`` back on the device (§6.4-6.5).

        ``path`` is pinned by the caller's lane. Destinations are fresh device pages (blocks and
        tail) and the lane's own state slot (the image).
        """
        missing = [n for n in path if n.device_state is R.ABSENT]
        tail_missing = bool(source.tail) and source.tail_device_state is R.ABSENT
        tail_tokens = -(-source.tail_len // self.page_size) * self.page_size
        need = BLOCK_TOKENS * len(missing) + (tail_tokens if tail_missing else 0)
        dst = self._alloc(need) if need else None
        batch = TransferBatch(self.copier, self.order)
        items = []
        for i, node in enumerate(missing):
            slots = dst[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]  # type: ignore[index]
            self.index.begin_node_fill(node, slots_to_handle(slots))
            items.append(BlockCopy(slots, node.host_slab))
        batch.add_blocks(items)
        if tail_missing:
            slots = dst[BLOCK_TOKENS * len(missing) :]  # type: ignore[index]
            self.index.begin_tail_fill(source, slots_to_handle(slots), tail_tokens)
            batch.add_tail(BlockCopy(slots[: source.tail_len], source.tail_host_slab))
        if not source.image_on_device:
            assert state_slot is not None, "a host-only image needs the lane's state slot"
            batch.add_image(state_slot, source.host_slabs)
        moved = batch.run(to_host=False)
        batch.synchronize()  # the CPU path lands at once; on a GPU the forward would wait per layer
        for node in missing:
            self.index.finish_node_fill(node)
        if tail_missing:
            self.index.finish_tail_fill(source)
        self.restored_bytes += moved
        self.restored_blocks += len(missing)
        tokens = BLOCK_TOKENS * len(missing) + (source.tail_len if tail_missing else 0)
        return Restored(moved, tokens)

    def _alloc(self, tokens: int) -> torch.Tensor:
        out = self.allocator.alloc(tokens)
        if out is None:
            self.index.evict_device(tokens - self.allocator.available_size())
            self._free(self.index.drain_freed_device())
            out = self.allocator.alloc(tokens)
        if out is None:
            raise RuntimeError(
                f"out of KV memory restoring {tokens} tokens from the host tier; raise "
                f"--max-total-tokens or lower the admission load"
            )
        return out.to(torch.int64)

    def _free(self, dropped: list[tuple[object, int]]) -> None:
        if dropped:
            slots = handle_to_slots(b"".join(h for h, _ in dropped))  # type: ignore[misc]
            self.allocator.free(slots)

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
        for n in path[:k]:  # the head's path stays put meanwhile
            n.restore_pins += 1
            self.index._node_changed(n)
        try:
            room = self.allocator.available_size() + self._backed_evictable()
            count = min(len(missing), room // BLOCK_TOKENS)
            if count <= 0:
                return 0
            need = count * BLOCK_TOKENS
            short = need - self.allocator.available_size()
            if short > 0:
                self.index.evict_device(short, backed_only=True)
                self._free(self.index.drain_freed_device())
            dst = self.allocator.alloc(need)
            if dst is None:
                return 0
            dst = dst.to(torch.int64)
            items = []
            for i, node in enumerate(missing[:count]):
                slots = dst[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
                self.index.begin_node_fill(node, slots_to_handle(slots))
                items.append(BlockCopy(slots, node.host_slab))
            batch = TransferBatch(self.copier, self.order)
            batch.add_blocks(items)
            self.restored_bytes += batch.run(to_host=False)
            batch.synchronize()
            for node in missing[:count]:
                self.index.finish_node_fill(node)
            self.prefetched_blocks += count
            return count
        finally:
            for n in path[:k]:
                n.restore_pins -= 1
                self.index._node_changed(n)

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
