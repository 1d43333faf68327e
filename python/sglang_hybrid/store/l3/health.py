"""Whether L3 is in use now: off after a failure, tried again with exponential backoff.

Losing L3 costs speed only (issue #39): a store that cannot be reached, answers too slowly or
was killed turns L3 *off* (logged once, counted); the server keeps serving from device and host.
After ``backoff`` seconds one attempt is let through (a *trial*); a success turns L3 back on
(logged once), a failure doubles the wait, up to ``max_backoff``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Breaker:
    what: str  # how the log names the store
    first_backoff: float = 1.0
    max_backoff: float = 60.0
    up: bool = False  # nothing is known before the first connect
    backoff: float = 1.0
    retry_at: float = 0.0  # monotonic seconds: the next trial may start
    trial: bool = False  # an attempt while off is in flight
    logged: bool = False  # this outage was logged
    offs: int = 0  # times L3 went off
    reason: str = "not connected yet"

    def usable(self, now: float | None = None) -> bool:
        """Whether an attempt may start now (on, or a trial is due)."""
        if self.up:
            return True
        now = time.monotonic() if now is None else now
        return not self.trial and now >= self.retry_at

    @property
    def first_attempt(self) -> bool:
        """Neither up nor failed yet: the first connection is still being made."""
        return not self.up and not self.logged and self.offs == 0

    def begin(self) -> None:
        """An attempt starts; while off it is the trial."""
        if not self.up:
            self.trial = True

    def ok(self) -> None:
        if not self.up:
            logger.info("L3 %s is in use%s", self.what, " again" if self.offs else "")
        self.up, self.trial, self.logged = True, False, False
        self.backoff, self.reason = self.first_backoff, ""

    def fail(self, reason: str, now: float | None = None) -> None:
        """An attempt failed: off (logged once per outage), the next trial after the backoff."""
        now = time.monotonic() if now is None else now
        if self.up:
            self.offs += 1
            self.backoff = self.first_backoff
            logger.warning(
                "L3 %s is off: %s; serving from device and host, retrying in %.0f s",
                self.what,
                reason,
                self.backoff,
            )
        elif not self.logged:
            logger.warning(
                "L3 %s is not in use: %s; serving from device and host, retrying in %.0f s",
                self.what,
                reason,
                self.backoff,
            )
        else:
            self.backoff = min(self.max_backoff, self.backoff * 2)
        self.up, self.trial, self.logged, self.reason = False, False, True, reason
        self.retry_at = now + self.backoff
