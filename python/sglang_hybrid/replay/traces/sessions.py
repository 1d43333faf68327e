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
malformed line; blank lines are skipped. Types and single-field bounds are the ``_Line`` struct's,
checked by msgspec as it decodes (``lines.py``); checks across fields and lines follow it.
``write_sessions(trace, path)`` writes a trace so that ``load_sessions`` reads it back equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, Meta, UnsetType

from ..errors import TraceFormatError
from ..tokens import VOCAB_SIZE
from ..trace import HINT_KINDS, Trace, TraceRequest
from .lines import decode_line

_Name = Annotated[str, Meta(min_length=1)]
_Ids = Annotated[list[int], Meta(min_length=1)]  # the vocabulary bound is checked with numpy
_Ms = Annotated[float, Meta(ge=0)]


class _Hints(msgspec.Struct, forbid_unknown_fields=True):
    positions: list[int] = []
    kinds: list[str] = []


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    """One line's fields, types and single-field bounds (UNSET: the field is absent)."""

    rid: _Name
    input_ids: _Ids
    output_ids: _Ids | UnsetType = UNSET
    output_length: Annotated[int, Meta(ge=1)] | UnsetType = UNSET
    arrival_ms: _Ms | UnsetType = UNSET
    after: str | Annotated[list[str], Meta(min_length=1)] | UnsetType = UNSET
    delay_ms: _Ms | UnsetType = UNSET
    session: _Name | UnsetType = UNSET
    turn: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    hints: _Hints | UnsetType = UNSET
    tag: _Name | UnsetType = UNSET


_DECODER = msgspec.json.Decoder(_Line)


def _request(row: _Line, seen: set[str], path: Path, line: int) -> TraceRequest:
    """The checks across fields and lines; ``row`` passed the per-field ones."""

    def fail(reason: str) -> TraceFormatError:
        return TraceFormatError(path, line, reason)

    def tokens(v: list[int], name: str) -> np.ndarray:
        arr = np.asarray(v, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
            bad = int(arr[(arr < 0) | (arr >= VOCAB_SIZE)][0])
            raise fail(f"{name}: token id {bad} outside the vocabulary [0, {VOCAB_SIZE})")
        return arr.astype(np.int32)

    if row.rid in seen:
        raise fail(f"duplicate rid {row.rid!r}")
    ids = tokens(row.input_ids, "input_ids")
    if (row.output_ids is UNSET) == (row.output_length is UNSET):
        raise fail("give exactly one of output_ids and output_length")
    script: np.ndarray | None = None
    if row.output_ids is not UNSET:
        script = tokens(row.output_ids, "output_ids")
        out_len = len(script)
    elif row.output_length is not UNSET:
        out_len = row.output_length
    if (row.arrival_ms is UNSET) == (row.after is UNSET):
        raise fail("give exactly one of arrival_ms (open loop) and after (closed loop)")
    arrival = None if row.arrival_ms is UNSET else row.arrival_ms / 1000.0
    after: tuple[str, ...] = ()
    if row.after is not UNSET:
        after = (row.after,) if isinstance(row.after, str) else tuple(row.after)
        missing = [a for a in after if a not in seen]
        if missing:
            raise fail(f"after names {missing}, which no earlier line defines")
    elif row.delay_ms is not UNSET:
        raise fail("delay_ms needs after")
    positions: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()
    if row.hints is not UNSET:
        pos, kd = row.hints.positions, row.hints.kinds
        if len(pos) != len(kd):
            raise fail("hints.positions and hints.kinds must be lists of equal length")
        for q in pos:
            if not 0 < q <= len(ids):
                raise fail(f"hint position {q!r} outside (0, {len(ids)}]")
        for k in kd:
            if k not in HINT_KINDS:
                raise fail(f"hint kind {k!r} is not one of {', '.join(HINT_KINDS)}")
        positions, kinds = tuple(pos), tuple(kd)
    return TraceRequest(
        rid=row.rid,
        input_ids=ids,
        output_len=out_len,
        arrival_s=arrival,
        after=after,
        delay_s=0.0 if row.delay_ms is UNSET else row.delay_ms / 1000.0,
        output_ids=script,
        hint_positions=positions,
        hint_kinds=kinds,
        session=None if row.session is UNSET else row.session,
        turn=None if row.turn is UNSET else row.turn,
        tag="" if row.tag is UNSET else row.tag,
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
            row = decode_line(_DECODER, text, src, line_no)
            req = _request(row, seen, src, line_no)
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
