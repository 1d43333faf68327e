"""Our session trace format: token ids, sessions and turns, dependencies, answers and hints.

Contract: JSON Lines, one request per line, in release order (a request may only wait for
requests on earlier lines). Fields:

=============  ========  ==================================================================
field          required  meaning
=============  ========  ==================================================================
rid            yes       unique request id (string)
input_ids      yes       prompt token ids, ints in [0, 2048)
output_ids     one of    the answer, token for token (later prompts may echo it)
output_length  one of    answer length when the answer is not scripted
arrival_ms     one of    absolute arrival time (ms, >= 0): open loop
after          one of    rid or list of rids this request waits for: closed loop
delay_ms       no        with ``after``: released this long after the last of them finished
session, turn  no        session id (string) and turn number (int), for reports
hints          no        {"positions": [...], "kinds": [...]}: tap hints, positions in (0, n],
                         kinds explicit / opener / structural / automatic / message
tag            no        what the request is (tool_step, retry, subagent, ...)
=============  ========  ==================================================================

``load_sessions(path)`` raises ``TraceFormatError`` (file, 1-based line, reason) on the first
malformed line; blank lines are skipped. ``write_sessions(trace, path)`` writes a trace so that
``load_sessions`` reads it back equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceFormatError
from ..tokens import VOCAB_SIZE
from ..trace import HINT_KINDS, Trace, TraceRequest

_KNOWN = {
    "rid",
    "input_ids",
    "output_ids",
    "output_length",
    "arrival_ms",
    "after",
    "delay_ms",
    "session",
    "turn",
    "hints",
    "tag",
}


class _Line:
    """Field checks for one line; every failure names the line."""

    def __init__(self, path: Path, line: int, obj: dict[str, Any]) -> None:
        self.path, self.line, self.obj = path, line, obj

    def fail(self, reason: str) -> TraceFormatError:
        return TraceFormatError(self.path, self.line, reason)

    def tokens(self, name: str) -> np.ndarray:
        v = self.obj[name]
        if not isinstance(v, list) or not v:
            raise self.fail(f"{name} must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise self.fail(f"{name} must hold integers only")
        arr = np.asarray(v, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
            bad = int(arr[(arr < 0) | (arr >= VOCAB_SIZE)][0])
            raise self.fail(f"{name}: token id {bad} outside the vocabulary [0, {VOCAB_SIZE})")
        return arr.astype(np.int32)

    def number(self, name: str) -> float:
        v = self.obj[name]
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise self.fail(f"{name} must be a number >= 0, got {v!r}")
        return float(v)

    def integer(self, name: str, low: int) -> int:
        v = self.obj[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(f"{name} must be an integer >= {low}, got {v!r}")
        return v

    def string(self, name: str) -> str:
        v = self.obj[name]
        if not isinstance(v, str) or not v:
            raise self.fail(f"{name} must be a non-empty string, got {v!r}")
        return v


def _request(p: _Line, seen: set[str]) -> TraceRequest:
    obj = p.obj
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        raise p.fail(f"unknown field(s) {', '.join(unknown)}")
    for name in ("rid", "input_ids"):
        if name not in obj:
            raise p.fail(f"missing field {name}")
    rid = p.string("rid")
    if rid in seen:
        raise p.fail(f"duplicate rid {rid!r}")
    ids = p.tokens("input_ids")
    if ("output_ids" in obj) == ("output_length" in obj):
        raise p.fail("give exactly one of output_ids and output_length")
    script = p.tokens("output_ids") if "output_ids" in obj else None
    out_len = len(script) if script is not None else p.integer("output_length", 1)
    if ("arrival_ms" in obj) == ("after" in obj):
        raise p.fail("give exactly one of arrival_ms (open loop) and after (closed loop)")
    arrival = p.number("arrival_ms") / 1000.0 if "arrival_ms" in obj else None
    after: tuple[str, ...] = ()
    if "after" in obj:
        raw = obj["after"]
        after = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, list) else ()
        if not after or not all(isinstance(a, str) for a in after):
            raise p.fail("after must be a rid or a non-empty list of rids")
        missing = [a for a in after if a not in seen]
        if missing:
            raise p.fail(f"after names {missing}, which no earlier line defines")
    elif "delay_ms" in obj:
        raise p.fail("delay_ms needs after")
    delay = p.number("delay_ms") / 1000.0 if "delay_ms" in obj else 0.0
    positions: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()
    if "hints" in obj:
        h = obj["hints"]
        if not isinstance(h, dict) or set(h) - {"positions", "kinds"}:
            raise p.fail('hints must be {"positions": [...], "kinds": [...]}')
        pos, kd = h.get("positions", []), h.get("kinds", [])
        if not isinstance(pos, list) or not isinstance(kd, list) or len(pos) != len(kd):
            raise p.fail("hints.positions and hints.kinds must be lists of equal length")
        for q in pos:
            if isinstance(q, bool) or not isinstance(q, int) or not 0 < q <= len(ids):
                raise p.fail(f"hint position {q!r} outside (0, {len(ids)}]")
        for k in kd:
            if k not in HINT_KINDS:
                raise p.fail(f"hint kind {k!r} is not one of {', '.join(HINT_KINDS)}")
        positions, kinds = tuple(pos), tuple(kd)
    return TraceRequest(
        rid=rid,
        input_ids=ids,
        output_len=out_len,
        arrival_s=arrival,
        after=after,
        delay_s=delay,
        output_ids=script,
        hint_positions=positions,
        hint_kinds=kinds,
        session=p.string("session") if "session" in obj else None,
        turn=p.integer("turn", 0) if "turn" in obj else None,
        tag=p.string("tag") if "tag" in obj else "",
    )


def load_sessions(path: str | os.PathLike[str], *, limit: int | None = None) -> Trace:
    """Read a session trace (see the module contract)."""
    src = Path(path)
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    with src.open() as f:
        for line_no, text in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise TraceFormatError(src, line_no, f"not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(src, line_no, "expected a JSON object")
            req = _request(_Line(src, line_no, obj), seen)
            seen.add(req.rid)
            requests.append(req)
    return Trace(name=src.stem, requests=requests, source=str(src))


def _record(r: TraceRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"rid": r.rid}
    if r.session is not None:
        out["session"] = r.session
    if r.turn is not None:
        out["turn"] = r.turn
    if r.tag:
        out["tag"] = r.tag
    if r.arrival_s is not None:
        out["arrival_ms"] = r.arrival_s * 1000.0
    else:
        out["after"] = list(r.after)
        out["delay_ms"] = r.delay_s * 1000.0
    out["input_ids"] = r.input_ids.tolist()
    if r.output_ids is not None:
        out["output_ids"] = r.output_ids.tolist()
    else:
        out["output_length"] = r.output_len
    if r.hint_positions:
        out["hints"] = {"positions": list(r.hint_positions), "kinds": list(r.hint_kinds)}
    return out


def write_sessions(trace: Trace | Iterable[TraceRequest], path: str | os.PathLike[str]) -> Path:
    """Write requests in the session format; return the path."""
    requests = trace.requests if isinstance(trace, Trace) else trace
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with dst.open("w") as f:
        for r in requests:
            f.write(json.dumps(_record(r), separators=(",", ":")) + "\n")
    return dst
