"""Snapshot kinds as clients and operators see them: one vocabulary for the boundary API's
``checkpoints[].kind`` (``boundaries.py``) and the ``kind`` label of the snapshot gauge
(``metrics.py``), so a dashboard and an API answer name a snapshot the same way (issue #38).

A kind says why the snapshot exists: ``endpoint`` (a request finished there) or the tap rule
that placed it (``index.TapSource``, recorded as the snapshot's ``origin``); ``tap`` /
``boundary`` when the reason was not recorded (a snapshot loaded from ``--hybrid-cache-file``).
A new tap rule names itself here; ``test_kinds.py`` fails for a ``TapSource`` without a name.
"""

from __future__ import annotations

from typing import Any

from ..index import SnapshotKind, TapSource

# Each tap rule's name; protocol-automatic markers plan like structural ones.
ORIGIN_NAMES: dict[TapSource, str] = {
    TapSource.EXPLICIT: "explicit",
    TapSource.BRANCH: "branch",
    TapSource.OPENER: "opener",
    TapSource.STRUCTURAL: "structural",
    TapSource.AUTOMATIC: "structural",
    TapSource.FOLLOWUP: "follow-up",
    TapSource.TAIL: "tail",
    TapSource.LADDER: "ladder",
}
ENDPOINT = "endpoint"
UNRECORDED_TAP = "tap"
UNRECORDED_BOUNDARY = "boundary"
# Every name a snapshot can have, in a stable order (the gauge exports each from the start).
KINDS: tuple[str, ...] = (
    ENDPOINT,
    *dict.fromkeys(ORIGIN_NAMES.values()),
    UNRECORDED_TAP,
    UNRECORDED_BOUNDARY,
)
_BY_ORIGIN = {int(k): v for k, v in ORIGIN_NAMES.items()}


def kind_name(s: Any) -> str:
    """The kind of snapshot ``s`` (an ``index.Snapshot``)."""
    if s.kind is SnapshotKind.ENDPOINT:
        return ENDPOINT
    if s.origin:
        return _BY_ORIGIN.get(int(s.origin), UNRECORDED_TAP)
    return UNRECORDED_BOUNDARY if s.kind is SnapshotKind.BOUNDARY else UNRECORDED_TAP
