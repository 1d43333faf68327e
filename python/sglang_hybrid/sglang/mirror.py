"""Host mirrors of slot ids SGLang keeps on the device (issue #35: no host sync per pass).

The cache needs a few device values on the host: a request's KV slot ids when its blocks are
committed (the index keeps them as ``bytes`` handles, ``store/handles.py``) and its MambaPool slot
when its state becomes a snapshot's. Reading them when needed waits for the device, and under
overlap scheduling that wait covers the whole prefill in flight (SGLang's WAR barrier makes the
schedule stream wait for it). Instead, once SGLang has built a batch (``after_batch_built``, on the
schedule stream, before it launches the forward) the slots it has just allocated are copied to
pinned host memory without waiting (``PassSlots``). The forward waits for the schedule stream, and
SGLang synchronizes on the pass's result (``copy_done``) before processing it, so by the time the
cache reads a mirror (at that pass's checkpoint or later) the copy has landed: a read checks it
with the copy's event (``query``: no wait) and would wait only if that chain were broken.

``RowMirror``: one request's ``req_to_token`` row, by position: prefix positions the cache wrote
itself (from its handles), the rest from the passes' copies, resolved in the order they were
made (a later write to a position wins). ``read`` answers None for a range holding a position
nobody mirrored (a speculative round's slots, decided on the device by its verify; a block the
cache repointed to device-only handles): callers then keep those slots on the device
(``DeviceSlots``), which is always correct and never waits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..index.keys import BLOCK_TOKENS


class PassSlots:
    """Device slot ids copied to the host without waiting; ``host()`` once they have landed."""

    __slots__ = ("_array", "_event", "_host")

    def __init__(self, slots: torch.Tensor) -> None:
        self._array: np.ndarray | None = None
        self._event: Any = None
        self._host: torch.Tensor | None = None
        if slots.device.type == "cuda":
            self._host = slots.to("cpu", torch.int64, non_blocking=True)  # pinned, async
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # the device is the host: the values now
            self._array = slots.to("cpu", torch.int64).numpy()

    def landed(self) -> bool:
        """Whether the copy has landed (asks the event; never waits)."""
        if self._event is not None and not self._event.query():
            return False
        self._event = None
        return True

    def host(self) -> np.ndarray:
        """The values, waiting for the copy if it has not landed (a host sync; the per-pass
        paths ask ``landed`` first)."""
        if self._array is None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._event = None
            assert self._host is not None
            self._array = self._host.numpy()
            self._host = None
        return self._array


class RowMirror:
    """A request's row of slot ids on the host (-1: not mirrored). Writes apply in the order
    they were made; a copy that has not landed holds back itself and every later write (a read
    overlapping them answers None). See the module docstring."""

    __slots__ = ("_pending", "slots")

    def __init__(self) -> None:
        self.slots = np.full(256, -1, dtype=np.int64)
        # (start, values or a copy, offset into the copy, count), in the order made
        self._pending: list[tuple[int, np.ndarray | PassSlots, int, int]] = []

    def _fit(self, end: int) -> None:
        if end > self.slots.shape[0]:
            grown = np.full(max(end, 2 * self.slots.shape[0]), -1, dtype=np.int64)
            grown[: self.slots.shape[0]] = self.slots
            self.slots = grown

    def put(self, start: int, values: np.ndarray) -> None:
        """Positions ``[start, start + len(values))`` hold ``values``."""
        self._pending.append((start, values, 0, len(values)))
        self._settle()

    def forget(self, start: int, end: int) -> None:
        """Positions ``[start, end)`` are not mirrored any more."""
        self.put(start, np.full(end - start, -1, dtype=np.int64))

    def put_path(self, handles: list[object]) -> None:
        """A matched path's block handles from position 0: ``bytes`` ones are the slots (64 a
        block); a device-only one leaves its block's positions unknown."""
        run: list[bytes] = []
        start = 0
        for i, h in enumerate(handles):
            if isinstance(h, bytes):
                run.append(h)
                continue
            if run:
                self.put(start, np.frombuffer(b"".join(run), dtype=np.int32))
            run, start = [], BLOCK_TOKENS * (i + 1)
        if run:
            self.put(start, np.frombuffer(b"".join(run), dtype=np.int32))

    def put_pending(self, start: int, copy: PassSlots, offset: int, n: int) -> None:
        """Positions ``[start, start + n)`` hold ``copy``'s values from ``offset`` on."""
        if n > 0:
            self._pending.append((start, copy, offset, n))

    def _settle(self) -> None:
        done = 0
        for start, src, offset, n in self._pending:
            if isinstance(src, PassSlots):
                if not src.landed():
                    break
                src = src.host()
            self._fit(start + n)
            self.slots[start : start + n] = src[offset : offset + n]
            done += 1
        del self._pending[:done]

    def read(self, start: int, end: int) -> np.ndarray | None:
        """The slots at positions ``[start, end)``, or None if any is not mirrored or waits
        for a copy that has not landed (never waits)."""
        self._settle()
        for s, _, _, n in self._pending:
            if s < end and start < s + n:
                return None
        if end > self.slots.shape[0]:
            return None
        out = self.slots[start:end]
        if out.size and int(out.min()) < 0:
            return None
        return out


def feed_batch(batch: Any) -> None:
    """After SGLang built ``batch`` (before its launch): copy the slots it allocated for each
    request the cache tracks (``req.last_node`` with a ``RowMirror``), and the MambaPool slot of
    each request seen for the first time, to the host (one copy each, no wait).

    Extend (and mixed) batches: request i's positions ``[prefix_lens[i], +extend_lens[i])`` hold
    ``out_cache_loc`` in order. Decode batches: one slot each, at the position just allocated.
    Speculative batches are not mirrored (their kept slots are decided by the verify on the
    device); commits read those from the device instead."""
    if batch is None or not batch.reqs:
        return
    mode = batch.forward_mode
    nodes: list[Any] = [getattr(req, "last_node", None) for req in batch.reqs]
    if not any(isinstance(getattr(n, "rows", None), RowMirror) for n in nodes):
        return
    if mode.is_extend():
        _feed_state_slots(batch.reqs, nodes)
    loc = getattr(batch, "out_cache_loc", None)
    if loc is None or not batch.spec_algorithm.is_none():
        return
    copy = PassSlots(loc)
    if mode.is_extend():
        offset = 0
        for node, pre, ext in zip(nodes, batch.prefix_lens, batch.extend_lens):
            if isinstance(getattr(node, "rows", None), RowMirror):
                node.rows.put_pending(int(pre), copy, offset, int(ext))
            offset += int(ext)
    elif mode.is_decode():
        for i, (req, node) in enumerate(zip(batch.reqs, nodes)):
            if isinstance(getattr(node, "rows", None), RowMirror):
                node.rows.put_pending(int(req.kv.kv_committed_len) - 1, copy, i, 1)


def _feed_state_slots(reqs: list[Any], nodes: list[Any]) -> None:
    new = [
        (req, node)
        for req, node in zip(reqs, nodes)
        if isinstance(getattr(node, "rows", None), RowMirror)
        and node.state_slot is None
        and node.state_copy is None
        and req.kv.holds_mamba
    ]
    if not new:
        return
    copy = PassSlots(torch.stack([req.kv.mamba_pool_idx.reshape(()) for req, _ in new]))
    for i, (_, node) in enumerate(new):
        node.state_copy = (copy, i)
