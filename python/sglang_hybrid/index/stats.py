"""The index's counters (``PrefixIndex.stats``), read by ``stats()``, the metrics and the replay."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class IndexStats:
    """The index's own counters: only changed by the index and its parts (``transfers``,
    ``host_eviction``); the binding and the coalescer keep theirs."""

    taps_published: int = 0
    endpoints_published: int = 0
    duplicate_publications: int = 0
    skipped_no_slot: int = 0
    device_evicted_backed: int = 0
    # A block's last copy dropped: ``unbacked`` while some live snapshot lay below it (a path a
    # request could have resumed through is lost), ``dead`` when none did (spec §9.3's dead KV,
    # on the device: nothing is lost). Unbacked tails count as unbacked (their snapshot goes).
    device_evicted_unbacked: int = 0
    device_evicted_dead: int = 0
    subtree_deletions: int = 0
    host_dead_swept: int = 0
    host_superseded_evicted: int = 0
    host_gdsf_evicted: int = 0  # step 3's victims, under either order
    host_learned_evicted: int = 0  # of those, the learned order's (``hit_density``)
    image_writes_refused: int = 0
    # The exclusive host (``demotion``): host copies of blocks the device holds, given up for
    # room (step 0), and blocks written to host ahead of their device eviction.
    host_duplicates_dropped: int = 0
    blocks_demoted: int = 0
