"""Registration of ``--speculative-algorithm CPU_MTP`` with SGLang, and the three places its
speculative path needs a CPU twin (``speculative.py`` holds the worker).

Contract: ``register_algorithm()`` (idempotent; the CPU plugin and ``install_cpu_worker`` call
it) registers the algorithm through ``SpeculativeAlgorithm.register`` with a ``CustomSpecAlgo``
subclass (EAGLE's predicates, EAGLE's topk-1 defaults, the two methods 0.5.23's base class lacks)
and a validator refusing what a chain cannot be, as supporting overlap scheduling (the worker
follows the V2 schema there too: it publishes each round's lengths through ``on_publish``), and
registers three HookRegistry AROUND hooks that leave CUDA tensors to SGLang: the request-to-token
write of the speculative allocation (Triton) in torch, no Triton warm-up of the KV pool's slot
copy (used only by top-k > 1 compaction), and the overlap loop's gather of the previous round's
draft input from its future map (Triton) in torch.

SGLang's argument resolution turns overlap scheduling off on ``--device cpu`` for its own EAGLE
family only, so a CPU server runs CPU_MTP in SGLang's overlap loop unless
``--disable-overlap-schedule`` is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_hybrid.cpu.speculative import ALGORITHM, worker_class

DEFAULT_STEPS = 3
ALLOCATION_TARGET = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
KV_COPY_WARMUP_TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
GATHER_TARGET = "sglang.srt.managers.overlap_utils.gather_spec_extras"


def _spec_class() -> type:
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class CpuMtpAlgo(CustomSpecAlgo):
        """The scheduler-facing predicates of an EAGLE-type chain (NEXTN), plus the two methods
        0.5.23's ``CustomSpecAlgo`` lacks but the Scheduler calls at start."""

        def is_eagle(self) -> bool:
            return True  # bigram keys in SGLang's caches, EAGLE's slot reserve

        def need_topk(self) -> bool:
            return True

        def carries_draft_hidden_states(self) -> bool:
            return False

        def create_future_map(
            self,
            device: Any,
            req_to_token_pool: Any,
            needs_cpu_seq_lens: bool = True,
            needs_confidence_relay: bool = False,
        ) -> Any:
            from sglang.srt.managers.overlap_utils import FutureMap

            algo: Any = self  # duck-types SpeculativeAlgorithm, as SGLang's registry intends
            return FutureMap(
                device, algo, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
            )

        def handle_server_args(self, server_args: Any) -> None:
            # EAGLE's defaults for a topk-1 chain, filled where the user left them out.
            if server_args.speculative_num_steps is None:
                server_args.speculative_num_steps = DEFAULT_STEPS
            if server_args.speculative_eagle_topk is None:
                server_args.speculative_eagle_topk = 1
            if server_args.speculative_num_draft_tokens is None:
                server_args.speculative_num_draft_tokens = server_args.speculative_num_steps + 1

    return CpuMtpAlgo


def validate_server_args(server_args: Any) -> None:
    """Refuse what the CPU algorithm cannot serve, with the flag to change."""
    steps = server_args.speculative_num_steps
    topk = server_args.speculative_eagle_topk
    draft = server_args.speculative_num_draft_tokens
    if topk not in (None, 1):
        raise ValueError(f"{ALGORITHM} drafts a chain: --speculative-eagle-topk must be 1")
    if steps is not None and steps < 1:
        raise ValueError(f"{ALGORITHM}: --speculative-num-steps must be at least 1")
    if steps is not None and draft is not None and draft != steps + 1:
        raise ValueError(
            f"{ALGORITHM} verifies the bonus token and one draft per step: "
            f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({steps + 1})"
        )
    if str(server_args.device) != "cpu":
        raise ValueError(f"{ALGORITHM} runs on the CPU workers only (--device cpu)")


def register_algorithm() -> None:
    """Register ``CPU_MTP`` with SGLang (idempotent) and the torch fallback of the one Triton
    kernel the scheduler's speculative allocation calls."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return
    HookRegistry.register(ALLOCATION_TARGET, assign_req_to_token_pool, HookType.AROUND)
    HookRegistry.register(KV_COPY_WARMUP_TARGET, skip_kv_copy_warmup_off_gpu, HookType.AROUND)
    HookRegistry.register(GATHER_TARGET, gather_spec_extras, HookType.AROUND)
    SpeculativeAlgorithm.register(
        ALGORITHM,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=_spec_class(),
    )(worker_class)


def assign_req_to_token_pool(
    original: Callable[..., None],
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Row ``r`` of ``req_to_token`` gets ``out_cache_loc``'s next ``end - start`` slots at
    ``[start, end)``, rows in batch order: SGLang's Triton kernel, in torch for CPU tensors."""
    if req_to_token.is_cuda:
        original(
            req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size
        )
        return
    at = 0
    for row, lo, hi in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        req_to_token[row, lo:hi] = out_cache_loc[at : at + hi - lo].to(req_to_token.dtype)
        at += hi - lo


def skip_kv_copy_warmup_off_gpu(original: Callable[..., None], pool: Any) -> None:
    """A KV pool built with any speculative algorithm warms a Triton slot-copy kernel up, for
    the top-k > 1 compaction (``move_kv_cache``) a topk-1 chain never calls; off the GPU there
    is no Triton driver, so the pool is left without the copy (a call would assert)."""
    if str(pool.device).startswith("cuda"):
        original(pool)
        return
    pool._kv_copy_config = None


def gather_spec_extras(
    original: Callable[..., Any],
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    output_tokens_buf: torch.Tensor,
    hidden_states_buf: torch.Tensor | None,
) -> Any:
    """Rows ``indices`` of each future-map buffer (the previous round's draft input, under
    overlap scheduling): SGLang's fused Triton gather, in torch for CPU tensors."""
    if indices.is_cuda:
        return original(indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf)
    rows = indices.to(torch.int64)
    hidden = hidden_states_buf[rows] if hidden_states_buf is not None else None
    return topk_p_buf[rows], topk_index_buf[rows], output_tokens_buf[rows], hidden
