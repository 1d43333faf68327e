"""A CPU worker that computes nothing: deterministic tokens, and a count of a model's work.

Contract:
- The next token of a request is a function of (rid, position of the generated token) only, in
  ``[TOKEN_FLOOR, vocab_size)`` and never an EOS id, so requests run to ``max_new_tokens`` and a
  cached run produces the same tokens as an uncached one.
- Each forward pass is summarised as a ``BatchWork``: extend tokens, attention pairs (for a
  request with ``prefix`` cached tokens and ``n`` new ones: ``prefix * n + n * (n + 1) / 2``;
  a decode step is ``n = 1``), decode requests and taps honoured. ``totals`` accumulates them;
  ``last`` holds the latest; ``history`` keeps every one only when ``keep_history`` is set, and
  ``on_batch`` (if set) is called with each. Work per pass is O(batch size) with no per-token
  Python work, so a trace replay at scale can use it.
- State taps (``taps.py``) inside an extend are recorded as done (no state exists to copy).
- Pools are SGLang's own; the deferred mamba copy-on-write / clear still runs (base class).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_hybrid.cpu.batch_spans import ReqSpan
from sglang_hybrid.cpu.mix import mix64
from sglang_hybrid.cpu.speculative import DraftSchedule, run_chain
from sglang_hybrid.cpu.taps import mark_tap_done, taps_inside
from sglang_hybrid.cpu.worker import ChainRequest, CpuTpWorker

# Token ids below this are left to special tokens (the tiny tokenizer puts its specials first).
TOKEN_FLOOR = 16


def deterministic_token(rid: str, position: int, vocab_size: int, eos_ids: frozenset[int]) -> int:
    """The token the token worker emits for request ``rid`` at absolute ``position``."""
    span = vocab_size - TOKEN_FLOOR
    token = TOKEN_FLOOR + mix64((zlib.crc32(rid.encode()) << 32) ^ position) % span
    while token in eos_ids:
        token = TOKEN_FLOOR + (token - TOKEN_FLOOR + 1) % span
    return token


class BatchWork(NamedTuple):
    """What one forward pass would have cost a real model."""

    mode: str
    num_reqs: int
    extend_tokens: int
    attention_pairs: int
    decode_reqs: int
    taps_done: int


@dataclass(slots=True)
class WorkTotals:
    """Running sums of ``BatchWork`` over a worker's lifetime."""

    batches: int = 0
    extend_batches: int = 0
    decode_batches: int = 0
    extend_tokens: int = 0
    attention_pairs: int = 0
    decode_reqs: int = 0
    taps_done: int = 0

    def add(self, work: BatchWork) -> None:
        self.batches += 1
        if work.decode_reqs and not work.extend_tokens:
            self.decode_batches += 1
        elif work.extend_tokens:
            self.extend_batches += 1
        self.extend_tokens += work.extend_tokens
        self.attention_pairs += work.attention_pairs
        self.decode_reqs += work.decode_reqs
        self.taps_done += work.taps_done


class TokenWorker(CpuTpWorker):
    """Stands in for ``TpModelWorker`` without a model (see the module contract)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vocab_size: int = int(self.model_config.vocab_size)
        if self.vocab_size <= TOKEN_FLOOR + 1:
            raise ValueError(f"vocab size {self.vocab_size} leaves no room for tokens")
        self.eos_ids: frozenset[int] = frozenset(self.model_config.hf_eos_token_id or ())
        self.totals = WorkTotals()
        self.last: BatchWork | None = None
        self.keep_history = False
        self.history: list[BatchWork] = []
        self.on_batch: Callable[[BatchWork], None] | None = None

    def _next_tokens(self, batch: Any, spans: list[ReqSpan]) -> torch.Tensor:
        is_decode = batch.forward_mode == ForwardMode.DECODE
        extend_tokens = attention_pairs = taps_done = 0
        tokens = []
        for span in spans:
            p, n = span.prefix_len, span.extend_len
            attention_pairs += p * n + n * (n + 1) // 2
            if not is_decode:
                extend_tokens += n
                for tap in taps_inside(span.req, p, n):
                    mark_tap_done(span.req, tap.position)
                    taps_done += 1
            tokens.append(deterministic_token(span.req.rid, p + n, self.vocab_size, self.eos_ids))
        work = BatchWork(
            mode=batch.forward_mode.name,
            num_reqs=len(spans),
            extend_tokens=extend_tokens,
            attention_pairs=attention_pairs,
            decode_reqs=len(spans) if is_decode else 0,
            taps_done=taps_done,
        )
        self._record(work)
        return torch.tensor(tokens, dtype=torch.int64)

    def _record(self, work: BatchWork) -> None:
        self.totals.add(work)
        self.last = work
        if self.keep_history:
            self.history.append(work)
        if self.on_batch is not None:
            self.on_batch(work)

    def _verify_chain(
        self, chain: ChainRequest, num_draft_tokens: int, drafts: DraftSchedule
    ) -> list[int]:
        rid = chain.req.rid

        def step(token: int, position: int) -> int:
            return deterministic_token(rid, position + 1, self.vocab_size, self.eos_ids)

        run = run_chain(
            step,
            lambda: None,  # no state to commit: the token worker computes nothing
            bonus=chain.bonus,
            start=chain.start,
            num_draft_tokens=num_draft_tokens,
            drafts=drafts,
            vocab_size=self.vocab_size,
        )
        self.count_verify(chain.start, num_draft_tokens)
        return run

    def count_verify(self, start: int, n: int) -> None:
        """Account one request's verify of ``n`` inputs from ``start`` (a decode of ``n``)."""
        pairs = start * n + n * (n + 1) // 2
        self._record(BatchWork("TARGET_VERIFY", 1, 0, pairs, decode_reqs=1, taps_done=0))
