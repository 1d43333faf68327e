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


class InflightPrefixes(Generic[T]):
    """Prompts in flight, in admission order; ``sibling`` finds the earliest deepest sharer.

    One index serves every pass (the admission window changes little between passes): a walk
    starts with ``begin`` and ``add``s its prompts in order; an owner entered at the same position
    in an earlier walk is kept as it is (O(1)), the first one that differs drops every entry from
    its position on (O(their new blocks)). Lookups see only entries below the walk's position, so
    a walk sees exactly what a fresh index built by the same adds would hold.
    """

    def __init__(self) -> None:
        # block hash -> (position, owner, prompt) of the first prompt holding it
        self._first: dict[int, tuple[int, T, PromptKey]] = {}
        # per position: the owner's id, its prompt length and the hashes it entered first
        self._order: list[tuple[Hashable, int, list[int]]] = []
        self._pos = 0  # entries at positions >= _pos are not part of this walk (yet)

    def begin(self) -> None:
        """Start a walk: nothing is visible until it is added again."""
        self._pos = 0

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
            if order[pos][0] == owner_id and order[pos][1] == key.n:
                return  # the same prompt at the same place: its entries stand
            self._truncate(pos)
        blocks = key.full_blocks
        if not blocks:
            order.append((owner_id, key.n, []))
            return
        first = self._first
        hashes = key.ensure_hashes(blocks)
        held = _deepest(hashes, first.__contains__) if first else -1
        new = hashes[held + 1 :]
        first.update(dict.fromkeys(new, (pos, owner, key)))
        order.append((owner_id, key.n, new))

    def _truncate(self, pos: int) -> None:
        first, order = self._first, self._order
        while len(order) > pos:
            for h in order.pop()[2]:
                first.pop(h, None)  # a colliding hash may have been entered twice

    def sibling(self, key: PromptKey) -> Sibling | None:
        """The earlier prompt sharing the most full blocks with ``key`` (None: not one block)."""
        blocks = key.full_blocks
        if not blocks or not self._first or not self._pos:
            return None
        hashes, first, pos = key.ensure_hashes(blocks), self._first, self._pos

        def visible(h: int) -> bool:
            e = first.get(h)
            return e is not None and e[0] < pos

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
    waiting prompts hold (plus ``FOLD_SLACK``): a fold costs O(its removed hashes), O(1) per
    removed block amortised, and the hashes kept whose count is zero never outnumber the live
    prompts' blocks plus the slack.
    """

    FOLD_SLACK = 4096

    def __init__(self) -> None:
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
        if self._removed_blocks > self._live_blocks + self.FOLD_SLACK:
            self._fold()

    def count(self, h: int) -> int:
        """Waiting prompts holding the block prefix whose chained hash is ``h``."""
        return self._added.get(h, 0) - self._removed.get(h, 0)

    def _fold(self) -> None:
        added = self._added
        for h, c in self._removed.items():
            left = added[h] - c
            if left:
                added[h] = left
            else:
                del added[h]
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
