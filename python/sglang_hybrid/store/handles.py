"""Device handles: what the index keeps for a block's or a tail's device copy (spec §7.7).

The index treats a handle as opaque (``BlockNode.device``, ``Snapshot.tail_device``). There are
two kinds, and the converters here take either:

- ``bytes``: the packed int32 KV slot ids, when the cache knows them on the host (a request's
  slots read from its host mirror, ``sglang/mirror.py``; anything made on the CPU). Compact; a
  path's slots are one ``b"".join`` away; the host tier reads them as copy metadata.
- ``DeviceSlots``: the slot ids as a device tensor, when they exist only there (pages the cache
  just allocated for a restore or a tail copy). Reading them on the host would wait for the
  device (issue #35), so nothing does: they go back to SGLang and into copies as device indices.

Moving host slot ids to the device never waits either (``to_device``): they are staged in pinned
memory and copied asynchronously on the current stream.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..index.keys import BLOCK_TOKENS


class DeviceSlots:
    """A handle whose slot ids live on the device (int64, one per token; see the module)."""

    __slots__ = ("slots",)

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def __len__(self) -> int:
        return int(self.slots.numel())

    def __bool__(self) -> bool:
        return self.slots.numel() > 0

    def __repr__(self) -> str:
        return f"DeviceSlots({self.slots.numel()})"


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (CPU) on ``device`` without a host wait: on CUDA staged in pinned memory and
    copied asynchronously on the current stream (the caching host allocator keeps the staging
    buffer until the copy has read it); elsewhere a plain move (on the CPU, ``host`` itself)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def slots_to_handle(slots: torch.Tensor | np.ndarray) -> bytes:
    """Host KV slot ids (a CPU tensor or an array) as the packed int32 handle the index keeps."""
    if isinstance(slots, torch.Tensor):
        slots = slots.to(dtype=torch.int32).numpy()
    return np.ascontiguousarray(slots, dtype=np.int32).tobytes()


def block_handles(slots: torch.Tensor | np.ndarray) -> list[bytes]:
    """The handles of consecutive 64-token blocks (host ``slots``: their KV slot ids, in order),
    one per block, split in C (a chunk's commit takes ~128)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.to(dtype=torch.int32).numpy()
    host = np.ascontiguousarray(slots, dtype=np.int32)  # no copy if it is already
    handles: list[bytes] = host.view(f"V{4 * BLOCK_TOKENS}").tolist()
    return handles  # a void element's ``tolist`` value is its bytes (a copy, not a view)


def device_block_handles(slots: torch.Tensor) -> list[DeviceSlots]:
    """One ``DeviceSlots`` per 64-token block of device ``slots`` (a private int64 copy, so the
    request's row may change afterwards)."""
    rows = slots.to(torch.int64).clone().view(-1, BLOCK_TOKENS)
    return [DeviceSlots(rows[i]) for i in range(rows.shape[0])]


def handle_to_slots(handle: object, device: torch.device | str) -> torch.Tensor:
    """Slot ids of a handle as int64 on ``device`` (the pool's device for anything handed to
    SGLang; a ``DeviceSlots`` handle is returned as it is, never read on the host)."""
    if isinstance(handle, DeviceSlots):
        return handle.slots
    if not handle:
        return torch.empty(0, dtype=torch.int64, device=device)
    assert isinstance(handle, bytes)
    out = torch.from_numpy(np.frombuffer(handle, dtype=np.int32).astype(np.int64))
    return to_device(out, device)


def handles_to_slots(handles: Iterable[object], device: torch.device | str) -> torch.Tensor:
    """The slots of several handles, concatenated: runs of ``bytes`` handles join into one
    transfer; ``DeviceSlots`` join on the device."""
    parts: list[torch.Tensor] = []
    run: list[bytes] = []
    for h in handles:
        if isinstance(h, DeviceSlots):
            if run:
                parts.append(handle_to_slots(b"".join(run), device))
                run = []
            parts.append(h.slots)
        elif h:
            assert isinstance(h, bytes)
            run.append(h)
    if run or not parts:
        parts.append(handle_to_slots(b"".join(run), device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def host_slots(handle: object) -> torch.Tensor | None:
    """A ``bytes`` handle's slot ids on the host (int64), or None for a ``DeviceSlots`` one."""
    if isinstance(handle, DeviceSlots):
        return None
    assert isinstance(handle, bytes)
    return torch.from_numpy(np.frombuffer(handle, dtype=np.int32).astype(np.int64))
