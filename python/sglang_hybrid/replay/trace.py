"""What a replay consumes: requests with token ids, arrival rules, scripted outputs and hints.

Contract:
- ``TraceRequest`` is one request. Its release time is either absolute (``arrival_s``, open
  loop: Mooncake, bench_serving shapes) or relative (``after``: the rids it waits for, released
  ``delay_s`` after the last of them finished, closed loop: an agent waits for its tool, a user
  for the answer). Exactly one of the two is set.
- ``output_ids`` (when set) is what the model answers, token for token; the replay worker emits
  exactly these tokens, so a later prompt that echoes them (agent loops) matches what the cache
  holds. ``output_tokens(req)`` is the answer for every request: the script, else
  ``output_len`` tokens hashed from the rid (never a special or EOS id, so requests run to
  their length).
- ``hint_positions`` / ``hint_kinds`` are the template's tap hints (``sglang_hybrid.sglang.hints``
  kinds: explicit, opener, structural, automatic, message), positions in ``(0, n]``.
- ``Trace`` is a named list of requests; ``check_trace`` validates the whole (unique rids,
  ``after`` pointing at earlier requests, token ids inside the vocabulary) and raises
  ``ReplayError`` naming the request. ``first(trace, n)`` keeps the first ``n`` requests whose
  dependencies are kept.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import ReplayError
from .tokens import VOCAB_SIZE, hashed_tokens

HINT_KINDS: tuple[str, ...] = ("explicit", "opener", "structural", "automatic", "message")
_OUTPUT_SEED = 0x5EED0  # unscripted answers: their own token stream, apart from any prompt's


@dataclass(slots=True)
class TraceRequest:
    rid: str
    input_ids: np.ndarray  # int32 token ids
    output_len: int
    arrival_s: float | None = None
    after: tuple[str, ...] = ()
    delay_s: float = 0.0
    output_ids: np.ndarray | None = None
    hint_positions: tuple[int, ...] = ()
    hint_kinds: tuple[str, ...] = ()
    session: str | None = None
    turn: int | None = None
    tag: str = ""  # what the request is (tool step, retry, subagent, ...): per-tag breakdowns

    @property
    def n(self) -> int:
        return len(self.input_ids)


class Trace(NamedTuple):
    name: str
    requests: list[TraceRequest]
    source: str  # a path or the generator call that produced it


def check_trace(trace: Trace) -> None:
    """Raise ``ReplayError`` when the trace cannot be replayed (see the module contract)."""
    seen: set[str] = set()
    for r in trace.requests:
        where = f"trace {trace.name!r}, request {r.rid!r}"
        if r.rid in seen:
            raise ReplayError(f"{where}: duplicate rid")
        if (r.arrival_s is None) == (not r.after):
            raise ReplayError(f"{where}: set exactly one of arrival_s and after")
        missing = [a for a in r.after if a not in seen]
        if missing:
            raise ReplayError(f"{where}: waits for {missing}, which do not come earlier")
        if r.n < 1:
            raise ReplayError(f"{where}: empty prompt")
        if r.input_ids.min() < 0 or r.input_ids.max() >= VOCAB_SIZE:
            raise ReplayError(f"{where}: token ids outside [0, {VOCAB_SIZE})")
        if r.output_len < 1:
            raise ReplayError(f"{where}: output_len must be at least 1")
        if r.output_ids is not None and len(r.output_ids) != r.output_len:
            raise ReplayError(
                f"{where}: {len(r.output_ids)} scripted ids, output_len {r.output_len}"
            )
        if len(r.hint_positions) != len(r.hint_kinds):
            raise ReplayError(f"{where}: hint positions and kinds differ in length")
        bad = [k for k in r.hint_kinds if k not in HINT_KINDS]
        if bad:
            raise ReplayError(f"{where}: unknown hint kinds {bad}")
        seen.add(r.rid)


def output_tokens(req: TraceRequest) -> np.ndarray:
    """The tokens ``req`` answers with: its script, else ``output_len`` ids hashed from its rid."""
    if req.output_ids is not None:
        return req.output_ids
    stream = zlib.crc32(req.rid.encode()) | (len(req.rid) << 32)
    return hashed_tokens(_OUTPUT_SEED, stream, req.output_len)


def kv_tokens(req: TraceRequest) -> np.ndarray:
    """Prompt plus answer tokens that end up with KV (the last answer token is never fed back)."""
    return np.concatenate([req.input_ids, output_tokens(req)[:-1]])


def first(trace: Trace, n: int) -> Trace:
    """The first ``n`` requests, skipping any that waits for a request not kept."""
    kept: list[TraceRequest] = []
    seen: set[str] = set()
    for r in trace.requests:
        if len(kept) >= n:
            break
        if all(a in seen for a in r.after):
            kept.append(r)
            seen.add(r.rid)
    return Trace(trace.name, kept, f"{trace.source} [first {n}]")
