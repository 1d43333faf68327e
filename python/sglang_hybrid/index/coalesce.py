"""In-flight prefix coalescing (spec §12.2): wait for a sibling's state instead of recomputing.

Requests that arrive together with a *new* shared prefix (fan-out workers on one document,
bench_serving's groups, subagents started at once) find nothing in the cache: each would prefill
the shared prefix itself. Coalescing holds a later request while an earlier one (its *sibling*:
being prefilled, or ahead of it in the waiting queue) computes the prefix and publishes a snapshot
at the divergence; the held request is then admitted from that snapshot.

``InflightPrefixes`` finds the sibling. Block lookup hashes are chained (``keys``), so a hash at
depth b stands for the whole prefix of b + 1 blocks and "some earlier prompt has block b" is
monotone in b: the deepest shared block is a binary search over dictionary probes, O(log n) per
request after O(blocks) to index it. Hashes only select; the shared prefix is confirmed by
comparing bytes before it is trusted.

``coalesce_target`` decides (spec §12.2): the target is the block boundary floor(d / 64) * 64
below the divergence d, at most n - 1 for both prompts; wait only when the sibling has not passed
it yet and the prefill it saves is worth more than the extra pass the sibling's cut may cost.
``PrefixDemand`` looks further ahead, beyond the spec: a multiset of the block hashes of every
prompt in the waiting queue. When a request is planned, the deepest block boundary it shares with
another waiting prompt is a place a later request provably resumes from, so it becomes an exact
Boundary tap (the branch-point rule of ``taps.py`` with the queue as its evidence): the group's
later members, admitted passes later, resume there instead of recomputing the shared prefix. A
hash collision can only misplace such a tap, never produce a hit: hits compare bytes.

Pure Python; the caller owns the scheduler side (holding requests, adding the sibling's cut).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, KeysView
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from .cost import CostModel
from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey

T = TypeVar("T")


class Shared(NamedTuple):
    tokens: int  # a block multiple
    others: int  # other waiting prompts holding that whole prefix


class Sibling(NamedTuple):
    owner: Any  # the caller's handle of the earlier request
    key: PromptKey
    shared: int  # tokens both prompts share, a multiple of 64


@dataclass(slots=True, eq=False)
class _Entry:
    owner_id: Hashable  # names the owner across walks (a request id, never ``id()``)
    seq: int  # rank in walk order: entries are kept sorted by it
    owner: Any
    key: PromptKey
    entered: list[int]  # the hashes this entry holds first in ``_first``
    depth: int  # the shallowest block whose hash is in ``entered`` (when it holds any)


class InflightPrefixes(Generic[T]):
    """Prompts in flight, in admission order; ``sibling`` finds the earliest deepest sharer.

    One index serves every pass (the admission window changes little between passes): a walk
    starts with ``begin`` and ``add``s its prompts in order. An owner entered at the same place
    in an earlier walk is kept as it is (O(1)). Owners of the earlier walk that this walk skips
    (the window's head was admitted) leave: their hashes go, and the later entries take over the
    ones they share (O(left blocks + a membership test per later block)). Any other difference
    (an owner the earlier walk did not have here) drops every entry from that place on and enters
    the new ones (O(their blocks)). Lookups see only entries this walk has added, so a walk sees
    exactly what a fresh index built by the same adds would hold.
    """

    def __init__(self) -> None:
        # block hash -> (seq, owner, prompt) of the earliest entry holding it
        self._first: dict[int, tuple[int, T, PromptKey]] = {}
        self._order: list[_Entry] = []  # sorted by seq
        self._pos = 0  # entries at positions >= _pos are not part of this walk (yet)
        self._visible = 0  # lookups see entries with seq < _visible
        self._seq = 0

    def begin(self) -> None:
        """Start a walk: nothing is visible until it is added again."""
        self._pos = self._visible = 0

    def add(self, owner_id: Hashable, owner: T, key: PromptKey) -> None:
        """Enter ``key``'s full blocks at the walk's next position (earlier prompts keep their
        entries). ``owner_id`` names the owner across walks (a request id, never ``id()``).

        Presence along one prompt's chained hashes is prefix-closed (a hash was entered with all
        the hashes before it), so the blocks already held are a prefix, found by binary search,
        and the rest are all new: one dict update instead of a setdefault per block.
        """
        pos, order = self._pos, self._order
        self._pos = pos + 1
        if pos < len(order):
            for j in range(pos, len(order)):
                if order[j].owner_id == owner_id:
                    break
            else:
                j = -1
            if j >= 0 and order[j].key.n == key.n:
                if j > pos:
                    self._leave(pos, j)
                self._visible = order[pos].seq + 1
                return  # the same prompt, still in order: its entries stand
            self._truncate(pos)
        seq = self._seq
        self._seq = seq + 1
        self._visible = seq + 1
        blocks = key.full_blocks
        if not blocks:
            order.append(_Entry(owner_id, seq, owner, key, [], 0))
            return
        first = self._first
        hashes = key.ensure_hashes(blocks)
        held = _deepest(hashes, first.__contains__) if first else -1
        new = hashes[held + 1 :]
        first.update(dict.fromkeys(new, (seq, owner, key)))
        order.append(_Entry(owner_id, seq, owner, key, new, held + 1))

    def _leave(self, pos: int, end: int) -> None:
        """Entries [pos, end) leave; later entries take over the hashes they held first.

        A later entry holds every hash of its prompt that it did not find entered (``add``), so
        after the leavers' hashes go, the ones a later prompt shares are exactly its hashes now
        missing: entered again in seq order, each by the earliest prompt holding it. Only a
        prompt through a leaver's shallowest entered block can miss any (hashes are chained).
        """
        first, order = self._first, self._order
        probes: list[tuple[int, int]] = []  # (depth, hash) of each leaver's shallowest entry
        for e in order[pos:end]:
            if e.entered:
                probes.append((e.depth, e.key.hashes[e.depth]))
            for h in e.entered:
                if (held := first.get(h)) is not None and held[0] == e.seq:
                    del first[h]
        del order[pos:end]
        for e in order[pos:]:  # ``add`` hashed each entry's full blocks: ``hashes`` is them
            hashes = e.key.hashes
            through = [d for d, h in probes if d < len(hashes) and hashes[d] == h]
            if not through:
                continue
            missing = [h for h in hashes if h not in first]
            if missing:
                first.update(dict.fromkeys(missing, (e.seq, e.owner, e.key)))
                e.depth = min(through) if not e.entered else min(e.depth, *through)
                e.entered.extend(missing)

    def _truncate(self, pos: int) -> None:
        first, order = self._first, self._order
        while len(order) > pos:
            for h in order.pop().entered:
                first.pop(h, None)  # a colliding hash may have been entered twice

    def sibling(self, key: PromptKey) -> Sibling | None:
        """The earlier prompt sharing the most full blocks with ``key`` (None: not one block)."""
        blocks = key.full_blocks
        if not blocks or not self._first or not self._visible:
            return None
        hashes, first, limit = key.ensure_hashes(blocks), self._first, self._visible

        def visible(h: int) -> bool:
            e = first.get(h)
            return e is not None and e[0] < limit

        lo = _deepest(hashes, visible)
        if lo < 0:
            return None
        _, owner, other = first[hashes[lo]]
        end = (lo + 1) * BLOCK_BYTES
        if key.data[:end] != other.data[:end]:
            return None  # a hash collision: never trust it
        return Sibling(owner, other, (lo + 1) * BLOCK_TOKENS)


class PrefixDemand(Generic[T]):
    """How many waiting prompts hold each block prefix.

    A prompt's count is ``_added[h] - _removed[h]``: both are Counters fed whole hash lists, which
    ``Counter.update`` counts in C (a waiting queue of long prompts enters and leaves ~240 blocks
    per request). ``_removed`` is folded into ``_added`` once it has received more blocks than the
    waiting prompts hold (plus ``fold_slack``): a fold costs O(its removed hashes), O(1) per
    removed block amortised, and the hashes kept whose count is zero never outnumber the live
    prompts' blocks plus the slack.
    """

    def __init__(self, fold_slack: int = 4096) -> None:
        self.fold_slack = fold_slack
        self._added: Counter[int] = Counter()
        self._removed: Counter[int] = Counter()
        self._removed_blocks = 0  # blocks entered into ``_removed`` since the last fold
        self._live_blocks = 0  # full blocks of the prompts waiting now
        self._keys: dict[T, PromptKey] = {}

    def __contains__(self, owner: object) -> bool:
        return owner in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def owner_set(self) -> KeysView[T]:
        """The owners as a set view (set algebra with it runs in C)."""
        return self._keys.keys()

    def add(self, owner: T, key: PromptKey) -> None:
        if owner in self._keys:
            return
        self._keys[owner] = key
        self._added.update(key.ensure_hashes(key.full_blocks))
        self._live_blocks += key.full_blocks

    def discard(self, owner: T) -> None:
        key = self._keys.pop(owner, None)
        if key is None:
            return
        self._live_blocks -= key.full_blocks
        if not self._keys:  # the queue drained: nothing is demanded
            self._added.clear()
            self._removed.clear()
            self._removed_blocks = 0
            return
        self._removed.update(key.hashes[: key.full_blocks])
        self._removed_blocks += key.full_blocks
        if self._removed_blocks > self._live_blocks + self.fold_slack:
            self._fold()

    def count(self, h: int) -> int:
        """Waiting prompts holding the block prefix whose chained hash is ``h``."""
        return self._added.get(h, 0) - self._removed.get(h, 0)

    def _fold(self) -> None:
        # One comprehension over ``_added`` (O(live blocks + slack), which the fold's trigger
        # bounds by the removed blocks): Counter's per-key ``__delitem__`` is Python code.
        removed = self._removed.get
        self._added = Counter({h: v for h, c in self._added.items() if (v := c - removed(h, 0))})
        self._removed.clear()
        self._removed_blocks = 0

    def shared(self, key: PromptKey, *, self_counted: bool) -> Shared:
        """The longest prefix ``key`` shares with at least one other waiting prompt."""
        blocks = key.full_blocks
        if not blocks:
            return Shared(0, 0)
        need = 2 if self_counted else 1
        hashes, count = key.ensure_hashes(blocks), self.count
        lo = _deepest(hashes, lambda h: count(h) >= need)
        if lo < 0:
            return Shared(0, 0)
        return Shared((lo + 1) * BLOCK_TOKENS, count(hashes[lo]) - need + 1)


def _deepest(hashes: list[int], holds: Callable[[int], bool]) -> int:
    """The deepest block b with ``holds(hashes[b])``, -1 if none; ``holds`` must be monotone in b
    (true up to some block, false after), which chained hashes make it for prefix membership."""
    if not hashes or not holds(hashes[0]):
        return -1
    lo, hi = 0, len(hashes) - 1  # invariant: holds(hashes[lo])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(hashes[mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def coalesce_target(
    shared: int,
    *,
    n: int,
    sibling_n: int,
    sibling_done: int,
    servable: int,
    cost: CostModel,
) -> int | None:
    """The frontier to wait for, or None to admit now (spec §12.2).

    ``shared``: tokens the prompts share (block multiple); ``n`` / ``sibling_n``: prompt lengths;
    ``sibling_done``: tokens the sibling has computed; ``servable``: the frontier the cache can
    resume this request from now.
    """
    target = min(shared, n - 1, sibling_n - 1)
    target -= target % BLOCK_TOKENS
    if target <= servable or target <= sibling_done:
        return None  # nothing to gain, or the sibling is past it (its snapshot exists or never)
    if not worth_a_split(cost, servable, target):
        return None
    return target


def worth_a_split(cost: CostModel, base: int, target: int) -> bool:
    """Whether resuming at ``target`` instead of ``base`` saves more than the extra pass a cut at
    ``target`` may cost (the pass's fixed cost is paid either way, so it is left out)."""
    return target > base and cost.compute_seconds(base, target - base) > cost.chunk_s
