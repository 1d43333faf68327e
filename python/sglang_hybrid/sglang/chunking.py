"""Prefill chunk sizing for exact taps (spec §7.1): a pass ends where a planned exact tap lies.

SGLang's model runner can only leave a recurrent state where a pass ends, so an exact tap at p
(a client breakpoint, the generation opener, a structural boundary, the branch point, the prompt
tail) shortens the pass that would run past p. Three hooks on SGLang's ``PrefillAdder``:

- after ``_select_prefill_admission`` (a new request): clamp the admission to end at the next cut,
  and floor any other cut to the 64-token grid so flexible taps realised there need no tail;
  a second chunked request in one pass is deferred (SGLang tracks one chunked request);
- after ``_commit_prefill_admission``: a chunked admission spends the rest of the pass's chunk
  budget, as SGLang's own cuts do, so no later request is cut in the same pass;
- after ``add_chunked_req`` (the request being chunked): the same clamp and grid floor on its
  next chunk. Shrinking a chunk after the budget check is always safe.

Requests the cache does not plan for (no ``req.hybrid`` state) are left alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..index import BLOCK_TOKENS
from .request import ATTR


def _cut(req: Any, prefix: int, end: int, natural_cut: bool) -> int | None:
    """The end a pass over [prefix, end) should have, or None to keep ``end``."""
    state = getattr(req, ATTR, None)
    if state is None:
        return None
    p = state.next_cut(prefix)
    if p is not None and p < end:
        return p
    if natural_cut and end % BLOCK_TOKENS:
        floored = end - end % BLOCK_TOKENS
        if floored > prefix:
            return floored
    return None


def after_select_admission(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission

    if not isinstance(result, _PrefillAdmission):
        return None
    end = result.prefix_len + result.extend_len
    new_end = _cut(req, result.prefix_len, end, result.is_chunked)
    chunked = result.is_chunked or new_end is not None
    if chunked and (kwargs.get("has_chunked_req") or adder.new_chunked_req is not None):
        # SGLang tracks one chunked request per pass and relies on a cut spending the whole
        # chunk budget; a clamped chunk leaves budget over, so any second cut waits instead.
        return AddReqResult.OTHER
    if new_end is None:
        return None
    return dataclasses.replace(
        result, extend_len=new_end - result.prefix_len, is_chunked=True, max_new_tokens=0
    )


def after_commit_admission(result: Any, adder: Any, req: Any, admission: Any, *a: Any) -> None:
    if admission.is_chunked and getattr(req, ATTR, None) is not None:
        adder.rem_chunk_tokens = 0
    return None


def after_add_chunked_req(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if req not in adder.can_run_list:
        return None  # not scheduled this pass
    full = len(req.full_untruncated_fill_ids)
    new_end = _cut(req, req.prefix_len, req.extend_end, req.extend_end < full)
    if new_end is None:
        return None
    req.extend_end = new_end
    return req  # still chunked
