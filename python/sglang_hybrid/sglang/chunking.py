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

With in-pass capture (``--hybrid-tap-mode zero-split``) a tap on the pass's 64-token grid does not
end the pass: once the pass's extent is final (after the admission is committed, or the chunked
request's next chunk is sized) the cache reserves a snapshot slot for each such tap and asks the
model worker to copy the state there during the forward (``cpu/taps.py``'s protocol). Under
overlap scheduling the tap at the pass's end is reserved there too (the cache copies it right
after the pass is launched, before the next batch can advance the live state).

Requests the cache does not plan for (no ``req.hybrid`` state) are left alone.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..index import BLOCK_TOKENS
from .pages import ceil_to
from .request import ATTR

_POLICY = "sglang.srt.managers.schedule_policy"


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


def tail_pages(req: Any, page_size: int) -> int:
    """Tokens of the pages a request resuming inside a block needs beyond SGLang's budget: the
    private copy of its source's tail (§6.4), made when SGLang first asks for its prefix slots."""
    handle = getattr(req, "best_match_node", None) if req.host_hit_length else None
    handle = handle or getattr(req, "last_node", None)
    source = getattr(handle, "source", None)
    if source is None or not source.tail:
        return 0
    return ceil_to(source.tail_len, page_size)


def after_select_admission(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    # The hooked method's own module is loaded; ``sys.modules`` spares the import machinery's
    # microsecond on every candidate of every pass (``plugin._cache_of``).
    policy = sys.modules[_POLICY]
    if not isinstance(result, policy._PrefillAdmission):
        return None
    note = getattr(adder.tree_cache, "note_adder", None)
    if note is not None:
        note(adder)
    extra = tail_pages(req, adder.page_size) if getattr(req, ATTR, None) is not None else 0
    budget = getattr(adder, "memory_budget", None)
    # The tail copy's pages come on top of the extend SGLang budgets; the pass allocates both at
    # once, so both must fit now (a copy finding no page would stop the scheduler). Only the
    # immediate need is checked: the output budget already covers as much in most requests, and
    # a request that fits an idle pool is never refused here.
    if extra and budget is not None and result.extend_len + extra >= budget.remaining_current:
        return policy.AddReqResult.NO_TOKEN
    end = result.prefix_len + result.extend_len
    new_end = _cut(req, result.prefix_len, end, result.is_chunked)
    chunked = result.is_chunked or new_end is not None
    if chunked and (kwargs.get("has_chunked_req") or adder.new_chunked_req is not None):
        # SGLang tracks one chunked request per pass and relies on a cut spending the whole
        # chunk budget; a clamped chunk leaves budget over, so any second cut waits instead.
        return policy.AddReqResult.OTHER
    if new_end is None:
        return None
    return dataclasses.replace(
        result, extend_len=new_end - result.prefix_len, is_chunked=True, max_new_tokens=0
    )


def after_commit_admission(result: Any, adder: Any, req: Any, admission: Any, *a: Any) -> None:
    if getattr(req, ATTR, None) is None:
        return None
    on_admitted = getattr(adder.tree_cache, "on_admitted", None)
    if on_admitted is not None:  # a restored request's own hold on its lane goes
        on_admitted(req)
    if admission.is_chunked:
        adder.rem_chunk_tokens = 0
    extra = tail_pages(req, adder.page_size)
    budget = getattr(adder, "memory_budget", None)
    if extra and budget is not None:  # reserve() adds a page of its own
        budget.reserve(0, 0, extra_tokens=extra - adder.page_size)
    _reserve_inpass(adder, req)  # the lane is open now (the admission locked it)
    return None


def after_add_chunked_req(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if req not in adder.can_run_list:
        return None  # not scheduled this pass
    full = len(req.full_untruncated_fill_ids)
    new_end = _cut(req, req.prefix_len, req.extend_end, req.extend_end < full)
    if new_end is not None:
        req.extend_end = new_end
    _reserve_inpass(adder, req)
    return req if new_end is not None else None  # still chunked when cut


def _reserve_inpass(adder: Any, req: Any) -> None:
    """Reserve the snapshot slots of the taps captured as part of this pass: those it passes
    over with in-pass capture, and the one at its end under overlap scheduling."""
    cache = adder.tree_cache
    reserve = getattr(cache, "reserve_inpass", None)
    if reserve is not None and (getattr(req, ATTR).capture_grid or cache.overlap):
        reserve(req, req.prefix_len, req.extend_end)
