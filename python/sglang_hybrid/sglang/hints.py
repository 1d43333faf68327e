"""Tap hints carried by a request (spec §7.1, §8.3).

Source, decided: SGLang's ``kv_hints`` envelope (``GenerateReqInput.kv_hints``, forwarded untouched
to ``Req.kv_hints``), one action of type ``sglang_hybrid.taps`` whose payload holds
``positions`` (token frontiers) and optionally ``kinds`` of the same length, each one of
``explicit`` (a client breakpoint, priority 1), ``opener``, ``structural``, ``automatic`` or
``message``. It is the only generic per-request field SGLang carries to the scheduler that is not
part of the cache key (``extra_key`` / ``cache_salt`` would split the cache). Chat requests get
their hints from the chat template in the server process (see ``docs/sglang-backend.md``);
``/generate`` and Engine callers may send the envelope themselves.

A malformed action is ignored with one warning: a hint can only add reuse, never fail a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..index import HintKind, TapHint

logger = logging.getLogger(__name__)

ACTION_TYPE = "sglang_hybrid.taps"
# ``POST /hybrid/checkpoint`` (issue #16): publish the endpoint wherever the request ends, even
# within a block of another snapshot (the 64-token spacing rule of §7.7 is for ordinary requests).
CHECKPOINT_ACTION = "sglang_hybrid.checkpoint"
_KINDS = {
    "explicit": HintKind.EXPLICIT,
    "opener": HintKind.OPENER,
    "structural": HintKind.STRUCTURAL,
    "automatic": HintKind.AUTOMATIC,
    "message": HintKind.MESSAGE,
}


def make_envelope(positions: list[int], kinds: list[str] | None = None) -> dict[str, Any]:
    """A ``kv_hints`` envelope carrying tap hints, for /generate and Engine callers."""
    payload: dict[str, Any] = {"positions": [int(p) for p in positions]}
    if kinds is not None:
        payload["kinds"] = list(kinds)
    return {
        "protocol_version": "1",
        "message_id": "",
        "actions": [
            {
                "action_id": "taps",
                "action_type": ACTION_TYPE,
                "action_version": "1",
                "payload": payload,
            }
        ],
    }


def checkpoint_envelope() -> dict[str, Any]:
    """The ``kv_hints`` envelope of a checkpoint request (its endpoint is always published)."""
    return {
        "protocol_version": "1",
        "message_id": "",
        "actions": [
            {
                "action_id": "checkpoint",
                "action_type": CHECKPOINT_ACTION,
                "action_version": "1",
                "payload": {},
            }
        ],
    }


def pins_endpoint(req: Any) -> bool:
    """Whether ``req`` carries the checkpoint action."""
    envelope = getattr(req, "kv_hints", None)
    if envelope is None:
        return False
    return any(_get(a, "action_type") == CHECKPOINT_ACTION for a in _get(envelope, "actions") or ())


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def tap_hints(req: Any, n: int) -> list[TapHint]:
    """Hints of a ``Req`` within ``[1, n]``; [] when it carries none."""
    envelope = getattr(req, "kv_hints", None)
    if envelope is None:
        return []
    out: list[TapHint] = []
    for action in _get(envelope, "actions") or ():
        if _get(action, "action_type") != ACTION_TYPE:
            continue
        payload = _get(action, "payload") or {}
        try:
            positions = [int(p) for p in payload.get("positions", ())]
            kinds = payload.get("kinds") or ["explicit"] * len(positions)
            if len(kinds) != len(positions):
                raise ValueError(f"{len(kinds)} kinds for {len(positions)} positions")
            out.extend(
                TapHint(p, _KINDS[k]) for p, k in zip(positions, kinds, strict=True) if 0 < p <= n
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            logger.warning(
                "ignoring malformed %s hint on request %s: %s",
                ACTION_TYPE,
                getattr(req, "rid", "?"),
                e,
            )
    return out
