"""The draft model's KV pool of ``--speculative-algorithm CPU_MTP``: an MTP layer's attention cache.

SGLang's EAGLE / NEXTN draft runner owns a KV pool of its own (``runner.token_to_kv_pool``, one
attention layer for a Qwen3-Next MTP head) over the target's slot ids: it shares the target's
request-to-token table and allocator, so slot ``s`` holds the draft's K/V for the same position
as the target's slot ``s``. A prefix cache that moves a block's KV (a tail copied to private
pages, a block restored from the host) must move the draft's rows too, or the next draft attends
to another request's keys (acceptance drops; the target's verify keeps outputs exact).

Here the draft layer is a stand-in with the same pool, built with SGLang's ``MHATokenToKVPool``
in the shape of the target's full-attention pool, and a fixed rule for what it writes: after every
pass, for every slot the target wrote, the draft's K and V rows are the negated K and V rows of
the target's first full-attention layer. A real MTP layer's row at position ``i`` depends on the
target's hidden state at ``i`` and the token at ``i + 1``; the stand-in drops that second
dependence so a check can be exact at every position (with it, the last position of a reused
prefix may legitimately differ when the next token does: ``docs/sglang-backend.md``).
:meth:`DraftKV.check` is that check: before a pass, every position a request reuses holds the
draft row the rule gives for the target row there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class DraftRunner:
    """What SGLang's cache-facing code reads of a draft model runner."""

    token_to_kv_pool: Any  # the draft's own KV pool (SGLang MHATokenToKVPool)
    req_to_token_pool: Any  # the target's: shared table, shared recurrent-state pool


class DraftKV:
    def __init__(self, target_runner: Any) -> None:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        pool = target_runner.token_to_kv_pool
        self.target = getattr(pool, "full_kv_pool", pool)
        t = self.target
        # SGLang declares the buffers None until built: read as Any
        self.pool: Any = MHATokenToKVPool(
            size=t.size,
            page_size=t.page_size,
            dtype=t.dtype,
            head_num=t.head_num,
            head_dim=t.head_dim,
            layer_num=1,  # one MTP layer
            device=str(t.device),
            enable_memory_saver=False,
            v_head_dim=t.v_head_dim,
            enable_alt_stream=False,
        )
        self.runner = DraftRunner(self.pool, target_runner.req_to_token_pool)
        self.checked_tokens = 0

    def write(self, slots: torch.Tensor) -> None:
        """The draft layer ran over the target's new rows at ``slots``."""
        if not slots.numel():
            return
        slots = slots.to(torch.int64)
        self.pool.k_buffer[0][slots] = -self.target.k_buffer[0][slots]
        self.pool.v_buffer[0][slots] = -self.target.v_buffer[0][slots]

    def check(self, rid: str, rows: torch.Tensor) -> None:
        """The draft rows at a reused prefix's slots are those the target rows there give."""
        if not rows.numel():
            return
        rows = rows.to(torch.int64)
        for draft, target in (
            (self.pool.k_buffer[0], self.target.k_buffer[0]),
            (self.pool.v_buffer[0], self.target.v_buffer[0]),
        ):
            bad = (draft[rows] != -target[rows]).flatten(1).any(dim=1).nonzero().flatten()
            if bad.numel():
                raise AssertionError(
                    f"{rid}: the draft KV of prefix positions {bad[:5].tolist()} (of "
                    f"{rows.numel()}) is not the draft layer's row for the target's there: the "
                    f"cache moved the target's KV without the draft's"
                )
        self.checked_tokens += rows.numel()
