"""An in-process sink for what SGLang's Scheduler sends to its detokenizer.

Contract: ``OutputSink.send_output(output, recv_obj=None)`` has the signature of the
Scheduler's detokenizer sender, so it can replace ``ipc_channels.send_to_detokenizer
.send_output``. It folds every ``BatchTokenIDOutput`` into one ``RequestResult`` per request id:
prompt tokens, cached tokens and finish reason as last reported, output ids concatenated
(SGLang sends only the ids produced since its previous message; it fills ``output_ids`` only
with ``skip_tokenizer_init``, which the in-process driver requires). An ``AbortReq`` (a request
ended outside the output stream, e.g. aborted while queued) sets that request's finish reason.
Other outputs are kept in ``other`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestResult:
    """What the Scheduler reported for one request."""

    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_type(self) -> str | None:
        """``"length"``, ``"stop"``, ``"abort"``, ... or None while running."""
        if self.finish_reason is None:
            return None
        return str(self.finish_reason.get("type"))


class OutputSink:
    """Collects the Scheduler's per-request outputs in process (see the module contract)."""

    def __init__(self) -> None:
        self.results: dict[str, RequestResult] = {}
        self.other: list[Any] = []

    def send_output(self, output: Any, recv_obj: Any = None) -> None:
        from sglang.srt.managers.io_struct import AbortReq, BatchTokenIDOutput

        if isinstance(output, AbortReq) and output.rid:
            # A request ended outside the output stream (aborted while queued, rejected, ...).
            result = self.results.get(output.rid)
            if result is None:
                result = self.results[output.rid] = RequestResult(output.rid)
            reason = output.finished_reason
            result.finish_reason = (
                dict(reason) if reason else {"type": "abort", "message": output.abort_message}
            )
            return
        if not isinstance(output, BatchTokenIDOutput):
            self.other.append(output)
            return
        ids = output.output_ids
        assert output.rids is not None  # Optional on SGLang's base class, set on every output
        for i, rid in enumerate(output.rids):
            result = self.results.get(rid)
            if result is None:
                result = self.results[rid] = RequestResult(rid)
            result.prompt_tokens = int(output.prompt_tokens[i])
            result.cached_tokens = int(output.cached_tokens[i])
            if ids is not None:
                result.output_ids.extend(int(t) for t in ids[i])
            reason = output.finished_reasons[i]
            if reason is not None:
                result.finish_reason = dict(reason)
