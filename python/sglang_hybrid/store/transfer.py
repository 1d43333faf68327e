"""Copies between SGLang's device pools and host slabs (spec §6.4-6.5, §7.6, §11.1-11.2).

Blocks move as bundles: for each KV plane (a full-attention layer's K or V), the 64 rows of a
block go to that plane's place in the block's slab. A *run* is a sequence of blocks whose token
slots are consecutive and whose slabs are consecutive in one chunk: it moves as one strided copy
per plane. SGLang's KV pool is indexed by token slot, and with a page size below 64 a block's 64
slots need not be consecutive, so copies gather and scatter by slot index and coalesce only where
slots run consecutively. A state image moves part by part (one linear layer's conv and recurrent
tensors at a time), split where a part straddles two slabs.

``TransferBatch`` queues copies and runs them in a forward pass's reading order: the prelude
(tails), then layer by layer, on the current stream (the host tier's copy stream,
``copy_queue.py``). ``wait_layer`` is the per-layer readiness API: with CUDA the batch records an
event per layer; on the CPU the copies are synchronous and every wait returns at once.

Slot ids (``BlockCopy.slots``, an image's slot) are host metadata when the cache knows them, or
device tensors when they exist only there (pages just allocated for a restore, ``handles.py``);
device ones are used as indices as they are (no contiguous runs: that needs their values) and
host ones reach the device through pinned memory, so issuing a copy never waits (issue #35).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch

from .cuda_copy import Memcpy2D
from .handles import to_device
from .host_memory import HostMemory
from .layout import SlabLayout

BLOCK = 64


class BlockCopy(NamedTuple):
    slots: torch.Tensor  # int64 token slots, one per row: host metadata or a device tensor
    slab: int


def _on_host(slots: torch.Tensor) -> bool:
    return slots.device.type == "cpu"


def _u8_rows(buf: torch.Tensor) -> torch.Tensor:
    """A pool buffer ``[slots, ...]`` as raw bytes ``[slots, row_bytes]`` (a view)."""
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def _runs(items: Sequence[BlockCopy], memory: HostMemory) -> list[tuple[int, int]]:
    """Split ``items`` (in order) into runs [i, j) of consecutive slots and consecutive slabs."""
    runs, i, n = [], 0, len(items)
    spc = memory.pool.slabs_per_chunk
    while i < n:
        j = i + 1
        first = items[i]
        contiguous = bool(
            first.slots.numel() == BLOCK and _on_host(first.slots) and _consecutive(first.slots)
        )
        while contiguous and j < n:
            prev, cur = items[j - 1], items[j]
            if (
                cur.slots.numel() != BLOCK
                or not _on_host(cur.slots)
                or cur.slab != prev.slab + 1
                or cur.slab // spc != first.slab // spc
                or int(cur.slots[0]) != int(prev.slots[-1]) + 1
                or not _consecutive(cur.slots)
            ):
                break
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _consecutive(slots: torch.Tensor) -> bool:
    return int(slots[-1]) - int(slots[0]) == slots.numel() - 1 and bool(
        (slots[1:] - slots[:-1] == 1).all()
    )


def _kernel_ext(staging: str, on_cuda: bool) -> ModuleType | None:
    """``sgl_kernel_ext`` when block copies should go through a staging buffer: ``"auto"`` on a
    GPU whose extension is built, ``"always"`` wherever the package imports (on the CPU its torch
    references run: tests), ``"never"``."""
    if staging == "never" or (staging == "auto" and not on_cuda):
        return None
    try:
        import sgl_kernel_ext as kx
    except ImportError:
        return None
    if staging == "auto" and not kx.extension_available():
        return None
    return kx


class SlabCopier:
    """Byte copies for one layout, one set of pools and one host memory.

    Whole blocks move in one of two ways. The per-block path (the reference, and the CPU path)
    gathers or scatters each block's rows plane by plane, coalescing runs of consecutive slots.
    The staged path (``sgl_kernel_ext``, on a GPU with the extension built) gathers every block
    of a batch, all planes, into one device staging buffer laid out exactly as the slabs in one
    launch, and moves it with one copy per run of consecutive slabs; a restore copies the
    staging buffer up once and scatters it layer by layer in forward order. Tails (fewer rows)
    always take the per-block path.
    """

    def __init__(
        self,
        layout: SlabLayout,
        memory: HostMemory,
        kv_buffers: list[torch.Tensor],
        state_tensors: list[torch.Tensor],
        *,
        staging: str = "auto",
    ) -> None:
        self.layout = layout
        self.memory = memory
        self.kv_buffers = kv_buffers
        self.kv_rows = [_u8_rows(b) for b in kv_buffers]
        self.state = state_tensors
        on_cuda = bool(kv_buffers) and kv_buffers[0].is_cuda and memory.pinned
        self.memcpy2d = Memcpy2D() if on_cuda else None
        if self.memcpy2d is not None and not self.memcpy2d.available:
            self.memcpy2d = None  # torch's copy_ stays correct, only slower for runs
        self.kx = _kernel_ext(staging, bool(kv_buffers) and kv_buffers[0].is_cuda)
        # Reused: batches run one after another on one stream or thread (``copy_queue.py``).
        self._staging: torch.Tensor | None = None

    # ---------------------------------------------------------------- staged blocks
    def staged(self, items: Sequence[BlockCopy]) -> bool:
        """Through the extension's staging buffer: only with host slot ids (its ops check
        their index tables on the host; device ids would be read back there, a sync)."""
        return self.kx is not None and bool(items) and all(_on_host(it.slots) for it in items)

    def _staging_for(self, n: int) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.shape[0] < n:
            device = self.kv_buffers[0].device
            buf = torch.empty((n, self.layout.slab_bytes), dtype=torch.uint8, device=device)
            self._staging = buf
        return buf[:n]

    def stage_out(self, items: Sequence[BlockCopy]) -> int:
        """Device blocks -> staging (one launch) -> host slabs (one copy per slab run)."""
        staging = self._staging_for(len(items))
        slots = self._slot_table(items)
        assert self.kx is not None  # only staged copies (staged(): kx is not None) come here
        self.kx.kv_blocks_to_staging(self.kv_buffers, slots, staging, layout=self.layout)
        return self._slab_runs(items, staging, to_host=True)

    def stage_in(self, items: Sequence[BlockCopy]) -> torch.Tensor:
        """Host slabs -> staging (one copy per slab run); ``scatter`` lands it layer by layer."""
        staging = self._staging_for(len(items))
        self._slab_runs(items, staging, to_host=False)
        return staging

    def _slot_table(self, items: Sequence[BlockCopy]) -> torch.Tensor:
        """The items' host slots as one ``[blocks, rows]`` table, pinned with CUDA pools: the
        extension checks it on the host and copies it to the device without a wait."""
        slots = torch.stack([it.slots for it in items])
        return slots.pin_memory() if self.kv_buffers[0].is_cuda else slots

    def scatter(self, items: Sequence[BlockCopy], staging: torch.Tensor, layer: int) -> int:
        slots = self._slot_table(items)
        assert self.kx is not None  # as in stage_out
        return int(
            self.kx.staging_to_kv_blocks(
                staging, self.kv_buffers, slots, layout=self.layout, layers=[layer]
            )
        )

    def _slab_runs(self, items: Sequence[BlockCopy], staging: torch.Tensor, to_host: bool) -> int:
        spc, nbytes = self.memory.pool.slabs_per_chunk, self.layout.block_bytes
        i, moved = 0, 0
        while i < len(items):
            j = i + 1
            while (
                j < len(items)
                and items[j].slab == items[j - 1].slab + 1
                and items[j].slab // spc == items[i].slab // spc
            ):
                j += 1
            host = self.memory.run(items[i].slab, j - i, 0, nbytes)
            if to_host:
                host.copy_(staging[i:j, :nbytes], non_blocking=True)
            else:
                staging[i:j, :nbytes].copy_(host, non_blocking=True)
            moved += (j - i) * nbytes
            i = j
        return moved

    # ---------------------------------------------------------------- KV blocks and tails
    def runs(self, items: Sequence[BlockCopy]) -> list[tuple[int, int]]:
        return _runs(items, self.memory)

    def blocks(
        self,
        items: Sequence[BlockCopy],
        to_host: bool,
        layer: int | None = None,
        runs: list[tuple[int, int]] | None = None,
    ) -> int:
        """Copy block bundles (or tails: fewer rows); ``layer`` limits it to one layer's planes.

        Slot tensors are CPU metadata: run detection reads them without touching the device.
        """
        if not items:
            return 0
        moved = 0
        planes = [p for p in self.layout.planes if layer is None or p.layer == layer]
        for i, j in runs if runs is not None else _runs(items, self.memory):
            run = items[i:j]
            count = j - i
            rows_per = run[0].slots.numel()
            first = run[0].slots
            contiguous = count > 1 or (
                rows_per == BLOCK and _on_host(first) and _consecutive(first)
            )
            s0 = int(first[0]) if contiguous else 0
            idx = None
            if not contiguous:
                idx = to_device(first, self.kv_rows[0].device) if _on_host(first) else first
            for p in planes:
                length = rows_per * p.row_bytes
                host = self.memory.run(run[0].slab, count, p.offset, length)
                rows = self.kv_rows[p.buffer]
                if idx is None:
                    dev = rows[s0 : s0 + count * rows_per].reshape(count, length)
                    if self.memcpy2d is not None and count > 1:
                        self.memcpy2d(host, dev) if to_host else self.memcpy2d(dev, host)
                    elif to_host:
                        host.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(host, non_blocking=True)
                elif to_host:  # a block or tail with scattered slots: gather, one copy
                    host.copy_(rows.index_select(0, idx).reshape(1, length), non_blocking=True)
                else:  # ... or one copy, then scatter
                    staged = host.reshape(rows_per, p.row_bytes).to(rows.device, non_blocking=True)
                    rows.index_copy_(0, idx, staged)
                moved += count * length
        return moved

    # ---------------------------------------------------------------- state images
    def image(
        self,
        slot: int | torch.Tensor,
        slabs: Sequence[int],
        to_host: bool,
        layer: int | None = None,
    ) -> int:
        """Copy one MambaPool slot's state to / from its image slabs (``layer``: one layer).
        ``slot``: a host int, or a one-element device tensor (then each part is gathered into a
        row, or assembled in one and scattered)."""
        sb = self.memory.slab_bytes
        moved = 0
        for part in self.layout.image_parts:
            if layer is not None and part.layer != layer:
                continue
            plane = self.state[part.tensor][part.layer]
            if isinstance(slot, torch.Tensor):
                idx = slot.reshape(1).to(torch.int64)
                row = plane.index_select(0, idx) if to_host else torch.empty_like(plane[:1])
                dev = row.reshape(-1).view(torch.uint8)
            else:
                idx, row = None, None
                dev = plane[slot].reshape(-1).view(torch.uint8)
            done = 0
            while done < part.nbytes:
                o = part.offset + done
                k, within = divmod(o, sb)
                n = min(part.nbytes - done, sb - within)
                host = self.memory.slab(slabs[k])[within : within + n]
                if to_host:
                    host.copy_(dev[done : done + n], non_blocking=True)
                else:
                    dev[done : done + n].copy_(host, non_blocking=True)
                done += n
            if idx is not None and row is not None and not to_host:
                plane.index_copy_(0, idx, row)
            moved += part.nbytes
        return moved


class TransferBatch:
    """Copies queued and run in a forward pass's reading order (see the module docstring)."""

    def __init__(self, copier: SlabCopier, forward_order: Sequence[tuple[str, int]]) -> None:
        self.copier = copier
        self.order = forward_order  # ("kv", full-attention idx) / ("state", linear idx)
        self.blocks: list[BlockCopy] = []
        self.tails: list[BlockCopy] = []
        self.images: list[tuple[int | torch.Tensor, Sequence[int]]] = []
        self.bytes = 0
        self._events: dict[int, torch.cuda.Event] = {}

    def add_blocks(self, items: Sequence[BlockCopy]) -> None:
        self.blocks.extend(items)

    def add_tail(self, item: BlockCopy) -> None:
        self.tails.append(item)

    def add_image(self, slot: int | torch.Tensor, slabs: Sequence[int]) -> None:
        self.images.append((slot, slabs))

    def run(self, to_host: bool) -> int:
        """Issue every copy on the current stream (the host tier's copy stream,
        ``copy_queue.py``): the prelude (tails), then each layer in forward order, recording an
        event per layer on CUDA."""
        c = self.copier
        use_cuda = bool(c.kv_buffers and c.kv_buffers[0].is_cuda)
        if use_cuda:  # device slot ids made on another stream: kept until this one read them
            here = torch.cuda.current_stream()
            for it in (*self.tails, *self.blocks):
                if not _on_host(it.slots):
                    it.slots.record_stream(here)
            for slot, _ in self.images:
                if isinstance(slot, torch.Tensor):
                    slot.record_stream(here)
        for t in self.tails:
            self.bytes += c.blocks([t], to_host)
        staged = c.staged(self.blocks)
        staging = None
        if staged and to_host:
            self.bytes += c.stage_out(self.blocks)
        elif staged:
            staging = c.stage_in(self.blocks)
        runs = c.runs(self.blocks) if not staged else []
        for pos, (kind, idx) in enumerate(self.order):
            if kind == "kv":
                if staging is not None:
                    self.bytes += c.scatter(self.blocks, staging, idx)
                elif not staged:
                    self.bytes += c.blocks(self.blocks, to_host, layer=idx, runs=runs)
            else:
                for slot, slabs in self.images:
                    self.bytes += c.image(slot, slabs, to_host, layer=idx)
            if use_cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._events[pos] = ev
        return self.bytes

    def wait_layer(self, pos: int) -> None:
        """Make the current stream wait for layer ``pos`` of the forward order (CPU: no-op)."""
        ev = self._events.get(pos)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
