"""Opportunities the backend let go, counted by kind and logged at most once a minute per kind.

A snapshot is optional (spec §9.2) and a restore may fall back to recomputing, so none of these is
an error; but each one is reuse a later request will miss, and an operator must be able to see
them (issue #11): in ``HybridRadixCache.stats()``, the replay report and the log.

Kinds:

- ``tap_no_slot``: a planned tap found no device snapshot slot worth taking (GDSF kept the
  resident ones);
- ``tap_no_tail_page``: an exact tap inside a block found no KV page for its tail copy even after
  evicting cached blocks;
- ``tap_over_budget``: a planned tap was dropped by ``--hybrid-taps-per-request``;
- ``split_declined``: an exact tap the worker cannot capture inside the pass did not end it,
  its modelled saving being below ``--hybrid-split-threshold`` times a pass's cost
  (``index/split_rule.py``); it moved down to the grid or was dropped;
- ``restore_abandoned``: a host restore found no device room or its copy failed (the request
  resumed from a device source or recomputed);
- ``write_through_failed``: a host write copy failed (the blocks or the image stay device-only);
- ``recomputed_held``: a request prefilled tokens a tier held a state for (``recomputed_tokens``
  adds them up).

The log's clock is the wall clock; it only paces messages and never feeds a cache decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("sglang_hybrid.skips")

KINDS = (
    "tap_no_slot",
    "tap_no_tail_page",
    "tap_over_budget",
    "split_declined",
    "restore_abandoned",
    "write_through_failed",
    "recomputed_held",
)
LOG_EVERY_S = 60.0


class Skips:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.recomputed_tokens = 0
        self._clock = clock
        self._logged_at: dict[str, float] = {}
        self._since_log: dict[str, int] = dict.fromkeys(KINDS, 0)

    def note(self, kind: str, detail: str = "", count: int = 1) -> None:
        """Count ``count`` skips of ``kind``; log the first, then at most once a minute."""
        if kind not in self.counts:
            raise ValueError(f"unknown skip kind {kind!r} (one of {', '.join(KINDS)})")
        self.counts[kind] += count
        self._since_log[kind] += count
        now = self._clock()
        last = self._logged_at.get(kind)
        if last is None or now - last >= LOG_EVERY_S:
            n = self._since_log[kind]
            logger.warning(
                "sglang-hybrid skipped %d× %s%s (total %d)%s",
                n,
                kind,
                "" if last is None else " in the last minute",
                self.counts[kind],
                f": {detail}" if detail else "",
            )
            self._logged_at[kind] = now
            self._since_log[kind] = 0

    def as_dict(self) -> dict[str, int]:
        return {**self.counts, "recomputed_tokens": self.recomputed_tokens}
