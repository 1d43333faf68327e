"""A CPU stand-in for SGLang's ``ModelRunner``: what the Scheduler and ``kv_cache_builder`` read.

Contract:
- ``CpuModelRunner(server_args, model_config)`` holds the attributes SGLang's managers and the
  tree-cache builder read from ``tp_worker.model_runner`` (device, dtypes, pool handles, pool
  sizes, a disabled ngram-embedding manager, an attention-backend stub, accounting fields).
- ``alloc_memory_pool()`` builds the request-to-token pool, the KV pool and its allocator with
  SGLang's own ``KVCacheConfigurator._init_pools`` on ``ServerArgs.device``: ``"cpu"``, or
  ``"cuda"`` for the CUDA build (the GPU check, ``benchmark/gpu/check_backend.py``). There is
  no memory profiling: ``max_total_tokens``, ``max_running_requests`` (and, for hybrid models,
  ``max_mamba_cache_size``) must be set in ServerArgs; a missing one raises ``ValueError``.
- It never runs a model. Workers (``worker.py`` and its subclasses) compute on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.server_args import ServerArgs

from sglang_hybrid.cpu.errors import unsupported


@dataclass(slots=True)
class AttentionBackendStub:
    """The attention-backend attributes the Scheduler inspects; no kernels behind them."""

    name: str = "sglang_hybrid_cpu"
    # FutureMap publishes CPU seq lens when any backend asks; the CPU workers read them.
    needs_cpu_seq_lens: bool = True
    folds_encoder_swa_replay: bool = False
    tail_forward_metadata: Any = None
    verify_mask: Any = None


def _required(value: int | None, name: str) -> int:
    if value is None or value <= 0:
        raise ValueError(
            f"the CPU model runner does not profile memory: set ServerArgs.{name} explicitly "
            f"(see sglang_hybrid.cpu.install.cpu_server_args)"
        )
    return int(value)


class CpuModelRunner:
    """Pools and bookkeeping of a model runner, with the pools built by SGLang itself."""

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        device = str(server_args.device)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"the CPU model runner needs device 'cpu' or 'cuda', got {device!r}")
        schedule = get_schedule()
        self.server_args = server_args
        self.model_config = model_config
        self.device = device
        self.gpu_id = 0
        self.page_size: int = schedule.page_size
        self.dtype: torch.dtype = model_config.dtype
        self.kv_cache_dtype: torch.dtype = model_config.dtype
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.is_draft_worker = False
        self.is_hybrid_swa = False
        self.sliding_window_size: int | None = None
        self.use_mla_backend = False
        self.forward_stream = torch.cpu.Stream() if device == "cpu" else torch.cuda.Stream()
        # Read by the Scheduler's WAR barrier on CUDA; no shared-read event is ever published.
        self.shared_read_done_event = None
        n_layers = model_config.num_hidden_layers
        self.layer_info = ModelLayerInfo(
            start_layer=0, end_layer=n_layers, num_effective_layers=n_layers
        )
        self.max_total_num_tokens = _required(schedule.max_total_tokens, "max_total_tokens")
        self.max_running_requests = _required(schedule.max_running_requests, "max_running_requests")
        self.logical_max_total_num_tokens = self.max_total_num_tokens
        self.effective_logical_max_total_num_tokens = self.max_total_num_tokens
        self.full_max_total_num_tokens: int | None = None
        self.swa_max_total_num_tokens: int | None = None

        # Filled by alloc_memory_pool (the Scheduler calls it through the worker).
        self.memory_pool_config: Any = None
        self.req_to_token_pool: Any = None
        self.token_to_kv_pool: Any = None
        self.token_to_kv_pool_allocator: Any = None
        self.ngram_embedding_manager: Any = None

        # Read by status endpoints, metrics and the scheduler's setup; nothing behind them.
        self.attn_backend = AttentionBackendStub()
        self.model = torch.nn.Module()
        self.mtp_draft_device_pools: tuple[Any, ...] = ()
        self.mtp_draft_mamba_pools: tuple[Any, ...] = ()
        self.canary_manager = None
        self.hisparse_coordinator = None
        self.lora_manager = None
        self.eplb_manager = None
        self.device_timer = None
        self.prefill_cuda_graph_runner = None
        self.prefill_aware_swa = False
        self.weight_load_mem_usage = 0.0
        self.weight_load_time = 0.0
        self.preloaded_weights_bytes = 0
        self.graph_memory_usage: dict[str, float] = {}
        self.graph_time_usage: dict[str, float] = {}
        self.decode_cuda_graph_capture_bs: list[int] = []

    def account_preloaded_weights(self, nbytes: int) -> None:
        """Memory accounting hook of the real runner; nothing to account on the CPU."""

    def alloc_memory_pool(self, memory_pool_config: Any = None, **_: Any) -> None:
        """Build the pools with SGLang's ``KVCacheConfigurator._init_pools`` on the device."""
        from types import SimpleNamespace

        from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator, _PoolSizes
        from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import (
            NgramEmbeddingManager,
        )
        from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

        configurator = KVCacheConfigurator(
            device=self.device,
            gpu_id=self.gpu_id,
            attn_dp_size=1,
            pp_size=1,
            pp_group=None,
            model=None,
            model_config=self.model_config,
            server_args=self.server_args,
            kv_cache_dtype=self.kv_cache_dtype,
            model_dtype=self.dtype,
            page_size=self.page_size,
            sliding_window_size=None,
            spec_algorithm=self.spec_algorithm,
            is_draft_worker=False,
            post_capture_kv_active=False,
            spec_aux_config=SimpleNamespace(draft_model_config=None, dflash_draft_num_layers=None),  # type: ignore[arg-type]  # the 2 fields read; no speculative decoding
            is_hybrid_swa=False,
            is_hybrid_swa_compress=False,
            use_mla_backend=False,
            layer_info=self.layer_info,
            forward_stream=self.forward_stream,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            memory_pool_config=None,
        )
        if configurator.mambaish_config is not None:
            _required(self.server_args.max_mamba_cache_size, "max_mamba_cache_size")
        sizes = _PoolSizes(
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            full_max_total_num_tokens=None,
            swa_max_total_num_tokens=None,
            c4_max_total_num_tokens=0,
            c128_max_total_num_tokens=0,
            c4_state_pool_size=0,
            c128_state_pool_size=0,
            c4_state_dtype=None,
            c128_state_dtype=None,
        )
        pools = configurator._init_pools(
            sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None
        )
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool = pools.token_to_kv_pool
        self.token_to_kv_pool_allocator = pools.token_to_kv_pool_allocator
        self.memory_pool_config = MemoryPoolConfig(
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
        )
        # prepare_for_forward dereferences the manager; a disabled one is what a model
        # without ngram embeddings gets from SGLang.
        self.ngram_embedding_manager = NgramEmbeddingManager.from_model(
            model=self.model,
            model_config=self.model_config,
            req_to_token_pool=self.req_to_token_pool,
            max_running_requests=self.max_running_requests,
            device=self.device,
        )

    def prewarm_sampling(self) -> None:
        """The real runner warms its sampler kernels here; the CPU workers sample in torch."""

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached for names not set above (weight updaters, exporters, LoRA managers, ...):
        # refuse with the feature named; still an AttributeError for hasattr probes.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        unsupported(f"ModelRunner.{name}")
