"""The base class of the CPU stand-ins for SGLang's ``TpModelWorker``.

Contract:
- Constructed by SGLang's Scheduler with ``TpModelWorker``'s keyword arguments (after
  ``install.install_cpu_worker`` replaced the class). It builds SGLang's ``ModelConfig``, a
  ``CpuModelRunner`` (pools built by SGLang's ``KVCacheConfigurator`` when the Scheduler calls
  ``alloc_memory_pool``) and resolves the random seed: the ``random_seed`` argument, else
  ``ServerArgs.random_seed``, else the runtime context's seed, else 0 (``torch.manual_seed(None)``
  fails, so None is never kept).
- Every public method of ``TpModelWorker`` / ``BaseTpWorker`` that SGLang's managers call exists
  here and either works (pool access, worker info, the no-op CUDA-graph / attention / HiCache
  set-up calls, ``get_decode_cuda_graph_bs() == []``) or raises ``CpuWorkerUnsupported`` naming
  the feature (weight updates, LoRA, embeddings, split prefill, draft workers and speculative
  algorithms other than ``CPU_MTP``, logprobs).
  Any other attribute lookup raises ``CpuWorkerUnsupported`` too; it subclasses both
  ``NotImplementedError`` and ``AttributeError`` so ``hasattr``/``getattr(..., default)`` still
  answer "absent".
- ``forward_batch_generation(batch)`` runs SGLang's deferred mamba copy-on-write / clear
  (``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``, called unbound on this worker's
  runner) before anything reads a state slot, then asks the subclass for one next token per
  request (``_next_tokens``) and returns a ``GenerationBatchResult``.
- ``verify_chains(batch, ...)``: a speculative decode pass of ``--speculative-algorithm CPU_MTP``
  (``speculative.py``), the same deferred ops first, then one accepted run per request from the
  subclass (``_verify_chain``) over the KV slots SGLang reserved after the committed length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import torch
from sglang.srt.server_args import ServerArgs

from sglang_hybrid.cpu.batch_spans import ReqSpan, batch_spans
from sglang_hybrid.cpu.errors import unsupported
from sglang_hybrid.cpu.runner import CpuModelRunner
from sglang_hybrid.cpu.speculative import ALGORITHM as SPEC_ALGORITHM
from sglang_hybrid.cpu.speculative import DraftSchedule


@dataclass(slots=True)
class _DeferredMambaOps:
    """The ForwardBatch fields ``_maybe_execute_deferred_mamba_cow_and_clear`` reads and resets."""

    forward_mode: Any
    mamba_clear_indices: torch.Tensor | None
    mamba_cow_src_indices: torch.Tensor | None
    mamba_cow_dst_indices: torch.Tensor | None


class ChainRequest(NamedTuple):
    """One request of a speculative decode pass."""

    req: Any  # sglang Req
    row: int  # its req_to_token row
    slot: int  # its mamba state slot
    start: int  # committed length: the bonus token's position
    bonus: int
    kv_slots: torch.Tensor  # int64, one per chain input, from the scheduler's reserve


def _resolve_seed(random_seed: int | None, server_args: ServerArgs) -> int:
    if random_seed is not None:
        return int(random_seed)
    if server_args.random_seed is not None:
        return int(server_args.random_seed)
    from sglang.srt.runtime_context import get_device

    seed = get_device().random_seed
    return int(seed) if seed is not None else 0


class CpuTpWorker:
    """Shared behaviour of the CPU workers; subclasses implement ``_next_tokens``.

    Installed as the REPLACE of ``TpModelWorker``: calling ``CpuTpWorker(...)`` builds the
    subclass chosen with ``select`` (registration state, set by ``install_cpu_worker``).
    """

    _selected: type[CpuTpWorker] | None = None
    # Honours the in-pass state-tap protocol (``taps.py``) at any position: what
    # ``--hybrid-tap-mode auto`` looks for on the scheduler's model worker.
    state_taps = True

    @staticmethod
    def select(worker_cls: type[CpuTpWorker]) -> None:
        """Choose the concrete worker that ``CpuTpWorker(...)`` constructs."""
        if not issubclass(worker_cls, CpuTpWorker) or worker_cls is CpuTpWorker:
            raise TypeError(f"{worker_cls!r} is not a concrete CpuTpWorker subclass")
        CpuTpWorker._selected = worker_cls

    def __new__(cls, *args: Any, **kwargs: Any) -> CpuTpWorker:
        if cls is CpuTpWorker:
            if CpuTpWorker._selected is None:
                raise RuntimeError("no CPU worker selected: call install_cpu_worker(kind) first")
            cls = CpuTpWorker._selected
        return super().__new__(cls)

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int = 0,
        nccl_port: int | None = None,
        is_draft_worker: bool = False,
        req_to_token_pool: Any = None,
        token_to_kv_pool_allocator: Any = None,
        memory_pool_config: Any = None,
        random_seed: int | None = None,
        **unused: Any,
    ) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec
        from sglang.srt.utils import set_random_seed

        algorithm = get_spec().speculative_algorithm
        if is_draft_worker or algorithm not in (None, SPEC_ALGORITHM):
            unsupported(
                f"speculative decoding with {algorithm} (the CPU workers serve "
                f"--speculative-algorithm {SPEC_ALGORITHM}, speculative.py)"
            )
        if req_to_token_pool is not None or token_to_kv_pool_allocator is not None:
            unsupported("pools shared from another worker")
        parallel = get_parallel()
        if parallel.tp_size != 1 or parallel.pp_size != 1:
            unsupported("tensor or pipeline parallelism")
        self.server_args = server_args
        self.gpu_id = gpu_id
        self.nccl_port = nccl_port
        self.is_draft_worker = False
        self.model_config = ModelConfig.from_server_args(server_args)
        self._model_runner = CpuModelRunner(server_args, self.model_config)
        self.model_runner_list: list[CpuModelRunner] = []
        self.device = self._model_runner.device  # "cpu", or "cuda" in the CUDA build
        self.random_seed = _resolve_seed(random_seed, server_args)
        # TpModelWorker seeds every library here; the same keeps SGLang-side randomness equal.
        set_random_seed(self.random_seed)
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        self.enable_spec = False
        self.dllm_algorithm = None
        self.tokenizer = None
        self.processor = None
        self.hicache_layer_transfer_counter: Any = None

    # ------------------------------------------------------------------ runner and pools
    @property
    def model_runner(self) -> CpuModelRunner:
        return self._model_runner

    @property
    def last_shared_read_runner(self) -> CpuModelRunner:
        return self._model_runner

    @property
    def sliding_window_size(self) -> int | None:
        return self._model_runner.sliding_window_size

    @property
    def is_hybrid_swa(self) -> bool:
        return self._model_runner.is_hybrid_swa

    @property
    def graph_memory_usage(self) -> dict[str, float]:
        return {}

    @property
    def graph_time_usage(self) -> dict[str, float]:
        return {}

    @property
    def weight_load_time(self) -> float:
        return self._model_runner.weight_load_time

    @property
    def preloaded_weights_bytes(self) -> int:
        return self._model_runner.preloaded_weights_bytes

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self._model_runner.req_to_token_pool, self._model_runner.token_to_kv_pool_allocator

    def get_tokens_per_layer_info(self) -> tuple[int | None, int | None]:
        return (
            self._model_runner.full_max_total_num_tokens,
            self._model_runner.swa_max_total_num_tokens,
        )

    def alloc_memory_pool(self, memory_pool_config: Any = None, **kwargs: Any) -> None:
        if kwargs.get("req_to_token_pool") is not None:
            unsupported("pools shared from another worker")
        self._model_runner.alloc_memory_pool(memory_pool_config)

    def get_worker_info(self) -> tuple[Any, ...]:
        from sglang.srt.runtime_context import get_schedule

        runner = self._model_runner
        max_req_len = min(self.model_config.context_len - 1, runner.max_total_num_tokens - 1)
        return (
            runner.logical_max_total_num_tokens,
            get_schedule().max_prefill_tokens,
            runner.max_running_requests,
            get_schedule().max_queued_requests,
            max_req_len,
            max_req_len - 5,
            self.random_seed,
            self.device,
            runner.forward_stream,
            runner.req_to_token_pool.size,
            runner.req_to_token_pool.max_context_len,
            runner.token_to_kv_pool.size,
        )

    def get_pad_input_ids_func(self) -> None:
        return None

    def is_dllm(self) -> bool:
        return False

    # ------------------------------------------------------------------ no-op set-up calls
    def init_attention_backends(self) -> None:
        """The workers compute attention themselves; there is no backend to build."""

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
        """No CUDA graphs on the CPU."""

    def ensure_decode_cuda_graphs(self, capture_bs: list[int] | None = None) -> None:
        """No CUDA graphs on the CPU."""

    def get_decode_cuda_graph_bs(self) -> list[int]:
        return []

    def start_startup_weight_load(self) -> None:
        """Weights (if any) are loaded in the constructor."""

    def finalize_startup_weight_load(self) -> None:
        """Weights (if any) are loaded in the constructor."""

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.hicache_layer_transfer_counter = counter

    def set_hicache_consumer(self, consumer_index: int) -> None:
        if self.hicache_layer_transfer_counter is not None:
            self.hicache_layer_transfer_counter.set_consumer(consumer_index)

    def on_verify_complete_cpu(
        self, num_correct_drafts_per_req: list[int], batch_size: int = 0
    ) -> None:
        """Speculative-decoding hook; a plain worker has nothing to do (as in BaseTpWorker)."""

    # ------------------------------------------------------------------ refused features
    def register_hisparse_coordinator(self, coordinator: Any) -> NoReturn:
        unsupported("HiSparse attention")

    def weight_update_runners(self) -> NoReturn:
        unsupported("weight updates")

    def init_weights_update_group(self, recv_req: Any) -> NoReturn:
        unsupported("weight updates (init_weights_update_group)")

    def destroy_weights_update_group(self, recv_req: Any) -> NoReturn:
        unsupported("weight updates (destroy_weights_update_group)")

    def init_weights_send_group_for_remote_instance(self, recv_req: Any) -> NoReturn:
        unsupported("sending weights to a remote instance")

    def send_weights_to_remote_instance(self, recv_req: Any) -> NoReturn:
        unsupported("sending weights to a remote instance")

    def deserialize_own_rank(self, serialized_named_tensors: Any) -> NoReturn:
        unsupported("weight updates from tensors")

    def get_weights_by_name(self, recv_req: Any) -> NoReturn:
        unsupported("reading weights by name")

    def load_lora_adapter(self, recv_req: Any) -> NoReturn:
        unsupported("LoRA adapters")

    def unload_lora_adapter(self, recv_req: Any) -> NoReturn:
        unsupported("LoRA adapters")

    def load_lora_adapter_from_tensors(self, recv_req: Any) -> NoReturn:
        unsupported("LoRA adapters")

    def forward_batch_embedding(self, batch: Any) -> NoReturn:
        unsupported("embedding and reward models")

    def forward_batch_split_prefill(self, batch: Any) -> NoReturn:
        unsupported("split prefill (PD multiplexing)")

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached for names not defined above: refuse loudly but stay hasattr-friendly.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        unsupported(f"TpModelWorker.{name}")

    # ------------------------------------------------------------------ forward
    def unsupported_request_features(self, req: Any) -> list[str]:
        """What ``req`` asks for that this worker cannot compute (empty: it can run).

        The CPU plugin's admission hook aborts such a request with this list before it is
        queued; raising later, inside a forward pass, would take the scheduler down.
        """
        out = []
        ids = req.origin_input_ids
        vocab = self.model_config.vocab_size
        if len(ids) and (min(ids) < 0 or max(ids) >= vocab):
            out.append(f"token ids outside the model's vocabulary [0, {vocab})")
        if req.return_logprob:
            out.append("logprobs")
        if req.return_hidden_states:
            out.append("hidden-state capture")
        if getattr(req, "lora_id", None):
            out.append("LoRA adapters")
        params = req.sampling_params
        if params.json_schema or params.regex or params.ebnf or params.structural_tag:
            out.append("constrained decoding (json_schema / regex / ebnf / structural_tag)")
        return out

    def forward_batch_generation(
        self,
        batch: Any,
        forward_batch: Any = None,
        pp_proxy_tensors: Any = None,
        is_verify: bool = False,
        skip_attn_backend_init: bool | None = None,
        *,
        capture_hidden_mode: Any = None,
        return_kv_loc_plan: bool = False,
    ) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult

        if batch is None:
            unsupported("forward passes without a ScheduleBatch")
        if is_verify:
            unsupported("speculative verification")
        if pp_proxy_tensors is not None:
            unsupported("pipeline parallelism")
        if batch.return_logprob:
            unsupported("logprobs (return_logprob)")
        if batch.return_hidden_states or capture_hidden_mode is not None:
            unsupported("hidden-state capture")
        self.set_hicache_consumer(batch.hicache_consumer_index)
        self._run_deferred_mamba_ops(batch)
        spans = batch_spans(batch)
        if spans:
            next_token_ids = self._next_tokens(batch, spans)
        else:  # an IDLE batch: nothing to compute
            next_token_ids = torch.empty(0, dtype=torch.int64)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=next_token_ids, can_run_cuda_graph=False
        )

    def verify_chains(
        self,
        batch: Any,
        *,
        bonus: list[int],
        num_draft_tokens: int,
        drafts: DraftSchedule,
    ) -> list[list[int]]:
        """A speculative decode pass (``speculative.py``): each request's accepted run.

        Request ``i`` verifies ``[bonus[i], d1 ..]`` from its committed length
        (``batch.seq_lens``) into the ``num_draft_tokens`` slots SGLang reserved after it.
        """
        if batch.return_logprob:
            unsupported("logprobs (return_logprob)")
        self.set_hicache_consumer(batch.hicache_consumer_index)
        self._run_deferred_mamba_ops(batch)
        pool = self._model_runner.req_to_token_pool
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        rows = batch.req_pool_indices.to(torch.int64).tolist()
        slots = pool.translate_mamba_indices(
            pool.get_mamba_indices(batch.req_pool_indices)
        ).tolist()
        runs = []
        for i, req in enumerate(batch.reqs):
            start = int(seq_lens[i])
            end = start + num_draft_tokens
            if req.kv.kv_allocated_len < end:
                raise RuntimeError(
                    f"{req.rid!r}: verify needs KV slots up to {end}, SGLang reserved "
                    f"{req.kv.kv_allocated_len}"
                )
            kv_slots = pool.req_to_token[rows[i], start:end].to(torch.int64)
            chain = ChainRequest(req, rows[i], int(slots[i]), start, int(bonus[i]), kv_slots)
            runs.append(self._verify_chain(chain, num_draft_tokens, drafts))
        return runs

    def _verify_chain(
        self, chain: ChainRequest, num_draft_tokens: int, drafts: DraftSchedule
    ) -> list[int]:
        """One request's accepted run (``speculative.run_chain`` over this worker's model)."""
        unsupported("speculative verification")

    def _run_deferred_mamba_ops(self, batch: Any) -> None:
        """SGLang's own deferred COW/clear of mamba slots, on this worker's runner."""
        from sglang.srt.model_executor.model_runner import ModelRunner

        ops = _DeferredMambaOps(
            forward_mode=batch.forward_mode,
            mamba_clear_indices=getattr(batch, "mamba_clear_indices", None),
            mamba_cow_src_indices=getattr(batch, "mamba_cow_src_indices", None),
            mamba_cow_dst_indices=getattr(batch, "mamba_cow_dst_indices", None),
        )
        ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(self._model_runner, ops)  # type: ignore[arg-type]  # duck-typed: it reads the runner's pools and ops' 4 fields

    def _next_tokens(self, batch: Any, spans: list[ReqSpan]) -> torch.Tensor:
        """One next token per request (int64, CPU), after writing whatever the worker computes."""
        raise NotImplementedError(f"{type(self).__name__} does not compute tokens")
