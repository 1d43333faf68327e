"""The replay's model worker: the token worker, answering from scripts and counting per request.

Contract (a ``TokenWorker`` subclass, chosen with ``InProcessScheduler(worker="tokens",
worker_class=ReplayWorker)``):
- ``scripts[rid]`` is the answer of request ``rid``: the token generated at absolute position
  ``len(prompt) + k`` is ``scripts[rid][k]``; passes that emit no kept token (non-final prefill
  chunks) fall back to the token worker's deterministic token. A request must be registered
  before its first pass.
- Per request it counts ``prefill[rid]``: tokens computed before the first answer token
  (prefill, including chunks), ``recompute[rid]``: tokens re-prefilled after a retraction, and
  ``first_prefix[rid]``: the prefix the first pass resumed from.
- ``pending`` collects the ``BatchWork`` of every pass since the driver last drained it (the
  clock prices them); the base class's totals are kept too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_hybrid.cpu.batch_spans import ReqSpan
from sglang_hybrid.cpu.token_worker import BatchWork, TokenWorker


class ReplayWorker(TokenWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scripts: dict[str, np.ndarray] = {}
        self.prefill: dict[str, int] = {}
        self.recompute: dict[str, int] = {}
        self.first_prefix: dict[str, int] = {}
        self.pending: list[BatchWork] = []
        self.on_batch = self.pending.append

    def _next_tokens(self, batch: Any, spans: list[ReqSpan]) -> torch.Tensor:
        tokens = super()._next_tokens(batch, spans)
        extend = batch.forward_mode != ForwardMode.DECODE
        for i, span in enumerate(spans):
            req = span.req
            rid = req.rid
            if extend:
                self.first_prefix.setdefault(rid, span.prefix_len)
                # A retracted request comes back with its answer so far appended to the prompt.
                book = self.recompute if req.output_ids else self.prefill
                book[rid] = book.get(rid, 0) + span.extend_len
            k = span.prefix_len + span.extend_len - len(req.origin_input_ids)
            script = self.scripts.get(rid)
            if script is not None and 0 <= k < len(script):
                tokens[i] = int(script[k])
        return tokens

    def forget(self, rid: str) -> None:
        """Drop a finished request's script (its counters stay for the report)."""
        self.scripts.pop(rid, None)


class ChunkGridReplayWorker(ReplayWorker):
    """Captures in-pass taps only on each pass's 64-token chunk grid, off-grid taps ending their
    pass where it pays: zero-split without the off-grid recompute (SGLang's prefill tracking and
    the per-chunk states alone; ``sglang/gdn_taps.py`` recomputes, so SGLang's GPU worker
    captures anywhere). Kept to show what the recompute is worth (``inpass.capture_of`` reads
    ``state_tap_grid``)."""

    state_tap_grid = 64
