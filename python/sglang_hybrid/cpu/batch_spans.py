"""Per-request token spans of a ``ScheduleBatch`` that the CPU workers compute.

Contract: ``batch_spans(batch)`` returns, for each request of an EXTEND, MIXED or DECODE batch,
a ``ReqSpan`` with the number of tokens already in the request's KV row (``prefix_len``), the
number of new tokens in this pass (``extend_len``) and where those tokens start in the batch's
flattened ``input_ids`` / ``out_cache_loc`` (``offset``). In DECODE, ``seq_lens`` already counts
the new token, so the prefix is ``seq_lens - 1`` and every request extends by one. Other forward
modes raise ``NotImplementedError`` naming the mode.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReqSpan(NamedTuple):
    """The new tokens of one request in one forward pass."""

    index: int  # type: ignore[assignment]  # shadows tuple.index (never called); position in batch.reqs
    req: Any  # sglang Req
    prefix_len: int
    extend_len: int
    offset: int  # start of this request's tokens in batch.input_ids / batch.out_cache_loc


def batch_spans(batch: Any) -> list[ReqSpan]:
    """The spans of every request in ``batch`` (see the module contract)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = batch.forward_mode
    reqs = batch.reqs
    if mode == ForwardMode.DECODE:
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        return [ReqSpan(i, req, int(seq_lens[i]) - 1, 1, i) for i, req in enumerate(reqs)]
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        spans = []
        offset = 0
        for i, req in enumerate(reqs):
            n = int(batch.extend_lens[i])
            spans.append(ReqSpan(i, req, int(batch.prefix_lens[i]), n, offset))
            offset += n
        return spans
    if mode == ForwardMode.IDLE:
        return []
    raise NotImplementedError(f"the CPU workers do not run forward mode {mode.name}")
