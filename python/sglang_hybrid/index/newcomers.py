"""Newcomers against residents: scan-resistant placement in both tiers (issue #37, beyond §9).

LRU (the device list, §9.1) and GDSF (the host tier and the device-only snapshot slots, §9.2-9.3;
with equal values its inflation L makes it LRU) keep nothing of a working set that cycles through
more than the cache holds: each request evicts what the next one needs. A cache that keeps a
stable part of such a set serves (capacity / working set) of it. TinyLFU's admission (Einziger
et al., 2017) is the rule used here, at block and snapshot granularity: a newcomer displaces a
resident only when it was used more often; ties keep the resident.

Use counts are counts, identical on every TP rank: ``BlockNode.uses`` is the number of requests
that entered the block (``PrefixIndex.open_lane`` and ``commit``); a block that left the tree
keeps its count in ``GhostBlocks`` (ARC's ghost list: hashes only, bounded by the tree's size)
and gets it back when a later request commits it again. A snapshot's count is its anchor's (the
requests that reached its block), or its own hits for one anchored at the root.

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
  written through, a snapshot image) whose count exceeds its own.
Dead KV, superseded snapshots and copies that remain elsewhere are evicted as before.
"""

from __future__ import annotations

from collections import OrderedDict

from .keys import BLOCK_TOKENS
from .node import BlockNode
from .snapshot import Snapshot

MIN_GHOSTS = 1024  # blocks remembered at least, whatever the tree holds
DECAY_TOKENS_PER_BLOCK = 4  # the meter halves after 4 x (tree blocks) x 64 prompt tokens


def snapshot_uses(s: Snapshot) -> int:
    """Requests that reached ``s``'s anchor block (its own hits + 1 at the root)."""
    a = s.anchor
    return a.uses if not a.is_root else s.hits + 1


class GhostBlocks:
    """Use counts of blocks that left the tree, by lookup hash, oldest first; at most as many as
    the tree held at its largest (ARC keeps as many ghosts as the cache holds entries)."""

    __slots__ = ("_uses", "capacity")

    def __init__(self) -> None:
        self._uses: OrderedDict[int, int] = OrderedDict()
        self.capacity = MIN_GHOSTS

    def __len__(self) -> int:
        return len(self._uses)

    def remember(self, node: BlockNode, tree_nodes: int) -> None:
        """``node`` leaves the tree (the tree held ``tree_nodes`` blocks with it)."""
        if tree_nodes > self.capacity:
            self.capacity = tree_nodes
        uses = self._uses
        uses[node.lookup_hash] = node.uses  # a hash remembered again keeps its place: FIFO-ish
        if len(uses) > self.capacity:
            uses.popitem(last=False)

    def recall(self, lookup_hash: int) -> int:
        """The count a block committed again had when it left (0: not remembered)."""
        return self._uses.pop(lookup_hash, 0)


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
