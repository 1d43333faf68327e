"""The Mooncake trace format (``../shared/traces/README.md``), token by token.

Contract: ``load_mooncake(path, seed=0, limit=None, time_scale=1.0) -> Trace``.
- One JSON object per line: ``timestamp`` (ms, >= 0), ``input_length`` (>= 1),
  ``output_length`` (>= 1), ``hash_ids`` (non-negative ints, one per 512-token block, the last
  block holding ``input_length - 512 * (len(hash_ids) - 1)`` tokens, between 1 and 512).
  Blank lines are skipped; anything else that breaks these rules raises ``TraceFormatError`` with
  the file, the 1-based line and the reason.
- Every hash id stands for the same 512 token ids wherever it occurs (``hashed_tokens(seed, id)``,
  ids inside the tiny vocabulary), a full last block included. A partial last block is
  the request's own: its tokens come from a stream keyed by the line, not by the hash id, so it is
  never shared (the README's rule: the remapped id of a partial block says nothing about which
  prefix of the 512 tokens two requests share).
- Arrival is ``timestamp / 1000 * time_scale`` seconds; ``limit`` keeps the first requests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import TraceFormatError
from ..tokens import hashed_tokens
from ..trace import Trace, TraceRequest

BLOCK_TOKENS = 512
_PRIVATE = 1 << 62  # streams at or above this are a request's own partial last block
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _int(value: object, name: str, low: int, path: Path, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceFormatError(path, line, f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _parse(text: str, path: Path, line: int) -> tuple[float, int, int, list[int]]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TraceFormatError(path, line, f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceFormatError(path, line, f"missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
        raise TraceFormatError(path, line, f"timestamp must be a number >= 0, got {ts!r}")
    n = _int(obj["input_length"], "input_length", 1, path, line)
    out = _int(obj["output_length"], "output_length", 1, path, line)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(path, line, "hash_ids must be a non-empty list")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < _PRIVATE:
            raise TraceFormatError(path, line, f"hash id {h!r} is not an integer in [0, 2**62)")
    last = n - BLOCK_TOKENS * (len(ids) - 1)
    if not 1 <= last <= BLOCK_TOKENS:
        raise TraceFormatError(
            path,
            line,
            f"{len(ids)} hash blocks cannot hold input_length {n} "
            f"(the last block would hold {last} tokens; expected 1..{BLOCK_TOKENS})",
        )
    return float(ts), n, out, ids


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> Trace:
    """Read a Mooncake JSONL trace into token-level requests (see the module contract)."""
    p = Path(path)
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    blocks: dict[int, np.ndarray] = {}
    requests: list[TraceRequest] = []
    with p.open() as f:
        for line_no, text in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            ts, n, out, ids = _parse(text, p, line_no)
            parts = []
            for h in ids[:-1]:
                b = blocks.get(h)
                if b is None:
                    b = blocks[h] = hashed_tokens(seed, h, BLOCK_TOKENS)
                parts.append(b)
            last = n - BLOCK_TOKENS * (len(ids) - 1)
            if last == BLOCK_TOKENS:
                b = blocks.get(ids[-1])
                if b is None:
                    b = blocks[ids[-1]] = hashed_tokens(seed, ids[-1], BLOCK_TOKENS)
                parts.append(b)
            else:
                parts.append(hashed_tokens(seed, _PRIVATE | line_no, last))
            requests.append(
                TraceRequest(
                    rid=f"mc{line_no}",
                    input_ids=np.concatenate(parts),
                    output_len=out,
                    arrival_s=ts / 1000.0 * time_scale,
                    tag="mooncake",
                )
            )
    return Trace(name=p.stem, requests=requests, source=str(p))
