"""What each checkpoint is called: the rule that made it (issue #37).

``/hybrid/boundaries`` names every resume point by the rule that made its snapshot; metrics and
reports that count checkpoints by kind read the same table, so a name is written once. The
planner's sources (``taps.TapSource``) are the rules of spec §7.1 and beyond it; an endpoint is
§7.7's; a snapshot with no recorded origin (adopted from a saved host tier, which keeps no origin)
is named by its kind. Read-only: nothing decides by these names.
"""

from __future__ import annotations

from .snapshot import SnapshotKind
from .taps import TapSource

SOURCE_NAMES: dict[TapSource, str] = {
    TapSource.EXPLICIT: "explicit",
    TapSource.BRANCH: "branch",
    TapSource.OPENER: "opener",
    TapSource.STRUCTURAL: "structural",
    TapSource.AUTOMATIC: "automatic",
    TapSource.FOLLOWUP: "follow-up",
    TapSource.TAIL: "tail",
    TapSource.LADDER: "ladder",
    TapSource.COALESCE: "coalesce",
}
# Every name ``checkpoint_kind`` returns.
CHECKPOINT_KINDS: tuple[str, ...] = ("endpoint", *SOURCE_NAMES.values(), "boundary", "tap")


def checkpoint_kind(kind: SnapshotKind, origin: int) -> str:
    """The rule that made a snapshot: ``endpoint``, the planner's source, else (no origin
    recorded: adopted after a restart) ``boundary`` or ``tap``."""
    if kind is SnapshotKind.ENDPOINT:
        return "endpoint"
    if origin in _BY_VALUE:
        return SOURCE_NAMES[_BY_VALUE[origin]]
    return "boundary" if kind is SnapshotKind.BOUNDARY else "tap"


_BY_VALUE = {int(s): s for s in TapSource}
