"""SourceHits: how often a snapshot of each origin was resumed from, learned (issues #36, #37).

Keys are ``TapSource`` values for planned taps and ``ENDPOINT`` (0) for endpoints (§7.7). Two
readers: the split rule prices a split by the expected resumes of its tap's source, and with a
host tier GDSF values a new snapshot by them (``prior``, ``PrefixIndex.prior_of``): a class of
snapshots the traffic never resumes from (learned follow-up taps on hint-less chat, endpoints of
a template that re-renders its answers) then goes before one it does, instead of weighing as a
snapshot expected to be hit once.

Counts only, halved every ``HALF_LIFE`` publications (traffic changes; never time: every TP rank
sees the same stream). Before evidence a key is assumed to be resumed from once per snapshot
(``PRIOR_*``: the behaviour before it learned). O(1) per event.
"""

from __future__ import annotations

from .snapshot import SnapshotKind
from .taps import TapSource

PRIOR_TAPS = 4.0  # pseudo-publications per key before evidence
PRIOR_RATE = 1.0  # ... each assumed to be resumed from once (the old behaviour)
HALF_LIFE = 1024  # publications (all keys) after which old counts weigh half
ENDPOINT = 0  # the key of endpoints (TapSource values start at 1)
N_KEYS = max(int(s) for s in TapSource) + 1
# GDSF's frequency prior stays within [MIN_PRIOR, 1]: at most the old "1 +" (a source hit many
# times per snapshot does not outrank hits that happened), and never 0, so cost and size still
# order the snapshots of a source that is rarely resumed from.
MIN_PRIOR = 1.0 / 16


def key_of(kind: SnapshotKind, origin: int) -> int:
    """The statistics' key of a snapshot: its planned source, or ``ENDPOINT``; -1 for neither
    (a tap whose source is unknown, e.g. adopted after a restart)."""
    if kind is SnapshotKind.ENDPOINT:
        return ENDPOINT
    return origin if 0 < origin < N_KEYS else -1


class SourceHits:
    """Publications and resumes per key (``key_of``; -1 is ignored)."""

    __slots__ = ("events", "hits", "published")

    def __init__(self) -> None:
        self.published = [0.0] * N_KEYS  # only note_published changes it
        self.hits = [0.0] * N_KEYS  # only note_hit changes it
        self.events = 0  # publications over the counter's life (drives the halving)

    def note_published(self, key: int) -> None:
        if not 0 <= key < N_KEYS:
            return
        self.events += 1
        if self.events % HALF_LIFE == 0:
            self.published = [x * 0.5 for x in self.published]
            self.hits = [x * 0.5 for x in self.hits]
        self.published[key] += 1.0

    def note_hit(self, key: int) -> None:
        if 0 <= key < N_KEYS:
            self.hits[key] += 1.0

    def rate(self, key: int) -> float:
        """Expected resumes per published snapshot of this key."""
        if not 0 <= key < N_KEYS:
            return PRIOR_RATE
        return (self.hits[key] + PRIOR_TAPS * PRIOR_RATE) / (self.published[key] + PRIOR_TAPS)

    def prior(self, key: int) -> float:
        """GDSF's expected uses of a new snapshot of this key (see the module docstring)."""
        return min(1.0, max(MIN_PRIOR, self.rate(key)))
