"""``--speculative-algorithm CPU_MTP``: SGLang's speculative scheduler path, served on the CPU.

SGLang 0.5.23's EAGLE/NEXTN (MTP) worker cannot run on a CPU (``docs/mtp-research.md``: six
Triton / ``sgl_kernel`` kernels without a fallback, a draft attention backend that refuses
``torch_native``). This module registers a plugin algorithm through SGLang's own
``SpeculativeAlgorithm.register`` whose worker follows the same V2 schema, so everything the
prefix cache sees is SGLang's: the scheduler reserves ``2·D`` KV slots per request per decode
step (``eagle_prepare_for_decode``), a verify round commits ``accept_len`` tokens
(``_resolve_spec_v2_tokens`` moves ``kv_committed_len``), the rejected slots stay reserved and
are freed at release, an overshooting stop trims the output but not the committed KV, and
``is_eagle()`` makes SGLang's own caches key bigrams as they do for NEXTN.

Contract of ``CpuSpecWorker`` (topk 1, ``D = num_steps + 1`` tokens per round):
- An extend pass is the target's pass; the token it samples is the round's *bonus* token
  (``EagleDraftInput.bonus_tokens``), in the sequence but not yet in the KV.
- A decode pass verifies, per request, the chain ``[bonus, d1 .. dS]`` at positions
  ``seq_len .. seq_len + S`` on the target (``verify_chain`` of the CPU worker): it writes the
  K/V of all ``D`` inputs into the reserved slots, accepts the drafts up to the first one that
  differs from the target's own token there, commits the recurrent state after the accepted
  inputs into the request's slot (nothing else of the round reaches a slot), and returns the
  accepted run ``t0 .. tn`` (``accept_len = n + 1``; ``tn`` is the next bonus).
- Drafts (``DraftSchedule``): the target's own token at each position, replaced by a wrong one
  where a fixed hash of the position says so (``miss_every``; 0 never). A draft is made when the
  verify reaches its position, from the target's token there; this accepts exactly the runs a
  drafter proposing the same tokens ahead would (a draft after the first wrong one is never
  accepted, whatever it is), without running the model twice. There is no MTP head: the tiny
  model has none, and which tokens the cache must honour depends only on which are accepted.
- The draft model's KV pool (``draft_kv.py``): an MTP layer's pool over the target's slot ids,
  written after every pass for every slot the target wrote, as SGLang's draft runner owns one;
  SGLang's ``_draft_model_runners()`` names it, which is how the prefix cache finds the pools it
  must copy with the target's. ``check_draft`` (off by default; tests) checks, before every
  pass, that each request's reused prefix carries the draft rows of its own positions.
- Sampling: the CPU worker's sampler draws the token at a position from a generator seeded by
  the position, so "accept while the draft equals the target's token" emits exactly the tokens
  of a run without speculation, greedy or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_hybrid.cpu.draft_kv import DraftKV, DraftRunner
from sglang_hybrid.cpu.errors import unsupported
from sglang_hybrid.cpu.mix import mix64

ALGORITHM = "CPU_MTP"


@dataclass(frozen=True, slots=True)
class DraftSchedule:
    """Which drafts are wrong: the draft for position ``p`` misses iff
    ``mix64(p) % miss_every == 0`` (positions only, so every rank and every run agrees)."""

    miss_every: int = 3

    def draft(self, position: int, target_token: int, vocab_size: int) -> int:
        if self.miss_every and mix64(position) % self.miss_every == 0:
            return (target_token + 1) % vocab_size
        return target_token


def run_chain(
    step: Callable[[int, int], int],
    commit: Callable[[], None],
    *,
    bonus: int,
    start: int,
    num_draft_tokens: int,
    drafts: DraftSchedule,
    vocab_size: int,
) -> list[int]:
    """Verify one request's chain; return the accepted run (the last item is the next bonus).

    ``step(token, position)`` feeds ``token`` at ``position`` and returns the target's token for
    ``position + 1``; ``commit()`` saves the state after the inputs fed so far as the request's
    state. Every one of the ``num_draft_tokens`` inputs is fed (a real verify writes K/V for all
    of them); ``commit`` runs once, after the last accepted input.
    """
    accepted: list[int] = []
    token, rejected = bonus, False
    for k in range(num_draft_tokens):
        target = step(token, start + k)
        if rejected:
            token = target  # junk input past the rejection: its K/V lands in a reserved slot
            continue
        accepted.append(target)
        if k == num_draft_tokens - 1:
            commit()
            break
        token = drafts.draft(start + k + 1, target, vocab_size)
        if token != target:
            commit()
            rejected = True
    return accepted


class CpuSpecWorker:
    """The V2 speculative worker over a CPU target worker (see the module contract).

    Built by SGLang's Scheduler through the registered factory, with the target worker it built;
    ``BaseSpecWorker`` (mixed in by ``worker_class``) supplies the scheduler-facing defaults of
    a worker without a draft model, as for NGRAM.
    """

    def __init__(
        self, server_args: Any, gpu_id: int, nccl_port: int | None, target_worker: Any
    ) -> None:
        from sglang.srt.runtime_context import get_spec

        super().__init__()
        # Duck-typed (worker.py imports this module): the CPU workers' verify entry point.
        if not callable(getattr(target_worker, "verify_chains", None)):
            raise TypeError(
                f"--speculative-algorithm {ALGORITHM} runs on the sglang_hybrid CPU workers "
                f"(--hybrid-cpu-worker); the target is {type(target_worker).__name__}"
            )
        spec = get_spec()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.num_draft_tokens = int(spec.speculative_num_draft_tokens)
        self.drafts = DraftSchedule()
        self.rounds = 0
        self.accepted_drafts = 0
        self.draft_kv: DraftKV | None = None  # the MTP layer's pool (alloc_memory_pool)
        self.check_draft = False

    @property
    def draft_worker(self) -> None:
        return None

    def _draft_model_runners(self) -> tuple[DraftRunner, ...]:
        # SGLang's BaseSpecWorker names its draft runners (whose pools a cache with a host tier
        # backs up) through this method; ours has one, the MTP layer's.
        return (self.draft_kv.runner,) if self.draft_kv is not None else ()

    def alloc_memory_pool(
        self,
        memory_pool_config: Any = None,
        req_to_token_pool: Any = None,
        token_to_kv_pool_allocator: Any = None,
    ) -> None:
        # The target built the pools already; the verify writes into them (NGRAM does the same).
        self.req_to_token_pool, self.token_to_kv_pool_allocator = (
            self._target_worker.get_memory_pool()
        )
        self.draft_kv = DraftKV(self._target_worker.model_runner)

    def forward_batch_generation(
        self,
        batch: Any,
        pp_proxy_tensors: Any = None,
        on_publish: Callable[[torch.Tensor], None] | None = None,
        grammar_barrier: Any = None,
    ) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        target = self._target_worker
        if pp_proxy_tensors is not None:
            unsupported("pipeline parallelism")
        mode = batch.forward_mode
        if mode.is_extend() or mode.is_idle():
            if mode.is_extend():
                self._check_draft(batch, batch.prefix_lens)
            result = target.forward_batch_generation(batch)
            if mode.is_extend() and self.draft_kv is not None:
                self.draft_kv.write(batch.out_cache_loc)
            bonus = result.next_token_ids
            if on_publish is not None:  # overlap scheduling: the round's lengths, as EAGLE's
                on_publish(batch.seq_lens)
            return GenerationBatchResult(
                logits_output=None,
                next_token_ids=bonus,
                can_run_cuda_graph=False,
                accept_lens=torch.ones(bonus.numel(), dtype=torch.int32),
                new_seq_lens=batch.seq_lens,  # the same tensor: nothing to copy back
                next_draft_input=_draft_input(EagleDraftInput, bonus),
                speculative_num_draft_tokens=self.num_draft_tokens,
            )
        if not mode.is_decode():
            unsupported(f"forward mode {mode.name} with speculative decoding")
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        starts = [int(x) for x in seq_lens.tolist()]
        self._check_draft(batch, starts)
        runs = target.verify_chains(
            batch,
            bonus=batch.spec_info.bonus_tokens.tolist(),
            num_draft_tokens=self.num_draft_tokens,
            drafts=self.drafts,
        )
        d = self.num_draft_tokens
        if self.draft_kv is not None:  # the draft layer over every verify input's slot
            table = self.req_to_token_pool.req_to_token
            for row, start in zip(batch.req_pool_indices.tolist(), starts, strict=True):
                self.draft_kv.write(table[row, start : start + d])
        predict = torch.zeros(len(runs) * d, dtype=torch.int64)
        for i, run in enumerate(runs):
            predict[i * d : i * d + len(run)] = torch.tensor(run, dtype=torch.int64)
        accept_lens = torch.tensor([len(run) for run in runs], dtype=torch.int32)
        self.rounds += len(runs)
        self.accepted_drafts += int(accept_lens.sum()) - len(runs)
        bonus = torch.tensor([run[-1] for run in runs], dtype=torch.int64)
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=predict,
            can_run_cuda_graph=False,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=_draft_input(EagleDraftInput, bonus),
            speculative_num_draft_tokens=d,
        )

    def _check_draft(self, batch: Any, reused: list[int]) -> None:
        """With ``check_draft``: request i's first ``reused[i]`` positions carry its draft rows."""
        if not self.check_draft or self.draft_kv is None:
            return
        table = self.req_to_token_pool.req_to_token
        for req, row, n in zip(batch.reqs, batch.req_pool_indices.tolist(), reused, strict=True):
            self.draft_kv.check(req.rid, table[row, : int(n)])


def _draft_input(cls: Any, bonus: torch.Tensor) -> Any:
    """The between-rounds input SGLang filters and merges: the bonus token per request (the
    topk fields are placeholders of the right shape; this worker drafts inside the verify)."""
    n = bonus.numel()
    return cls(
        bonus_tokens=bonus.to(torch.int32),
        topk_p=torch.ones((n, 1), dtype=torch.float32),
        topk_index=torch.zeros((n, 1), dtype=torch.int64),
        hidden_states=None,
    )


def worker_class(server_args: Any) -> type:
    """The worker class SGLang's factory call builds (``spec_register.py``)."""
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    return type("CpuSpecWorker", (CpuSpecWorker, BaseSpecWorker), {})
