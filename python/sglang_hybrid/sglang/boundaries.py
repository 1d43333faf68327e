"""Where a cut keeps reuse: the boundary query, answered by each scheduler's cache (issue #16).

Requests travel SGLang's own control path. The HTTP routes (``http_api.py``) send a
``DumperControlReqInput(method="hybrid.<op>", body)`` through the tokenizer manager; SGLang hands
every control request to every TP rank's scheduler in the same order, and AROUND
``Scheduler.handle_dumper_control`` each answers ``hybrid.*`` methods from its own cache (other
methods go to SGLang's dumper as before). Rank zero of each DP group sends the reply. TP ranks
decide identically (``ranks.py``), so that reply says what every rank of its group holds. Reusing
that request type needs no new message class in any process; its body and reply are JSON-native.

Methods:

- ``hybrid.boundaries`` ``{"input_ids": [...], "cut": int | None, "snap_tolerance": int,
  "extra_key": str | None, "cache_salt": str | None}``: the resume points on the prompt's path
  and, for ``cut``, where the cut lands (``index.resume_points``). Read-only.
- ``hybrid.slots`` ``{"limit": int, "rid": str | None}``: llama.cpp's slots, here the sequences
  the cache saw finish most recently (``recent.Recent``), each with the resume points on its path.
- ``hybrid.pin`` / ``hybrid.unpin`` ``{"input_ids": [...], ...}``: make the snapshot at the
  prompt's end durable in the host tier, or release it (``index/durable.py``).

A bad body answers ``success=False`` with the reason; nothing here can stop the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..index import PromptKey
from ..index.checkpoint_kinds import checkpoint_kind
from ..index.durable import set_durable, why_not_pinnable
from ..index.node import FastResidency
from ..index.resume_points import ResumePoint, place_cut, resume_points
from .ranks import dp_rank
from .request import namespace_of, token_bytes

logger = logging.getLogger(__name__)

PREFIX = "hybrid."
BOUNDARIES = "hybrid.boundaries"
SLOTS = "hybrid.slots"
PIN = "hybrid.pin"
UNPIN = "hybrid.unpin"
DEFAULT_SNAP_TOLERANCE = 512  # shared/spec/cache-coherence.md: the harness's default


class QueryError(ValueError):
    """A request the cache cannot answer; its message goes back to the client with ``status``
    (400: the request is wrong, 404: nothing there, 409/503: the cache's state refuses it now),
    a stable ``code`` and the field at fault (``param``), as ``api_errors.ApiError`` answers."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def detail(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "param": self.param}


def around_dumper_control(orig: Any, scheduler: Any, recv_req: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``Scheduler.handle_dumper_control``: ``hybrid.*`` methods are ours."""
    method = getattr(recv_req, "method", None)
    if not isinstance(method, str) or not method.startswith(PREFIX):
        return orig(scheduler, recv_req, *args, **kw)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    try:
        answer = handle(scheduler.tree_cache, method, dict(recv_req.body or {}))
    except QueryError as exc:
        return DumperControlReqOutput(
            success=False, response=[{"error": exc.detail()}], error=str(exc)
        )
    except Exception as exc:  # a bug here must not take the scheduler down
        logger.exception("hybrid control request %s failed", method)
        return DumperControlReqOutput(success=False, response=[], error=f"internal error: {exc}")
    # Which DP rank answered: a client placing a request by its resume point (a router addressing
    # ``url@rank``, scaleout/placement.py) needs each rank's answer by its rank, not by reply order.
    answer["dp_rank"] = dp_rank() or 0
    return DumperControlReqOutput(success=True, response=[answer])


def handle(cache: Any, method: str, body: dict[str, Any]) -> dict[str, Any]:
    from .cache import HybridRadixCache

    if not isinstance(cache, HybridRadixCache) or cache.disable:
        raise QueryError(
            "this server does not run --radix-cache hybrid with caching enabled",
            status=404,
            code="hybrid_cache_off",
        )
    if method == BOUNDARIES:
        return boundaries(cache, body)
    if method == SLOTS:
        return slots(cache, body)
    if method in (PIN, UNPIN):
        return pin(cache, body, durable=method == PIN)
    raise QueryError(f"unknown method {method!r}")


def pin(cache: Any, body: dict[str, Any], *, durable: bool) -> dict[str, Any]:
    """Make the snapshot exactly at the prompt's end durable, or release it."""
    ids = _ids(body.get("input_ids"))
    points = resume_points(cache.index.tree, _key(ids, body))
    at = [p for p in points if p.position == len(ids)]
    if not at:
        raise QueryError(
            f"no checkpoint at {len(ids)}, the end of this prompt", status=404, code="no_checkpoint"
        )
    s = at[-1].snapshot
    if not durable and not s.durable:
        raise QueryError(
            f"the checkpoint at {len(ids)} is not durable: nothing to release",
            status=404,
            code="not_durable",
        )
    if durable and (why := why_not_pinnable(cache.index, s)) is not None:
        raise QueryError(f"not made durable: {why}", **_pin_refusal(cache, s))
    set_durable(cache.index, s, durable, expires=bool(body.get("expires")))
    return _point(at[-1])


def _pin_refusal(cache: Any, s: Any) -> dict[str, Any]:
    """Why a pin is refused, as a status: no host tier (400: the request cannot succeed on this
    server), its copies still landing (503 ``not_ready``: the route retries), over the pinned
    share (409: release pins first)."""
    if cache.index.host is None:
        return {"status": 400, "code": "no_host_tier", "param": "durable"}
    if not s.host_backed or any(
        n.host_state is not FastResidency.RESIDENT for n in _path(s.anchor)
    ):
        return {"status": 503, "code": "not_ready"}
    return {"status": 409, "code": "pin_limit"}


def _path(node: Any) -> Iterator[Any]:
    while node is not None and not node.is_root:
        yield node
        node = node.parent


def slots(cache: Any, body: dict[str, Any]) -> dict[str, Any]:
    limit = body.get("limit") or 16
    if not _is_int(limit) or limit < 1:
        raise QueryError(f"limit must be a positive integer, got {limit!r}")
    rid = body.get("rid")
    if rid is not None:
        key = cache.recent.get(str(rid))
        if key is None:
            raise QueryError(
                f"no recent sequence of request {rid!r}",
                status=404,
                code="no_such_request",
                param="rid",
            )
        chosen = [(str(rid), key)]
    else:
        chosen = cache.recent.newest(limit)
    out = []
    for i, (r, key) in enumerate(chosen):
        points = resume_points(cache.index.tree, key)
        out.append(
            {
                "id": i,
                "rid": r,
                "n_past": key.n,
                "checkpoints": [_point(p) for p in points],
                "checkpoint_state": "full",
            }
        )
    return {"slots": out}


def boundaries(cache: Any, body: dict[str, Any]) -> dict[str, Any]:
    ids = _ids(body.get("input_ids"))
    cut = body.get("cut")
    if cut is not None and (not _is_int(cut) or not 0 <= cut <= len(ids)):
        raise QueryError(f"cut must be a token position in [0, {len(ids)}], got {cut!r}")
    tolerance = body.get("snap_tolerance", DEFAULT_SNAP_TOLERANCE)
    if not _is_int(tolerance) or tolerance < 0:
        raise QueryError(f"snap_tolerance must be a non-negative integer, got {tolerance!r}")
    points = resume_points(cache.index.tree, _key(ids, body))
    deepest = points[-1] if points else None
    on_device = [p for p in points if p.tier == "device"]
    out: dict[str, Any] = {
        "prompt_tokens": len(ids),
        "reusable_now": {
            "tokens": deepest.position if deepest else 0,
            "tier": deepest.tier if deepest else None,
            "device_tokens": on_device[-1].position if on_device else 0,
        },
        "checkpoints": [_point(p) for p in points],
        "block_tokens": 64,
    }
    if cut is not None:
        placed = place_cut(points, cut, tolerance)
        out["cut"] = {
            "position": cut,
            "snap_tolerance": tolerance,
            "verdict": placed.verdict,
            "delta": placed.delta,
            "retained_prefix_tokens": placed.retained_prefix_tokens,
            "reason": placed.reason,
        }
    return out


def _key(ids: np.ndarray, body: dict[str, Any]) -> PromptKey:
    namespace = namespace_of(
        SimpleNamespace(extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
    )
    return PromptKey(token_bytes(ids), namespace=namespace)


def _point(p: ResumePoint) -> dict[str, Any]:
    s = p.snapshot
    return {
        "position": p.position,
        # The rule that made it (``index.checkpoint_kinds.CHECKPOINT_KINDS`` names them all).
        "kind": checkpoint_kind(s.kind, s.origin),
        "tier": p.tier,
        "full_state": True,
        "durable": s.durable,
    }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ids(raw: Any) -> np.ndarray:
    """The prompt as int64 ids, checked without a Python loop (this runs on the scheduler's
    thread; the HTTP route has already checked each id and said which one was wrong)."""
    if not isinstance(raw, list) or not raw:
        raise QueryError("input_ids must be a non-empty list of token ids")
    arr = np.asarray(raw)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= 1 << 31:
        raise QueryError("input_ids must be token ids (integers in [0, 2**31))")
    return arr.astype(np.int64)
