"""A CPU worker that proves the cache hands every pass the right prefix, without a model.

It stands in for a model whose KV at position i and recurrent state after p tokens are pure
functions of the tokens: ``kv(i) = h(tokens[:i+1])`` and ``state(p) = h(tokens[:p])`` with a rolling
hash that float32 holds exactly. Before each pass it checks that the request's state slot holds
``state(prefix)`` and that every KV slot its row maps for [0, prefix) holds ``kv(i)``; then it
writes the KV of the new tokens and ``state(prefix + n)``. A cache that resumes from the wrong
snapshot, forgets the copy-on-write, maps a wrong or recycled page, or mis-copies a tail fails the
check at the next pass: an exactness oracle for bookkeeping that needs no model.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hybrid.cpu.speculative import run_chain
from sglang_hybrid.cpu.taps import taps_inside
from sglang_hybrid.cpu.token_worker import TokenWorker, deterministic_token

MOD = 8_388_593  # prime below 2**23: every value is exact in float32


def prefix_hashes(tokens: list[int], upto: int) -> list[int]:
    out, h = [], 0
    for t in tokens[:upto]:
        h = (h * 31 + int(t) + 1) % MOD
        out.append(h)
    return out


class CheckingWorker(TokenWorker):
    checked_tokens = 0
    checked_states = 0
    checked_taps = 0

    def _next_tokens(self, batch: Any, spans: list[Any]) -> torch.Tensor:
        self._bind_pools()
        slots = self.r2t.get_mamba_indices(batch.req_pool_indices).tolist()
        locs = batch.out_cache_loc.to(torch.int64)
        ids = batch.input_ids.tolist()
        for span in spans:
            req, p, n = span.req, span.prefix_len, span.extend_len
            # The pass's own tokens come from the batch: under overlap scheduling a decode's
            # input is the token the previous batch sampled, not yet in ``output_ids``.
            known = list(req.origin_input_ids) + list(req.output_ids)
            tokens = known[:p] + ids[span.offset : span.offset + n]
            hs = prefix_hashes(tokens, p + n)
            slot = int(slots[span.index])
            self._check_prefix(req, slot, p, hs)
            for tap in taps_inside(req, p, n):  # in-pass taps: the state after tap.position
                self._set_state(tap.dst_slot, hs, tap.position)
                self.checked_taps += 1
            self._write_kv(locs[span.offset : span.offset + n], hs[p : p + n])
            self._set_state(slot, hs, p + n)
        return super()._next_tokens(batch, spans)

    def _verify_chain(self, chain: Any, num_draft_tokens: int, drafts: Any) -> list[int]:
        """A speculative decode pass: the same checks before it; the K/V of every chain input
        (rejected drafts included) written as the hash of the sequence it was fed, and the state
        after the accepted inputs. A block or frontier past the accepted run would carry the
        rejected inputs' hashes and fail a later check."""
        self._bind_pools()
        req = chain.req
        known = list(req.origin_input_ids) + list(req.output_ids)
        # Under overlap scheduling the previous rounds' accepted tokens may not be in
        # ``output_ids`` yet (their results are processed after this pass was launched); this
        # worker's tokens are a function of the position, so the missing ones are known.
        known += [
            deterministic_token(req.rid, p, self.vocab_size, self.eos_ids)
            for p in range(len(known), chain.start + 1)
        ]
        assert known[chain.start] == chain.bonus, f"{req.rid}: bonus is not the last token"
        self._check_prefix(req, chain.slot, chain.start, prefix_hashes(known, chain.start))
        fed: list[int] = []
        committed: list[int] = []

        def step(token: int, position: int) -> int:
            fed.append(token)
            return deterministic_token(req.rid, position + 1, self.vocab_size, self.eos_ids)

        run = run_chain(
            step,
            lambda: committed.append(len(fed)),
            bonus=chain.bonus,
            start=chain.start,
            num_draft_tokens=num_draft_tokens,
            drafts=drafts,
            vocab_size=self.vocab_size,
        )
        assert committed == [len(run)], (committed, run)
        hs = prefix_hashes(known[: chain.start] + fed, chain.start + len(fed))
        self._write_kv(chain.kv_slots, hs[chain.start :])
        self._set_state(chain.slot, hs, chain.start + len(run))
        self.count_verify(chain.start, num_draft_tokens)
        return run

    def _bind_pools(self) -> None:
        r = self.model_runner  # pools exist once the scheduler has built them
        pool = r.token_to_kv_pool
        self.kv = getattr(pool, "full_kv_pool", pool)
        self.mamba = r.req_to_token_pool.mamba_pool.mamba_cache
        self.r2t = r.req_to_token_pool

    def _check_prefix(self, req: Any, slot: int, p: int, hs: list[int]) -> None:
        state = float(self.mamba.temporal[0, slot].reshape(-1)[0])
        want = float(hs[p - 1]) if p else 0.0
        assert state == want, (
            f"{req.rid}: state slot {slot} holds {state}, the state after {p} tokens is {want}"
        )
        self.checked_states += 1
        if p:
            row = self.r2t.req_to_token[req.kv.req_pool_idx, :p].to(torch.int64)
            got = self.kv.k_buffer[0][row, 0, 0]
            exp = torch.tensor(hs[:p], dtype=got.dtype, device=got.device)
            bad = (got != exp).nonzero()
            assert bad.numel() == 0, (
                f"{req.rid}: KV of positions {bad[:5].flatten().tolist()} (of {p}) is wrong"
            )
            self.checked_tokens += p

    def _write_kv(self, dst: torch.Tensor, values: list[int]) -> None:
        new = torch.tensor(values, dtype=self.kv.k_buffer[0].dtype, device=dst.device)
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf[dst] = new[:, None, None]

    def _set_state(self, slot: int, hs: list[int], p: int) -> None:
        """Mamba ``slot`` holds the state after the first ``p`` tokens."""
        self.mamba.temporal[:, slot] = float(hs[p - 1]) if p else 0.0
        for conv in self.mamba.conv:
            conv[:, slot] = 0.0
