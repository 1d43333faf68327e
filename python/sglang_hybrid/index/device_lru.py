"""Device LRU of cached KV pages (spec §9.1).

Entries are tree nodes with ``active_refs == 0`` and no restore pins, and snapshot tails with no
restore pins, whose device copy is resident. Two lists: *backed* entries (a host copy exists, so
dropping the device copy is bookkeeping) are always consumed before *unbacked* ones (dropping the
device copy loses the last copy, §9.4). Within a list the head is the least recently used entry.

With an exclusive host (``demotion``) a third list goes before both: *dead* blocks, no live
snapshot below them (§9.3's dead KV, on the device): no request can resume through them, so
dropping them loses nothing, while the unbacked list there holds the device's own share of the
two tiers' content. Without one, dead blocks stay in the two lists (their host copies are swept
first, and the device holds what the host holds).

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
        self.dead: OrderedDict[Entry, int] = OrderedDict()  # an exclusive host's dead blocks
        self.tokens = 0  # device tokens held by all entries: SGLang's evictable_size
        self.backed_tokens = 0  # of those, the backed list's (``demotion`` keeps a reserve)

    def __len__(self) -> int:
        return len(self.backed) + len(self.unbacked) + len(self.dead)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self.backed or entry in self.unbacked or entry in self.dead

    def _list(self, backed: bool, dead: bool) -> OrderedDict[Entry, int]:
        return self.dead if dead else self.backed if backed else self.unbacked

    def add(self, entry: Entry, tokens: int, backed: bool, dead: bool = False) -> None:
        """Append at the MRU end. The entry must not be in any list."""
        self._list(backed, dead)[entry] = tokens
        self.tokens += tokens
        if backed and not dead:
            self.backed_tokens += tokens

    def add_head(self, entry: Entry, tokens: int, backed: bool, dead: bool = False) -> None:
        """Insert at the LRU end (evicted next in its list). The entry must not be in any
        list. A newcomer the scan-resistant rule keeps behind the residents (``newcomers``)."""
        lst = self._list(backed, dead)
        lst[entry] = tokens
        lst.move_to_end(entry, last=False)
        self.tokens += tokens
        if backed and not dead:
            self.backed_tokens += tokens

    def peek_victim(self) -> Entry | None:
        """The entry ``pop_victim`` would take next, left in place."""
        for lst in (self.dead, self.backed, self.unbacked):
            for entry in lst:
                return entry
        return None

    def _pop(self, entry: Entry) -> int | None:
        """Take ``entry`` out of whichever list holds it (its tokens stay counted in
        ``tokens``); None when none does. One pop per list, no membership test first: every
        block leaving the tree comes here."""
        tokens = self.backed.pop(entry, None)
        if tokens is not None:
            self.backed_tokens -= tokens
            return tokens
        tokens = self.unbacked.pop(entry, None)
        return tokens if tokens is not None else self.dead.pop(entry, None)

    def remove(self, entry: Entry) -> None:
        tokens = self._pop(entry)
        if tokens is None:
            raise KeyError(entry)
        self.tokens -= tokens

    def discard(self, entry: Entry) -> None:
        tokens = self._pop(entry)
        if tokens is not None:
            self.tokens -= tokens

    def touch(self, entry: Entry) -> None:
        for lst in (self.backed, self.unbacked, self.dead):
            if entry in lst:
                lst.move_to_end(entry)
                return

    def set_list(self, entry: Entry, backed: bool, dead: bool = False) -> None:
        """Move to the list its copies now name, keeping its recency rank approximately (it goes
        MRU); in place when it is there already."""
        dst = self._list(backed, dead)
        if entry in dst:
            return
        tokens = self._pop(entry)
        if tokens is None:
            return
        dst[entry] = tokens
        if dst is self.backed:
            self.backed_tokens += tokens

    def pop_victim(self, backed_only: bool = False) -> tuple[Entry, int] | None:
        """Remove the next entry to evict and return it with its tokens: the dead list's head,
        else the backed list's, else (unless ``backed_only``) the unbacked list's. Dead blocks
        go even when ``backed_only``: what they hold can never be resumed through. One
        ``popitem`` each: an eviction takes hundreds of victims, and a peek then a keyed pop
        hashed each one twice."""
        if self.dead:
            entry, tokens = self.dead.popitem(last=False)
        elif self.backed:
            entry, tokens = self.backed.popitem(last=False)
            self.backed_tokens -= tokens
        elif self.unbacked and not backed_only:
            entry, tokens = self.unbacked.popitem(last=False)
        else:
            return None
        self.tokens -= tokens
        return entry, tokens

    def is_backed(self, entry: Entry) -> bool:
        return entry in self.backed
