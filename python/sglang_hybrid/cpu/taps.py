"""The state-tap protocol between a prefix cache and the CPU workers.

A cache may want the recurrent state of a request at an absolute position ``p`` that lies
strictly inside the extend the worker is about to run (not at its end: the cache copies
chunk-end states itself). Protocol:

- Before the forward, ``req.hybrid_state_taps`` (the attribute may be absent) is a list of
  ``(p, dst_slot)`` pairs; ``dst_slot`` is a ``MambaPool`` slot index already translated, i.e.
  an index into the ``mamba_cache`` tensors.
- For each pair with ``prefix_len < p < prefix_len + extend_len`` the worker makes the conv and
  recurrent state of every linear-attention layer after the first ``p`` tokens available in
  ``dst_slot``, laid out exactly as in the request's own slot, and appends ``p`` to
  ``req.hybrid_state_taps_done`` (creating the list if absent).
- Pairs outside that range are left alone, and the list itself is never modified.

This module only selects and records taps; ``model_worker.py`` realises them inside its one
model call per request (``capture.py``) and ``token_worker.py`` records them as done without
computing anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

TAPS_ATTR = "hybrid_state_taps"
TAPS_DONE_ATTR = "hybrid_state_taps_done"


class StateTap(NamedTuple):
    """One requested copy: the state after ``position`` tokens into ``dst_slot``."""

    position: int
    dst_slot: int


def taps_inside(req: Any, prefix_len: int, extend_len: int) -> tuple[StateTap, ...]:
    """The request's taps strictly inside ``(prefix_len, prefix_len + extend_len)``, by position.

    The common case (no taps) returns the empty tuple without allocating.
    """
    taps = getattr(req, TAPS_ATTR, None)
    if not taps:
        return ()
    end = prefix_len + extend_len
    return tuple(sorted(StateTap(int(p), int(slot)) for p, slot in taps if prefix_len < p < end))


def mark_tap_done(req: Any, position: int) -> None:
    """Record that the state at ``position`` was copied (appends to ``hybrid_state_taps_done``)."""
    done = getattr(req, TAPS_DONE_ATTR, None)
    if done is None:
        done = []
        setattr(req, TAPS_DONE_ATTR, done)
    done.append(position)
