"""KV pages from SGLang's token allocator, for the backend's own copies (tails, restores).

Contract:
- ``alloc_evicting(allocator, tokens, make_room)``: ``tokens`` slots, or None. When the
  allocator is short, ``make_room(shortfall)`` evicts cached blocks and hands their pages back
  (``free_dropped``), and the allocation is retried: evictable cache is free memory. SGLang
  batches the frees of a batch's results in a *free group*; pages freed inside one are only
  queued, so when the retry still fails there, the group is released and reopened (the pages are
  nobody's; only their return is brought forward) and the allocation tried once more.
- ``ceil_to(tokens, page_size)``: the tokens of the whole pages ``tokens`` occupy.
- ``free_dropped(allocator, dropped, device)``: the pages of the index's dropped blocks
  (``PrefixIndex.drain_freed_device``) back to the allocator, in one call, on ``device``.
- ``free_slots(allocator, slots)``: whole pages' slots back without a host wait. With pages of
  more than one token SGLang's ``free`` deduplicates page ids with ``torch.unique``, which waits
  for the device (issue #35); every slot list the cache frees is whole pages in order (blocks,
  tails rounded up to pages, restore pages), so each page is named once, by its first slot,
  through ``free_page_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..store.device import handles_to_slots


def free_slots(allocator: Any, slots: torch.Tensor) -> None:
    """Return whole pages (``slots``: each page's slots, in order) to SGLang's allocator."""
    page = int(getattr(allocator, "page_size", 1))
    if page == 1 or not hasattr(allocator, "free_page_ids"):
        allocator.free(slots)
        return
    allocator.free_page_ids(slots[::page] // page)


def ceil_to(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (a page)."""
    return -(-x // m) * m


def alloc_evicting(
    allocator: Any, tokens: int, make_room: Callable[[int], object]
) -> torch.Tensor | None:
    """``tokens`` slots from ``allocator``, evicting for them (see the module contract)."""
    out = allocator.alloc(tokens)
    if out is None:
        make_room(tokens - allocator.available_size())
        out = allocator.alloc(tokens)
    if out is None and getattr(allocator, "free_group", None) is not None:
        allocator.free_group_end()
        allocator.free_group_begin()
        out = allocator.alloc(tokens)
    return out


def free_dropped(
    allocator: Any, dropped: Iterable[tuple[object, int]], device: torch.device
) -> None:
    """Hand the dropped blocks' pages back to ``allocator`` in one call (nothing if none)."""
    handles = [h for h, _ in dropped]
    if handles:  # bytes or device handles (store.handles): whole pages either way
        free_slots(allocator, handles_to_slots(handles, device))
