"""SplitRule: an exact tap ends its prefill pass only where the split pays (issue #36).

An exact tap the model worker cannot capture inside the pass (no in-pass capture on the worker,
or a position off the pass's capture grid) can only be taken by ending the pass there: one more
forward pass, with its launch, its read of the weights and its scheduler round
(``CostModel.split_seconds``, the fixed cost the replay's clock prices per pass). What the split
buys is the tokens later requests resume past: with it they resume at the tap; without it at
``alt``, the deepest state they would find below it (the tap moved down to where the worker
captures inside the pass when it does, else the deepest anchor below: base, a snapshot on the
path, an accepted tap). The modelled saving is

    rate(source) * compute_seconds(alt, p - alt)

where ``rate`` is how often a published tap of that source was resumed from so far
(``SourceHits``: the planner's own per-source hit statistics) and ``compute_seconds`` the
geometry's prefill cost of the tokens in between (``index/cost.py``). The split is kept when the
saving exceeds ``threshold * split_seconds`` (``--hybrid-split-threshold``; 0 splits for every
tap, as before this rule). A declined tap is counted (``declined``, the binding's
``split_declined`` skip) and moved down as a flexible tap: to the worker's capture point below it
(``capture_point``: a pass-relative grid counts from the prompt's base in the first pass; the
snapshot there carries the partial block as its tail) or, without in-pass capture, to the block
grid, where a pass end may realise it; it is dropped when nothing is left below it.

Statistics: ``SourceHits`` (``source_hits.py``, shared with GDSF's prior) counts publications
and resumes per ``TapSource`` value, by counts, never time. Before evidence a source is assumed
to be hit once per tap (the old behaviour, split). Declining every tap of a source would freeze
its estimate (declined taps are never published), so every ``EXPLORE_EVERY``-th declined
decision of a source splits anyway.

API for other planners (prompt-end taps, issue #37): :meth:`SplitRule.pays` decides one tap;
:meth:`SplitRule.apply` rewrites a planned list; ``note_published`` / ``note_hit`` feed the
statistics (``PrefixIndex`` calls them). Pure Python, no I/O, O(taps) per plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .keys import BLOCK_TOKENS
from .source_hits import N_KEYS, SourceHits
from .taps import Tap, TapSource

EXPLORE_EVERY = 16  # every 16th declined decision of a source splits anyway


class SplitRule:
    """Whether an exact tap is worth a split pass (see the module contract)."""

    __slots__ = ("_asked", "cost", "declined", "exact_tail", "grid", "hits", "threshold")

    def __init__(
        self,
        cost: CostModel,
        *,
        threshold: float = 1.0,
        grid: int = 0,
        exact_tail: bool = True,
        hits: SourceHits | None = None,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"split threshold must be >= 0, got {threshold}")
        self.cost = cost
        self.threshold = threshold  # 0: every exact tap splits
        # The worker's in-pass capture grid: 0 none (split), 1 any position, g > 1 positions
        # a multiple of g past the pass's start (``ReqState.capture_grid``).
        self.grid = grid
        self.exact_tail = exact_tail  # the prompt-tail tap is exact (``--hybrid-tail-tap``)
        self.hits = hits if hits is not None else SourceHits()  # the index's, shared with GDSF
        self.declined = 0  # splits declined, over the rule's life (the binding counts the skips)
        self._asked = [0] * N_KEYS  # declined decisions per source (exploration)

    def captures(self, position: int, base: int) -> bool:
        """The worker is expected to capture ``position`` inside a pass (``capture_point``)."""
        return self.grid > 0 and self.capture_point(position, base) == position

    def _realised(self, tap: Tap, base: int) -> bool:
        """A planned tap will be taken: it splits, or the worker captures it in the pass."""
        return tap.exact or self.captures(tap.position, base)

    def capture_point(self, position: int, base: int) -> int:
        """The deepest position at or below ``position`` the worker captures inside a pass
        (-1: none). A grid ``g > 1`` counts from the pass's start: the prompt's base within the
        first pass (``cost.chunk_tokens`` past it), the block grid after (a chunked prefill's
        later passes start where the previous one ended, on the block grid)."""
        g = self.grid
        if g == 1:
            return position
        if g <= 0:
            return -1
        if position - base < self.cost.chunk_tokens:
            return base + g * ((position - base) // g)
        return position - position % g

    def saving(self, source: int, position: int, alt: int) -> float:
        """Modelled seconds a split at ``position`` saves later requests (``alt``: where they
        would resume without it)."""
        if position <= alt:
            return 0.0
        return self.hits.rate(source) * self.cost.compute_seconds(alt, position - alt)

    def pays(self, source: int, position: int, alt: int) -> bool:
        """The split at ``position`` pays: its modelled saving exceeds ``threshold`` times the
        cost of one more pass (or the exploration turn of this source came up)."""
        if self.threshold == 0.0:
            return True
        if self.saving(source, position, alt) > self.threshold * self.cost.split_seconds():
            return True
        if 0 < source < N_KEYS:
            self._asked[source] += 1
            if self._asked[source] % EXPLORE_EVERY == 0:
                return True
        return False

    def apply(self, taps: Sequence[Tap], *, base: int, existing: Sequence[int] = ()) -> list[Tap]:
        """The planner's taps (sorted) with each split the rule declines moved down to the grid
        as a flexible tap (or dropped); the prompt tail (planned exact at n - 1, issue #37) goes
        to the grid as a flexible tap unless ``exact_tail``."""
        out: list[Tap] = []
        anchors = sorted({base, *existing})
        for tap in taps:
            p = tap.position
            if tap.source is TapSource.TAIL and not self.exact_tail:
                # --hybrid-tail-tap flexible: the tail where a pass ends anyway, on the grid.
                q = p - p % BLOCK_TOKENS
                if q > base and all(t.position != q for t in out):
                    out.append(Tap(q, False, tap.boundary, tap.source))
                continue
            # A tail reaching here is exact (``exact_tail``), whatever the planner floored.
            exact = tap.exact or tap.source is TapSource.TAIL
            if not exact or self.captures(p, base):
                out.append(tap._replace(exact=exact))
                continue
            # Only taps that will exist: a flexible one off the capture grid (a declined tap's
            # fallback, a ladder rung) is realised only where a pass happens to end. Counted,
            # a follow-up tap declined 63 tokens below the prompt tail made the tail look
            # worth 63 tokens, and both were lost (issue #37's chat replay).
            below = max(
                [q for q in anchors if q < p]
                + [t.position for t in out if t.position < p and self._realised(t, base)]
            )
            # Declined, the tap moves down to where the worker captures (a pass on the grid or
            # a pass end realises it otherwise); requests diverging at p resume there.
            point = self.capture_point(p, base) if self.grid else p - p % BLOCK_TOKENS
            alt = point if self.grid and point > below else below
            if self.pays(int(tap.source), p, alt):
                out.append(tap._replace(exact=True))
                continue
            self.declined += 1
            if point > below and all(t.position != point for t in out):
                out.append(Tap(point, False, tap.boundary, tap.source))
        out.sort()
        return out
