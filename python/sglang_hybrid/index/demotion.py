"""The exclusive host: each block on one tier (issue #37, item 4).

Write-through at release (spec §7.6) gives every block the device caches a host copy, so under
pressure the two tiers hold the host's bytes of distinct content, not their sum (92 % of the
Mooncake replay's device evictions were of blocks the host held too). With ``host_exclusive``:

- **Step 0 of host eviction (``drop_duplicates``).** When the host needs room and holds no dead
  KV, the host copy of a free block the device also holds goes first: nothing is lost while the
  device has it. Taken from the backed list's MRU end (the blocks the device keeps longest), and
  never from the ``reserve`` nearest eviction, which demotion just wrote.
- **Demotion ahead of eviction (``demotion_candidates``).** SGLang's allocator wants evicted
  pages at once, so no eviction waits for a copy. Instead, once per scheduler iteration, the
  unbacked blocks the device LRU would evict within ``reserve`` tokens are written to host as
  write-through writes them (``HostTransfers.plan_demotions``), and return to the backed list's
  evicting end. A pass then evicts them as bookkeeping. A demotion that lags loses the block as
  an unbacked eviction always did (its subtree goes); nothing stalls.

Only blocks some live snapshot lies below are demoted: KV below every snapshot can never be
resumed through (the dead-KV rule, §9.3). Tails and images keep their write-through.
Decisions read LRU order and counts only, identical on every TP rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .keys import BLOCK_TOKENS
from .node import BlockNode, FastResidency

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)
# Tails at the backed list's MRU end step 0 skips before giving up (they keep their host copy).
DUPLICATE_SCAN = 16


class Reserve:
    """Device tokens demotion keeps backed ahead of eviction: twice the most one scheduler
    iteration evicted lately (its prefill chunk, decodes and the restores admitted with it),
    at least the configured floor (``CacheConfig.demote_reserve_tokens``; 0: no exclusive
    host). A burst of restores evicts far more than a chunk, and what the reserve does not cover
    is lost; beyond the floor it takes at most half the device's cached tokens, or the device
    would hold the host's copies again. The peak decays by 1/256 per iteration in integers:
    counts only, identical on every TP rank."""

    __slots__ = ("_since", "floor", "peak")

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.peak = 0
        self._since = 0  # tokens evicted since the last ``tick``

    def note_evicted(self, tokens: int) -> None:
        if self.floor:  # counted only for an exclusive host (only it ticks)
            self._since += tokens

    def tick(self) -> None:
        """Once per scheduler iteration, before demotions are planned."""
        self.peak = max(self._since, self.peak - (self.peak >> 8))
        self._since = 0

    def tokens(self, cached: int) -> int:
        """The reserve with ``cached`` device tokens in the LRU."""
        return max(self.floor, min(2 * self.peak, cached // 2)) if self.floor else 0


def drop_duplicates(index: PrefixIndex, want: int) -> int:
    """Step 0: give up the host copies of up to ``want`` free, device-resident blocks; returns
    how many went (0: none may).

    Only while the backed list holds more than the reserve, so the blocks next in line for
    eviction (demoted at the list's head) keep the copy they were just given. The blocks are
    taken from the MRU end and enter the unbacked list's MRU end oldest first, keeping their
    order (a release enters its path deepest first: the deepest still leaves first)."""
    lru = index.residency.lru
    budget = lru.backed_tokens - index.reserve.tokens(lru.tokens)
    if not index.config.host_exclusive or budget <= 0:
        return 0
    batch: list[BlockNode] = []
    for i, entry in enumerate(reversed(lru.backed)):
        if len(batch) >= want or budget <= 0 or i >= want + DUPLICATE_SCAN:
            break
        if type(entry) is BlockNode:
            batch.append(entry)
            budget -= BLOCK_TOKENS
    for node in reversed(batch):
        index.drop_node_host(node)  # stays on the device, now unbacked
    index.stats.host_duplicates_dropped += len(batch)
    return len(batch)


def demotion_candidates(index: PrefixIndex) -> list[BlockNode]:
    """Unbacked blocks within ``reserve`` device tokens of eviction, oldest first.

    Eviction takes the backed list, then the unbacked list from its head; an entry's horizon is
    the tokens evicted before it. Entries not worth a host copy (tails, blocks below every live
    snapshot) count towards the horizon but are left to go. At most reserve / 64 entries are
    read, and none once the backed list alone covers the reserve (the common case)."""
    lru = index.residency.lru
    reserve = index.reserve.tokens(lru.tokens)  # 0 unless the host is exclusive
    horizon = lru.backed_tokens
    out: list[BlockNode] = []
    if horizon >= reserve:
        return out
    for entry, tokens in lru.unbacked.items():
        if (
            type(entry) is BlockNode
            and entry.live_snapshots_below > 0
            and entry.host_state is R.ABSENT
        ):
            out.append(entry)
        horizon += tokens
        if horizon >= reserve:
            break
    return out
