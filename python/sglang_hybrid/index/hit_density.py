"""Hit density: the host tier's victim by the traffic's reuse ages (issue #37, beyond §9.3).

GDSF's inflation L makes its order recency among snapshots of equal value: the snapshot used
longest ago goes first. That is right when reuse comes soonest after a use (heavy-tailed think
times: a conversation idle for an hour is probably over) and wrong when it does not: with think
times spread over minutes, a conversation idle for eight minutes comes back *sooner* than one
that just answered, and LRU keeps the wrong ones (the hint-less chat replay of
``docs/benchmarks.md``: Belady's order keeps half again as much). Neither shape is known in
advance, so the order is learned: LHD (Beckmann, Chen, Cidon, NSDI 2018) ranks an object by its
*hit density*, the hits it is expected to get per unit of space and time, from two histograms
over age: how old snapshots were when resumed from (hits) and when evicted (ends without one):

    density(a) = sum_{x >= a} hits(x) / sum_{x >= a} (hits(x) + evictions(x)) * (x - a)

(expected hits over expected remaining lifetime, for a snapshot that reached age ``a``). On
reuse that decays with age this is decreasing, and the order is LRU's; on reuse that peaks late
it keeps the old and lets the young go; past the oldest age ever resumed from it is 0.

A learned order must see past its own evictions: once the order evicts at some age, no hit
beyond it is ever observed and the histograms would confirm the order that made them (under
LRU, that reuse never comes late). So an evicted snapshot's anchor block is remembered (a
*ghost*, by lookup hash, as ``newcomers.GhostBlocks`` remembers blocks): when a later request
commits that block again, the snapshot would have been resumed from at that age, and its
eviction is counted as that hit instead. Every ghost a request passes is credited: a tap above
a conversation's last state would have served it had the state gone alone.

Neither order wins everywhere (the Mooncake replay reuses less under the learned one: its
reuse is many requests sharing prefixes, where GDSF's recency and frequency serve), so the two
duel, as a CPU cache's insertion policies do (Qureshi et al., ISCA 2007), by regret: a victim
met again (its ghost recalled) sooner than the cache's usual eviction age would have been a
hit had it been kept. The order with fewer such returns per eviction decides; every
``EXPLORE_EVERY``-th eviction step the other does, so both keep being measured.

Ages count requests (lanes opened since the snapshot's publication or last hit), never time:
every TP rank sees the same stream and takes the same victim. Bins are geometric, eight to an
octave, so short and long reuse both resolve. Histograms are kept per class: the snapshot's
origin (``source_hits.key_of``: endpoints, prompt-end taps, ladder rungs...) and how often its
lineage was resumed from (LHD's frequency classes: 0, 1, 2, 3, 4-5, 6-8, 9-15, 16+), each also
pooled over origins; a class with too few events reads the pooled one of its frequency, then the
pool of all. The frequency is the lineage's, not the snapshot's (``Snapshot.lineage_hits``): each
turn of a conversation, each repeat of a prompt, publishes a new snapshot, so a snapshot's own
hits never pass one, while the turns behind it can say whether it comes back (the chat
replay's sessions run 2-12 turns, so one that ran ten is near its end; on the Mooncake trace a
prompt sent twice is usually sent again). With it (main at 28579d9, before the host's protected
class) the chat replay reused 51.4 % (51.1 % without), 49.4 % (48.3 %) on another seed, and
Mooncake 33.5 % (32.9 %); the offline model
(``benchmark/replay/placement_model.py``: no ghosts, so fewer events per class) gains at 96 GiB
and loses a point at 48 and 128 (``docs/benchmarks.md``). Before
``WARM`` events GDSF decides: a cache's first minutes have no ages to learn from.

The victim: the lowest ``density * C / Z`` (GDSF's cost and size: compute saved per byte) among
``SAMPLE`` candidates drawn deterministically from the host's candidates
(``GdsfQueue.sample``), as LHD samples; O(SAMPLE) per eviction step, never O(snapshots).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Any

from .source_hits import N_KEYS

OCTAVE_BINS = 8  # age bins per doubling
# Bin lower edges: 0, 1, 2, ... then about 2^(k/8), up to 2^24 requests (the last bin is open).
EDGES: tuple[int, ...] = tuple(sorted({0, *(int(2 ** (k / OCTAVE_BINS)) for k in range(24 * 8))}))
N_BINS = len(EDGES)
WIDTHS: tuple[int, ...] = tuple(
    (EDGES[i + 1] - EDGES[i]) if i + 1 < N_BINS else EDGES[-1] for i in range(N_BINS)
)
WARM = 256  # events (hits + evictions) before the learned order replaces GDSF's
CLASS_EVENTS = 64  # a class with fewer events reads a pooled one
HALF_LIFE = 4096  # events after which old counts weigh half (traffic changes)
SAMPLE = 64  # candidates compared per eviction step (LHD's sample size)
GHOSTS = 4096  # evicted snapshots remembered at most, oldest forgotten first
EXPLORE_EVERY = 16  # eviction steps per step taken by the order that is not preferred
GDSF, LEARNED = 0, 1  # the duelling orders
# ``--hybrid-host-order``: which order decides once ``ready`` (GDSF always decides before).
HOST_ORDERS: dict[str, int | None] = {"duel": None, "gdsf": GDSF, "learned": LEARNED}
# Frequency classes by resumes of the lineage (``lineage_hits``): 0, 1, 2, 3, 4-5, 6-8, 9-15, 16+.
FREQ_EDGES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 9, 16)
FREQS = len(FREQ_EDGES)
ANY = FREQS  # ... and the class of every frequency
POOLED = N_KEYS  # the key of every origin
N_CLASSES = (N_KEYS + 1) * (FREQS + 1)


def age_bin(age: int) -> int:
    return bisect.bisect_right(EDGES, age) - 1 if age > 0 else 0


def _class(key: int, freq: int) -> int:
    return key * (FREQS + 1) + freq


def freq_class(hits: int) -> int:
    return bisect.bisect_right(FREQ_EDGES, hits) - 1 if hits > 0 else 0


def classes_of(key: int, hits: int) -> tuple[int, ...]:
    """The histograms an event of a snapshot of ``key`` resumed from ``hits`` times counts in."""
    f = freq_class(hits)
    pooled = (_class(POOLED, f), _class(POOLED, ANY))
    return (_class(key, f), _class(key, ANY), *pooled) if 0 <= key < N_KEYS else pooled


class HitDensity:
    """Hits and evictions by age bin per class; densities recomputed for changed classes."""

    __slots__ = (
        "_density",
        "_dirty",
        "events",
        "evict_age",
        "evictions",
        "fixed",
        "ghosts",
        "hits",
        "mass",
        "regret",
        "steps",
        "victims",
    )

    def __init__(self, order: str = "duel") -> None:
        if order not in HOST_ORDERS:
            raise ValueError(f"host order {order!r}: give one of {', '.join(HOST_ORDERS)}")
        self.fixed = HOST_ORDERS[order]  # None: the duel decides
        self.hits = [[0.0] * N_BINS for _ in range(N_CLASSES)]  # note_hit, recall
        self.evictions = [[0.0] * N_BINS for _ in range(N_CLASSES)]  # note_eviction, recall
        self.mass = [0.0] * N_CLASSES  # decayed events per class
        self.events = 0  # over the life of the histograms: WARM and the halving
        self._density = [[0.0] * N_BINS for _ in range(N_CLASSES)]
        self._dirty: set[int] = set()  # classes changed since their densities were computed
        # anchor lookup hash -> (key, hits, used_at, eviction bin, order, evicted at)
        self.ghosts: OrderedDict[int, tuple[int, int, int, int, int, int]] = OrderedDict()
        # The duel: victims and early returns per order (decayed with the histograms), the
        # mean age at eviction (what "early" means), eviction steps decided.
        self.victims = [0.0, 0.0]
        self.regret = [0.0, 0.0]
        self.evict_age = 0.0
        self.steps = 0

    @property
    def ready(self) -> bool:
        return self.events >= WARM

    def preferred(self) -> int:
        """The order with fewer early returns per victim (ties: GDSF, the spec's)."""
        g, x = self.victims
        return LEARNED if self.regret[LEARNED] * (g + 1) < self.regret[GDSF] * (x + 1) else GDSF

    def order(self) -> int:
        """The order of the next eviction step: GDSF until ``ready``, then the duel's (or the
        operator's, ``fixed``)."""
        if not self.ready:
            return GDSF
        if self.fixed is not None:
            return self.fixed
        self.steps += 1
        best = self.preferred()
        return best if self.steps % EXPLORE_EVERY else 1 - best

    def note_hit(self, key: int, hits: int, age: int) -> None:
        """A snapshot resumed from ``hits`` times before was resumed from at ``age``."""
        self._note(self.hits, classes_of(key, hits), age_bin(age))

    def note_eviction(
        self, key: int, hits: int, used_at: int, now: int, anchor_hash: int, order: int
    ) -> None:
        """A snapshot last used at ``used_at``, chosen by ``order``, left the host at ``now``
        (requests); ``anchor_hash`` 0: nothing to remember it by (the root)."""
        age = now - used_at
        b = age_bin(age)
        self._note(self.evictions, classes_of(key, hits), b)
        self.victims[order] += 1.0
        self.evict_age += (age - self.evict_age) / 64.0  # a mean over the last ~64 victims
        if anchor_hash:
            self.ghosts[anchor_hash] = (key, hits, used_at, b, order, now)
            if len(self.ghosts) > GHOSTS:
                self.ghosts.popitem(last=False)

    def recall(self, anchor_hash: int, now: int) -> None:
        """A request commits block ``anchor_hash`` (``now``: requests so far): if an evicted
        snapshot was anchored there, its eviction becomes the hit it would have been."""
        ghost = self.ghosts.pop(anchor_hash, None)
        if ghost is None:
            return
        key, hits, used_at, b, order, evicted_at = ghost
        if now - evicted_at < self.evict_age:
            self.regret[order] += 1.0  # back before a kept snapshot would have been evicted
        hit_bin = age_bin(now - used_at)
        for c in classes_of(key, hits):
            self.evictions[c][b] = max(0.0, self.evictions[c][b] - 1.0)
            self.hits[c][hit_bin] += 1.0
            self._dirty.add(c)

    def _note(self, hist: list[list[float]], classes: tuple[int, ...], b: int) -> None:
        for c in classes:
            hist[c][b] += 1.0
            self.mass[c] += 1.0
            self._dirty.add(c)
        self.events += 1
        if self.events % HALF_LIFE == 0:
            for h in (*self.hits, *self.evictions):
                for i in range(N_BINS):
                    h[i] *= 0.5
            self.mass = [x * 0.5 for x in self.mass]
            self.victims = [x * 0.5 for x in self.victims]
            self.regret = [x * 0.5 for x in self.regret]
            self._dirty.update(range(N_CLASSES))

    def density(self, key: int, hits: int, age: int) -> float:
        """Expected resumes per request of residence, at ``age``, of a snapshot of ``key``
        resumed from ``hits`` times: from the first of its classes with enough events."""
        f = freq_class(hits)
        c = _class(key, f) if 0 <= key < N_KEYS else _class(POOLED, f)
        if self.mass[c] < CLASS_EVENTS:
            c = _class(POOLED, f)
            if self.mass[c] < CLASS_EVENTS:
                c = _class(POOLED, ANY)
        if c in self._dirty:
            self._recompute(c)
        return self._density[c][age_bin(age)]

    # ================================================================ across restarts
    def export_state(self, now: int) -> dict[str, Any]:
        """What a restart keeps (``--hybrid-cache-file``): the histograms (non-zero bins), the
        duel's counts and the ghosts, their times made relative to ``now`` (requests so far: a
        restarted index counts from 0). Plain JSON values; :meth:`restore_state` reads them."""

        def sparse(hist: list[list[float]]) -> list[list[float]]:
            return [[c, b, v] for c, row in enumerate(hist) for b, v in enumerate(row) if v]

        return {
            "shape": [N_CLASSES, N_BINS],
            "hits": sparse(self.hits),
            "evictions": sparse(self.evictions),
            "mass": list(self.mass),
            "events": self.events,
            "victims": list(self.victims),
            "regret": list(self.regret),
            "evict_age": self.evict_age,
            "steps": self.steps,
            "ghosts": [
                [h, key, hits, used - now, b, order, at - now]
                for h, (key, hits, used, b, order, at) in self.ghosts.items()
            ],
        }

    def restore_state(self, state: dict[str, Any], now: int) -> None:
        """Take :meth:`export_state`'s values (ghost times rebased on ``now``); ValueError, and
        nothing changed, when they do not fit this version's classes and bins or are malformed."""
        try:
            if [int(x) for x in state["shape"]] != [N_CLASSES, N_BINS]:
                raise ValueError(
                    f"classes x bins {state['shape']}, this version's {N_CLASSES} x {N_BINS}"
                )
            hists: list[list[list[float]]] = []
            for name in ("hits", "evictions"):
                hist = [[0.0] * N_BINS for _ in range(N_CLASSES)]
                for entry in state[name]:
                    c, b, v = int(entry[0]), int(entry[1]), float(entry[2])
                    if not (0 <= c < N_CLASSES and 0 <= b < N_BINS and 0.0 <= v < float("inf")):
                        raise ValueError(f"{name}: bin ({c}, {b}) = {v} out of range")
                    hist[c][b] = v
                hists.append(hist)
            mass = [float(x) for x in state["mass"]]
            victims = [float(x) for x in state["victims"]]
            regret = [float(x) for x in state["regret"]]
            if len(mass) != N_CLASSES or len(victims) != 2 or len(regret) != 2:
                raise ValueError("mass, victims or regret of another length")
            ghosts: OrderedDict[int, tuple[int, int, int, int, int, int]] = OrderedDict()
            for h, key, hits, used, b, order, at in state["ghosts"][-GHOSTS:]:
                ghosts[int(h)] = (
                    int(key),
                    int(hits),
                    int(used) + now,
                    int(b),
                    int(order),
                    int(at) + now,
                )
            events, evict_age, steps = (
                int(state["events"]),
                float(state["evict_age"]),
                int(state["steps"]),
            )
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"malformed learned state: {type(e).__name__}: {e}") from None
        self.hits, self.evictions = hists
        self.mass, self.victims, self.regret = mass, victims, regret
        self.ghosts, self.events, self.evict_age, self.steps = ghosts, events, evict_age, steps
        self._dirty = set(range(N_CLASSES))

    def _recompute(self, c: int) -> None:
        self._dirty.discard(c)
        hits, ends, out = self.hits[c], self.evictions[c], self._density[c]
        h = e = life = 0.0
        for b in range(N_BINS - 1, -1, -1):  # from the oldest: what lies beyond each age
            h += hits[b]
            e += hits[b] + ends[b]
            life += e * WIDTHS[b]
            out[b] = h / life if life > 0.0 else 0.0
