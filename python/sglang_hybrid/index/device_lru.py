"""Device LRU of cached KV pages (spec §9.1).

Entries are tree nodes with ``active_refs == 0`` and no restore pins, and snapshot tails with no
restore pins, whose device copy is resident. Two lists: *backed* entries (a host copy exists, so
dropping the device copy is bookkeeping) are always consumed before *unbacked* ones (dropping the
device copy loses the last copy, §9.4). Within a list the head is the least recently used entry.

Tail-first: a releasing lane appends its nodes in reverse block order, so a conversation's deeper
blocks leave the device before its shallower ones; a hit moves the path to the MRU end.
"""

from __future__ import annotations

from collections import OrderedDict

Entry = object  # a BlockNode (its block) or a Snapshot (its tail)


class DeviceLRU:
    def __init__(self) -> None:
        self.backed: OrderedDict[Entry, int] = OrderedDict()  # entry -> device tokens
        self.unbacked: OrderedDict[Entry, int] = OrderedDict()
        self.tokens = 0  # device tokens held by all entries: SGLang's evictable_size

    def __len__(self) -> int:
        return len(self.backed) + len(self.unbacked)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self.backed or entry in self.unbacked

    def add(self, entry: Entry, tokens: int, backed: bool) -> None:
        """Append at the MRU end. The entry must not be in either list."""
        (self.backed if backed else self.unbacked)[entry] = tokens
        self.tokens += tokens

    def add_head(self, entry: Entry, tokens: int, backed: bool) -> None:
        """Insert at the LRU end (evicted next in its list). The entry must not be in either
        list. A newcomer the scan-resistant rule keeps behind the residents (``newcomers``)."""
        lst = self.backed if backed else self.unbacked
        lst[entry] = tokens
        lst.move_to_end(entry, last=False)
        self.tokens += tokens

    def peek_victim(self) -> Entry | None:
        """The entry ``pop_victim`` would take next, left in place."""
        for lst in (self.backed, self.unbacked):
            for entry in lst:
                return entry
        return None

    def remove(self, entry: Entry) -> None:
        tokens = self.backed.pop(entry, None)
        if tokens is None:
            tokens = self.unbacked.pop(entry)
        self.tokens -= tokens

    def discard(self, entry: Entry) -> None:
        # One pop per list, no membership test first: every block leaving the tree comes here.
        tokens = self.backed.pop(entry, None)
        if tokens is None:
            tokens = self.unbacked.pop(entry, None)
        if tokens is not None:
            self.tokens -= tokens

    def touch(self, entry: Entry) -> None:
        if entry in self.backed:
            self.backed.move_to_end(entry)
        elif entry in self.unbacked:
            self.unbacked.move_to_end(entry)

    def set_backed(self, entry: Entry, backed: bool) -> None:
        """Move between lists, keeping the entry's recency rank approximately (it goes MRU)."""
        src, dst = (self.unbacked, self.backed) if backed else (self.backed, self.unbacked)
        if entry in src:
            dst[entry] = src.pop(entry)

    def pop_victim(self, backed_only: bool = False) -> tuple[Entry, int] | None:
        """Remove the next entry to evict and return it with its tokens: the backed list's head,
        else (unless ``backed_only``) the unbacked list's. One ``popitem`` each: an eviction takes
        hundreds of victims, and a peek then a keyed pop hashed each one twice."""
        if self.backed:
            entry, tokens = self.backed.popitem(last=False)
        elif self.unbacked and not backed_only:
            entry, tokens = self.unbacked.popitem(last=False)
        else:
            return None
        self.tokens -= tokens
        return entry, tokens

    def is_backed(self, entry: Entry) -> bool:
        return entry in self.backed
