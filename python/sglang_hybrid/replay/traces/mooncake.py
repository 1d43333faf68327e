"""The Mooncake trace format (``../shared/traces/README.md``), token by token.

Contract: ``load_mooncake(path, seed=0, limit=None, time_scale=1.0) -> Trace``.
- One JSON object per line: ``timestamp`` (ms, >= 0), ``input_length`` (>= 1),
  ``output_length`` (>= 1), ``hash_ids`` (non-negative ints, one per 512-token block, the last
  block holding ``input_length - 512 * (len(hash_ids) - 1)`` tokens, between 1 and 512).
  Other fields are ignored and blank lines skipped; anything else that breaks these rules raises
  ``TraceFormatError`` with the file, the 1-based line and the reason (the field and the value
  found there for a bad field: ``lines.decode_line``).
- Every hash id stands for the same 512 token ids wherever it occurs (``hashed_tokens(seed, id)``,
  ids inside the tiny vocabulary), a full last block included. A partial last block is
  the request's own: its tokens come from a stream keyed by the line, not by the hash id, so it is
  never shared (the README's rule: the remapped id of a partial block says nothing about which
  prefix of the 512 tokens two requests share).
- Arrival is ``timestamp / 1000 * time_scale`` seconds; ``limit`` keeps the first requests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from ..errors import TraceFormatError
from ..tokens import hashed_tokens
from ..trace import Trace, TraceRequest
from .lines import decode_line

BLOCK_TOKENS = 512
_PRIVATE = 1 << 62  # streams at or above this are a request's own partial last block


class _Line(msgspec.Struct):
    """One line's fields and their bounds (other fields are ignored)."""

    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=1)]
    hash_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=_PRIVATE)]], msgspec.Meta(min_length=1)
    ]


_DECODER = msgspec.json.Decoder(_Line)


def _parse(text: str, path: Path, line: int) -> _Line:
    row = decode_line(_DECODER, text, path, line)
    n, ids = row.input_length, row.hash_ids
    last = n - BLOCK_TOKENS * (len(ids) - 1)
    if not 1 <= last <= BLOCK_TOKENS:
        raise TraceFormatError(
            path,
            line,
            f"{len(ids)} hash blocks cannot hold input_length {n} "
            f"(the last block would hold {last} tokens; expected 1..{BLOCK_TOKENS})",
        )
    return row


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
            row = _parse(text, p, line_no)
            n, ids = row.input_length, row.hash_ids
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
                    output_len=row.output_length,
                    arrival_s=row.timestamp / 1000.0 * time_scale,
                    tag="mooncake",
                )
            )
    return Trace(name=p.stem, requests=requests, source=str(p))
