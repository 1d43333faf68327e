"""Snapshot links (spec §9.3): each snapshot's nearest snapshot above on its path (``ancestor``)
and the snapshots that record it as theirs (``dependents``).

C of a snapshot is measured from its nearest retained ancestor, so the links are kept exact as
snapshots come and go; ``valuation`` finds them by walking the tree. These functions are the
only writers of the two fields; :class:`~.prefix_index.PrefixIndex` calls them when it enters or
deletes a snapshot.
"""

from __future__ import annotations

from . import valuation as val
from .snapshot import Snapshot


def link(s: Snapshot) -> None:
    """Link a snapshot just listed at its anchor: its ancestor, and the dependents it takes over."""
    s.ancestor = val.find_ancestor(s)
    for d in val.find_dependents(s):
        _relink(d, s)
    if s.ancestor is not None:
        s.ancestor.dependents.append(s)


def unlink(s: Snapshot) -> None:
    """Unlink a snapshot being deleted: its dependents go to its ancestor."""
    for d in list(s.dependents):
        _relink(d, s.ancestor)
    if s.ancestor is not None:
        s.ancestor.dependents.remove(s)
    s.ancestor = None


def _relink(d: Snapshot, new_ancestor: Snapshot | None) -> None:
    if d.ancestor is not None:
        d.ancestor.dependents.remove(d)
    d.ancestor = new_ancestor
    if new_ancestor is not None:
        new_ancestor.dependents.append(d)
