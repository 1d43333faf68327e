"""Records of the host tier's copy queue (``host_tier.py``): an operation, a restore in flight,
the counters, the usage split, and the block copy lists operations carry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..index import BLOCK_TOKENS, Lane
from ..store.device import DeviceSlots, handle_to_slots, handles_to_slots
from ..store.transfer import BlockCopy


class HostUsage(NamedTuple):
    kv_bytes: int
    image_bytes: int
    free_bytes: int


@dataclass(slots=True, eq=False)
class PendingRestore:
    """A restore in flight for one waiting request (its lane open, destinations Filling)."""

    rid: str
    handle: Any  # the request's MatchHandle for the host source (holds the lane)
    nbytes: int = 0
    tokens: int = 0  # prefix tokens whose KV comes back from the host
    image_on_device: bool = False  # the image stayed in the source's slot (COW from there)
    staging: torch.Tensor | None = None  # the MambaPool slot the image lands in (async)
    done: bool = False
    failed: bool = False
    counted: bool = False  # its bytes and tokens are on the request's record


@dataclass(slots=True, eq=False)
class Op:
    run: Callable[[], int]  # enqueues the copies, returns the bytes
    done: Callable[[int], None]
    failed: Callable[[BaseException], None]
    write_bytes: int = 0  # counted against the write-through bound
    lanes: tuple[Lane, ...] = ()  # kept open until the operation retires
    kind: str = "write"


@dataclass(slots=True)
class Counters:
    written_bytes: int = 0
    demoted_bytes: int = 0  # of written_bytes, demotions' (an exclusive host)
    restored_bytes: int = 0
    restored_blocks: int = 0
    prefetched_blocks: int = 0
    ops_issued: int = 0
    backlogged: int = 0
    shed: int = 0
    peak_write_bytes: int = 0


def block_copies(handles: list[Any], slabs: list[int]) -> list[BlockCopy]:
    """Block copies from device handles (64 slots each): ``bytes`` ones converted to host
    metadata in one go, device ones (``DeviceSlots``) used as device indices."""
    if not any(isinstance(h, DeviceSlots) for h in handles):
        rows = handles_to_slots(handles, "cpu").view(len(slabs), BLOCK_TOKENS)
        return [BlockCopy(rows[i], slab) for i, slab in enumerate(slabs)]
    return [BlockCopy(host_or_device(h), slab) for h, slab in zip(handles, slabs)]


def host_or_device(handle: object) -> torch.Tensor:
    """A handle's slots: on the host for ``bytes``, the device tensor for ``DeviceSlots``."""
    return handle_to_slots(handle, "cpu")
