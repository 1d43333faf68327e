"""A CPU worker that runs a tiny hybrid model from transformers, with SGLang's pools as its state.

Contract:
- Construction loads the model directory of ``ServerArgs.model_path`` with transformers
  (``hf_model.load_hf_model``; SGLang itself loads nothing, ``load_format="dummy"``), in
  float32. The KV pool follows ServerArgs' dtype, so anything but float32 is refused.
- SGLang's mamba conv state must be float32 (``SGLANG_MAMBA_CONV_DTYPE``, bf16 by default): the
  constructor sets the variable when unset and refuses another value, before the Scheduler sizes
  the pools; after the pools are built their conv, recurrent and KV dtypes are checked and a
  mismatch raises ``RuntimeError``.
- Each forward pass, after SGLang's deferred mamba copy-on-write / clear (base class), runs the
  requests one at a time: rebuild a transformers cache from the pools (``state_io``), run the
  request's new tokens at their absolute positions, write their K/V to ``out_cache_loc`` and the
  final conv + recurrent states back into the request's mamba slot, and choose the next token
  (``sampling``: greedy, or seeded temperature / top-k sampling). With ``record_logits`` set,
  ``logits[rid][position]`` keeps the float32 logits that chose the token at ``position`` and
  ``pieces[rid]`` lists the ``(start, end)`` position ranges of every model call made for the
  request, in order: the decomposition that decides whether two runs can agree bit for bit.
- State taps (``taps.py``): every requested position strictly inside the extend is captured
  inside the request's one model call (``capture.PassCapture``): the chunked gated-delta rule is
  cut on its own 64-token grid and an off-grid position is reached from the chunk state below
  it by the few tokens in between, the conv window is read from the conv's input; after the
  call each tap's states are written into its destination slot exactly as they would be stored
  in the request's own slot, and its position is recorded as done (``captured_taps[rid]`` with
  ``record_logits``). Cost: no extra model call, a < 64-token rule recompute per off-grid tap
  and linear layer. A captured state equals what a pass ending there stores up to the rounding
  of the GEMMs before the rule, which see another number of rows (~1e-6; ``split_invariant``).
- Speculative verify (``_verify_chain``, ``--speculative-algorithm CPU_MTP``): the chain runs
  token by token on one cache restored at the committed length, each step the computation of a
  plain decode step (so the accepted run equals a run without speculation bit for bit); the K/V
  of every input goes to its reserved slot, the state is stored after the accepted inputs only.
- CUDA build (``ServerArgs.device == "cuda"``, used by ``benchmark/gpu/check_backend.py``): the
  model runs on the GPU in the ServerArgs dtype (bf16 or fp16, as served), SGLang's pools are on
  the GPU (KV and conv state in that dtype: ``SGLANG_MAMBA_CONV_DTYPE`` must match it; recurrent
  state float32), and the GDN layers run SGLang's own Triton ``chunk_gated_delta_rule`` when it
  imports (``gdn_kernels``; ``self.gdn`` names it), transformers' plain torch otherwise. Logits
  are moved to the CPU for sampling and recording. The conv and attention stay the
  split-invariant torch ops of ``split_invariant``. Nothing of this changes the CPU path.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from sglang_hybrid.cpu import gdn_kernels
from sglang_hybrid.cpu.batch_spans import ReqSpan
from sglang_hybrid.cpu.capture import PassCapture, modeling_fns
from sglang_hybrid.cpu.conv_dtype import require_conv_state_dtype, require_float32_conv_state
from sglang_hybrid.cpu.hf_model import load_hf_model
from sglang_hybrid.cpu.sampling import next_token, unsupported_sampling
from sglang_hybrid.cpu.speculative import DraftSchedule, run_chain
from sglang_hybrid.cpu.split_invariant import split_invariant_conv
from sglang_hybrid.cpu.state_io import PoolView, restore_cache, store_linear_states, store_new_kv
from sglang_hybrid.cpu.taps import mark_tap_done, taps_inside
from sglang_hybrid.cpu.worker import ChainRequest, CpuTpWorker


class ModelWorker(CpuTpWorker):
    """Stands in for ``TpModelWorker`` and really computes (see the module contract)."""

    # The CUDA build's dtype rules (bf16 as served) on the CPU: a test hook, so the GPU check's
    # CPU smoke mode runs that path (benchmark/gpu/stage_scheduler.py). Off: the CPU path.
    AS_SERVED_ON_CPU = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        server_args = args[0] if args else kwargs["server_args"]
        self.cuda = str(server_args.device) == "cuda"
        self.as_served = self.cuda or type(self).AS_SERVED_ON_CPU
        if self.as_served:
            dtype_name = str(server_args.dtype)
            if dtype_name not in ("bfloat16", "float16"):
                raise ValueError(
                    f"the CUDA model worker computes as served, in bfloat16 or float16 (SGLang's "
                    f"Triton GDN kernel refuses float32); got dtype={dtype_name!r}"
                )
            require_conv_state_dtype(dtype_name)
        else:
            require_float32_conv_state()
        if not self.cuda:
            torch.set_num_threads(int(os.environ.get("SGLANG_HYBRID_CPU_THREADS", "1")))
        super().__init__(*args, **kwargs)
        if not self.as_served and self.model_config.dtype != torch.float32:
            raise ValueError(
                f"the CPU model worker computes in float32 but the KV pool would be "
                f"{self.model_config.dtype}: pass dtype='float32' in ServerArgs"
            )
        self.compute_dtype: torch.dtype = self.model_config.dtype
        loaded = load_hf_model(
            self.model_config.model_path, dtype=self.compute_dtype, device=self.device
        )
        # SGLang's Triton GDN kernel on CUDA when it imports; None keeps transformers' torch.
        self.gdn: gdn_kernels.GdnKernels | None = None
        self.gdn_note = "transformers' plain torch (CPU path)"
        if self.cuda:
            kernel, self.gdn_note = gdn_kernels.sglang_chunk_kernel()
            if kernel is not None:
                self.gdn = gdn_kernels.GdnKernels.sglang(kernel)
        self.hf_model = loaded.model
        self.hf_config = loaded.config
        self.layer_types = loaded.layer_types
        self.conv_kernel = loaded.conv_kernel
        self.record_logits = False
        self.logits: dict[str, dict[int, torch.Tensor]] = {}
        self.pieces: dict[str, list[tuple[int, int]]] = {}
        self.captured_taps: dict[str, list[int]] = {}  # positions captured inside a model call
        self._view: PoolView | None = None

    def alloc_memory_pool(self, memory_pool_config: Any = None, **kwargs: Any) -> None:
        super().alloc_memory_pool(memory_pool_config, **kwargs)
        runner = self.model_runner
        view = PoolView.from_pools(
            runner.req_to_token_pool,
            runner.token_to_kv_pool,
            self.layer_types,
            self.conv_kernel,
            compute_dtype=self.compute_dtype,
        )
        full_layer = self.layer_types.index("full_attention")
        dtypes = {
            "mamba conv state": (view.conv.dtype, self.compute_dtype),
            "mamba recurrent state": (view.temporal.dtype, torch.float32),
            "KV cache": (view.kv_pool.get_key_buffer(full_layer).dtype, self.compute_dtype),
        }
        wrong = {name: got for name, (got, want) in dtypes.items() if got != want}
        if wrong and not self.as_served:
            raise RuntimeError(
                f"the CPU model worker needs float32 pools, SGLang built {wrong} "
                "(SGLANG_MAMBA_CONV_DTYPE must be float32 before the pools are built)"
            )
        if wrong:
            raise RuntimeError(
                f"the CUDA model worker computes in {self.compute_dtype} with a float32 "
                f"recurrent state, SGLang built {wrong} (SGLANG_MAMBA_CONV_DTYPE must match "
                "the model dtype before the pools are built)"
            )
        self._view = view

    def unsupported_request_features(self, req: Any) -> list[str]:
        sampling = unsupported_sampling(req.sampling_params)
        return [*super().unsupported_request_features(req), *sampling]

    def logits_at(self, rid: str, position: int) -> torch.Tensor:
        """Recorded logits that chose ``rid``'s token at ``position`` (needs ``record_logits``)."""
        try:
            return self.logits[rid][position]
        except KeyError:
            raise KeyError(
                f"no logits recorded for {rid!r} at {position} (is record_logits set?)"
            ) from None

    def _next_tokens(self, batch: Any, spans: list[ReqSpan]) -> torch.Tensor:
        if self._view is None:
            raise RuntimeError("forward before the Scheduler allocated the pools")
        req_to_token_pool = self.model_runner.req_to_token_pool
        input_ids = batch.input_ids.to(self.device, torch.int64)
        out_cache_loc = batch.out_cache_loc.to(self.device, torch.int64)
        total = sum(span.extend_len for span in spans)
        if input_ids.numel() != total or out_cache_loc.numel() != total:
            raise RuntimeError(
                f"batch carries {input_ids.numel()} ids / {out_cache_loc.numel()} slots "
                f"for {total} new tokens"
            )
        req_pool_indices = batch.req_pool_indices.to(torch.int64).tolist()
        slots = req_to_token_pool.translate_mamba_indices(
            req_to_token_pool.get_mamba_indices(batch.req_pool_indices)
        ).tolist()
        tokens = []
        with (
            torch.no_grad(),
            split_invariant_conv(self.hf_model),
            gdn_kernels.swapped(self.hf_model, self.gdn),
        ):
            for span in spans:
                lo, hi = span.offset, span.offset + span.extend_len
                logits = self._forward_request(
                    span,
                    input_ids[lo:hi],
                    out_cache_loc[lo:hi],
                    req_pool_indices[span.index],
                    int(slots[span.index]),
                )
                tokens.append(self._choose(span.req, logits, span.prefix_len + span.extend_len))
        return torch.tensor(tokens, dtype=torch.int64)

    def _choose(self, req: Any, logits: torch.Tensor, position: int) -> int:
        """The token at ``position`` from the logits that predict it (recorded if asked)."""
        if self.cuda:  # sampling and recording happen on the CPU
            logits = logits.cpu()
        if self.record_logits:
            self.logits.setdefault(req.rid, {})[position] = logits.clone()
        if req.finished() or getattr(req, "to_finish", None) is not None:
            # Aborted at admission (SGLang still runs its one placeholder token): the token is
            # discarded, and its sampling parameters may be ones we refuse.
            return int(torch.argmax(logits))
        return next_token(logits, req.sampling_params, position, req.rid, self.random_seed)

    def _forward_request(
        self,
        span: ReqSpan,
        input_ids: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_idx: int,
        slot: int,
    ) -> torch.Tensor:
        """Run one request's new tokens; return the float32 logits of its last position."""
        view = self._view
        assert view is not None
        prefix, end = span.prefix_len, span.prefix_len + span.extend_len
        # The scheduler wrote the new slots into the request's row before the forward; the K/V we
        # write must land where later passes (and the radix tree) will look for them.
        if not torch.equal(view.kv_slots(req_pool_idx, prefix, end), out_cache_loc):
            raise RuntimeError(f"req_to_token row of {span.req.rid!r} disagrees with out_cache_loc")
        cache = restore_cache(view, self.hf_config, req_pool_idx, prefix, slot)
        # Taps strictly inside the extend are captured inside the one model call (capture.py).
        taps = taps_inside(span.req, prefix, span.extend_len)
        capture = None
        capturing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if taps:
            offsets = [tap.position - prefix for tap in taps]
            capture = PassCapture(offsets, span.extend_len, view.conv_kernel - 1)
            capturing = capture.active(self.hf_model, modeling_fns(self.hf_model))
        with capturing:
            out = self.hf_model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=torch.arange(
                    prefix, end, dtype=torch.int64, device=input_ids.device
                ).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if self.record_logits:
            self.pieces.setdefault(span.req.rid, []).append((prefix, end))
        if capture is not None:
            for tap in taps:
                capture.store(view, tap.position - prefix, tap.dst_slot)
                mark_tap_done(span.req, tap.position)
                if self.record_logits:
                    self.captured_taps.setdefault(span.req.rid, []).append(tap.position)
        logits = out.logits[0, -1].to(torch.float32)
        store_new_kv(view, cache, prefix, out_cache_loc)
        store_linear_states(view, cache, slot)
        return logits

    def _verify_chain(
        self, chain: ChainRequest, num_draft_tokens: int, drafts: DraftSchedule
    ) -> list[int]:
        """The chain token by token on one cache restored at the committed length: each step
        is the computation of a plain decode step, so the accepted run is bit for bit what a
        run without speculation emits. The K/V of every input goes to its reserved slot; the
        state is stored only after the accepted inputs."""
        view = self._view
        if view is None:
            raise RuntimeError("forward before the Scheduler allocated the pools")
        req = chain.req
        cache = restore_cache(view, self.hf_config, chain.row, chain.start, chain.slot)

        def step(token: int, position: int) -> int:
            out = self.hf_model(
                input_ids=torch.tensor([[token]], dtype=torch.int64, device=self.device),
                position_ids=torch.tensor([[position]], dtype=torch.int64, device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            if self.record_logits:
                # Positions past a rejection are recorded too; the next round overwrites them.
                self.pieces.setdefault(req.rid, []).append((position, position + 1))
            return self._choose(req, out.logits[0, -1].to(torch.float32), position + 1)

        with (
            torch.no_grad(),
            split_invariant_conv(self.hf_model),
            gdn_kernels.swapped(self.hf_model, self.gdn),
        ):
            run = run_chain(
                step,
                lambda: store_linear_states(view, cache, chain.slot),
                bonus=chain.bonus,
                start=chain.start,
                num_draft_tokens=num_draft_tokens,
                drafts=drafts,
                vocab_size=int(self.model_config.vocab_size),
            )
        store_new_kv(view, cache, chain.start, chain.kv_slots.to(self.device))
        return run
