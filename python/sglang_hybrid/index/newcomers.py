"""Newcomers against residents: scan-resistant placement in both tiers (issue #37, beyond §9).

LRU (the device list, §9.1) and GDSF (the host tier and the device-only snapshot slots, §9.2-9.3;
with equal values its inflation L makes it LRU) keep nothing of a working set that cycles through
more than the cache holds: each request evicts what the next one needs. A cache that keeps a
stable part of such a set serves (capacity / working set) of it. TinyLFU's admission (Einziger
et al., 2017) is the rule used here, at block and snapshot granularity: a newcomer displaces a
resident only when it was used more often; ties keep the resident.

Use counts are counts, identical on every TP rank: ``BlockNode.uses`` is the number of requests
that entered the block (``PrefixIndex.open_lane`` and ``commit``); a block that left the tree
keeps its count in ``GhostBlocks`` (ARC's ghost list: hashes only, bounded by ``GHOST_SPAN``
times the tree's size) and gets it back when a later request commits it again. A snapshot's
count is its anchor's (the requests that reached its block), or its own hits for one anchored
at the root.

The rule costs what LRU is good at, recency: on traffic whose reuse lies within the cache (a
conversation's next turn, an agent's next step) a newcomer used once must win over old residents
used once, or it is gone before its next use. So it applies only while the cache *thrashes*:
``ThrashMeter`` compares the prompt tokens recomputed although the cache held them recently
(ghost hits: reuse just past the capacity) with the tokens it served (hits), both decaying by
traffic. More ghost hits than hits means recency is losing, and residents are kept; so does a
cache that has had to evict before serving anything, since a scan's first pass is where a stable
part must be chosen (a cache that never evicted keeps LRU's order: nothing is displaced yet).
On traffic that reuses within the capacity hits dominate and every placement is LRU's / GDSF's.

Where it applies (``PrefixIndex`` passes ``threshold()`` to each part):
- device LRU (``ResidencyTracker.release_path``): a released block used no more often than the
  next victim goes to the evicting end, not the MRU end;
- device snapshot slots (``DeviceSnapshotSlots.choose``): a device-only owner gives up its slot
  only to a snapshot whose count exceeds its own;
- host tier (``host_eviction.make_room``): GDSF's victim goes only for a newcomer (KV blocks
  written through, a snapshot image) whose count exceeds its own;
- host tier, learned order (``host_eviction.density_victim``), thrashing or not: a snapshot
  whose anchor one request reached goes before any that more reached (a protected class).
Dead KV, superseded snapshots and copies that remain elsewhere are evicted as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from .keys import BLOCK_TOKENS
from .node import BlockNode
from .snapshot import Snapshot

MIN_GHOSTS = 1024  # blocks remembered recently at least, whatever the tree holds
GHOST_SPAN = 4  # counts are remembered over 4 x the tree's largest size (``GhostBlocks``)
DECAY_TOKENS_PER_BLOCK = 4  # the meter halves after 4 x (tree blocks) x 64 prompt tokens


def snapshot_uses(s: Snapshot) -> int:
    """Requests that reached ``s``'s anchor block (its own hits + 1 at the root)."""
    a = s.anchor
    return a.uses if not a.is_root else s.hits + 1


class Recalled(NamedTuple):
    """What ``GhostBlocks.recall`` knew of a block committed again."""

    uses: int  # its count when it left the tree (0: not remembered)
    recent: bool  # it left within the last tree's worth of departures (ARC's ghost list)


_FORGOTTEN = Recalled(0, False)  # most blocks a commit adds are new: no tuple built for them


class GhostBlocks:
    """Use counts of blocks that left the tree, by lookup hash, oldest first, in two segments.

    ``recent`` holds as many as the tree held at its largest (ARC keeps as many ghosts as the
    cache holds entries): a block met there was reused just past the capacity, which is what
    ``ThrashMeter`` counts. ``older`` holds ``GHOST_SPAN - 1`` times as many, for the counts only:
    a prompt sent again long after its blocks left must not read as a newcomer (the host's
    protected class, ``host_eviction.density_victim``). On traffic whose prompts return at several
    times the cache's span (the Mooncake trace: a repeated prompt's first return lies a median
    8.6 M prompt tokens later, the host holds ~3.4 M) one capacity of memory forgets nearly all.
    Counting the older ghosts as thrash would read such traffic as a scan: the meter keeps ARC's
    span (counting both, the Mooncake replay reused 33.9 % instead of 34.1 %; without the
    protected class, 30.0 % instead of 33.5 %)."""

    __slots__ = ("capacity", "older", "recent")

    def __init__(self) -> None:
        self.recent: OrderedDict[int, int] = OrderedDict()
        self.older: OrderedDict[int, int] = OrderedDict()
        self.capacity = MIN_GHOSTS  # of ``recent``; ``older`` holds (GHOST_SPAN - 1) x

    def __len__(self) -> int:
        return len(self.recent) + len(self.older)

    def remember(self, node: BlockNode, tree_nodes: int) -> None:
        """``node`` leaves the tree (the tree held ``tree_nodes`` blocks with it)."""
        if tree_nodes > self.capacity:
            self.capacity = tree_nodes
        h, recent = node.lookup_hash, self.recent
        self.older.pop(h, None)  # a count is remembered once, where it left last
        recent[h] = node.uses  # a hash remembered again keeps its place: FIFO-ish
        if len(recent) > self.capacity:
            older = self.older
            k, uses = recent.popitem(last=False)
            older[k] = uses
            if len(older) > (GHOST_SPAN - 1) * self.capacity:
                older.popitem(last=False)

    def recall(self, lookup_hash: int) -> Recalled:
        """The count a block committed again had when it left, and whether recently."""
        uses = self.recent.pop(lookup_hash, 0)
        if uses:
            return Recalled(uses, True)
        uses = self.older.pop(lookup_hash, 0)
        return Recalled(uses, False) if uses else _FORGOTTEN


class ThrashMeter:
    """Recent ghost-hit tokens against hit tokens (see the module docstring)."""

    __slots__ = ("_traffic", "enabled", "ghost_hits_total", "ghost_tokens", "hit_tokens", "pressed")

    def __init__(self) -> None:
        self.ghost_tokens = 0.0  # recomputed tokens the cache held recently (decaying)
        self.hit_tokens = 0.0  # tokens resumed from the cache (decaying)
        self._traffic = 0  # prompt tokens since the last halving
        self.ghost_hits_total = 0  # blocks recalled, over the meter's life (a counter to report)
        self.pressed = False  # the cache has had to evict (until then nothing is displaced)
        self.enabled = True  # False: never thrashing, LRU's and GDSF's placement (comparisons)

    def note_request(self, prompt_tokens: int, resumed_tokens: int, tree_nodes: int) -> None:
        self.hit_tokens += resumed_tokens
        self._traffic += prompt_tokens
        if self._traffic > DECAY_TOKENS_PER_BLOCK * BLOCK_TOKENS * max(tree_nodes, MIN_GHOSTS):
            self._traffic = 0
            self.ghost_tokens *= 0.5
            self.hit_tokens *= 0.5

    def note_eviction(self) -> None:
        self.pressed = True

    def note_ghost_hit(self) -> None:
        self.ghost_tokens += BLOCK_TOKENS
        self.ghost_hits_total += 1

    @property
    def thrashing(self) -> bool:
        """Evicting, and recomputing at least as much as it serves (see the module docstring):
        a cache that has had to evict but has served nothing yet is in a scan's first pass."""
        return self.enabled and self.pressed and self.ghost_tokens >= self.hit_tokens

    def threshold(self, victim_uses: int) -> int:
        """While thrashing, newcomers used at most this often lose to residents; else -1."""
        return victim_uses if self.thrashing else -1
