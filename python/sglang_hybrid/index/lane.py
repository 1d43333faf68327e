"""Lanes: a running request as the index sees it (spec §6.4, §7.6-7.7).

A lane holds an active reference on every tree node of its committed prefix (``path``), remembers
the snapshot it resumed from and the last tap it published (both candidates for supersession,
§9.3), and whether it may leave anything in the cache at all (§7.7: disabled requests never insert).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .node import BlockNode
from .snapshot import Snapshot


@dataclass(slots=True, eq=False)
class Lane:
    """Every field is only changed by :class:`~.prefix_index.PrefixIndex`: set by ``open_lane``,
    ``path`` grown by ``commit``, ``last_tap`` / ``published`` by ``publish``, ``pinned`` emptied
    by ``unpin_sources``, ``path`` emptied and ``closed`` set by ``release``."""

    id: int
    enabled: bool  # False: the request was asked not to touch the cache (§7.7)
    prompt_n: int = 0  # the prompt's length, marked on its last nodes at release (followups)
    path: list[BlockNode] = field(default_factory=list)  # nodes of blocks [0, len(path))
    resumed_from: Snapshot | None = None
    resumed_from_endpoint: bool = False
    # It resumed from an earlier request's prompt-end tap and its prompt goes on past it: that
    # request's answer was re-rendered, not continued, and so will this one's be
    # (``supersession.lineage``).
    left_answer: bool = False
    last_tap: Snapshot | None = None
    pinned: list[Snapshot] = field(default_factory=list)  # snapshots this lane is copying from
    published: int = 0
    # Taps it published with a tail: their tails enter the LRU with its path at release (a tail
    # waiting there since mid-prefill was older than its own blocks, and went first).
    tails: list[Snapshot] = field(default_factory=list)
    closed: bool = False
