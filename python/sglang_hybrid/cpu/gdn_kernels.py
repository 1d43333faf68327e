"""Gated-DeltaNet kernels for the CUDA build of the model worker.

transformers' Qwen3-Next / Qwen3.5 GDN layers call two module-level functions of their modeling
module: ``torch_chunk_gated_delta_rule`` (a prefill call) and ``torch_recurrent_gated_delta_rule``
(a one-token call with a previous state). ``swapped(model, kernels)`` replaces both for the
duration of a forward, as ``split_invariant.split_invariant_conv`` does for the conv.

- ``sglang_chunk_kernel()`` imports SGLang's own Triton ``chunk_gated_delta_rule``
  (``sglang.kernels.ops.attention.fla.chunk``; the kernel SGLang's GDN backend runs for extend)
  or returns None with the reason (no CUDA, no Triton, an import error).
- ``GdnKernels.sglang(kernel)`` adapts a function with that kernel's signature to transformers'
  call: q/k/v ``[B, T, H, D]`` in the model dtype (the Triton kernel refuses float32: the CUDA
  build computes in bf16, as served), the state converted from transformers' ``[B, H, K, V]`` to
  SGLang's ``[N, H, V, K]`` float32 and updated in place, returned transposed back. Prefill and
  decode both go through it: a one-token decode call and the same row of a prefill run one kernel.

Nothing here runs on the CPU path of the worker (``ModelWorker.gdn`` is None there, and the
model keeps transformers' plain-torch functions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .split_invariant import patched_modeling

CHUNK_FN = "torch_chunk_gated_delta_rule"
RECURRENT_FN = "torch_recurrent_gated_delta_rule"


@dataclass(frozen=True)
class GdnKernels:
    """What replaces transformers' two GDN functions, and a name for logs and reports."""

    name: str
    chunk: Callable[..., Any]
    recurrent: Callable[..., Any]

    @classmethod
    def sglang(cls, kernel: Callable[..., Any], name: str = "sglang-triton") -> GdnKernels:
        fn = _adapt(kernel)
        return cls(name, fn, fn)


def sglang_chunk_kernel() -> tuple[Callable[..., Any] | None, str]:
    """SGLang's Triton ``chunk_gated_delta_rule``, or None and why it is unavailable."""
    if not torch.cuda.is_available():
        return None, "no CUDA device: SGLang's Triton GDN kernels need one"
    try:
        from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule
    except Exception as e:  # any import failure means "use plain torch"
        return None, f"importing sglang.kernels.ops.attention.fla.chunk failed: {e!r}"
    return chunk_gated_delta_rule, "sglang.kernels.ops.attention.fla.chunk.chunk_gated_delta_rule"


def _adapt(kernel: Callable[..., Any]) -> Callable[..., Any]:
    def gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, _, heads, k_dim = key.shape
        v_dim = value.shape[-1]
        if initial_state is None:
            state = torch.zeros(
                batch, heads, v_dim, k_dim, dtype=torch.float32, device=query.device
            )
        else:  # transformers [B, H, K, V] -> SGLang [N, H, V, K]
            state = initial_state.transpose(-1, -2).to(torch.float32).contiguous()
        indices = torch.arange(batch, dtype=torch.int32, device=query.device)
        out = kernel(
            query,
            key,
            value,
            g.to(torch.float32),
            beta,
            initial_state=state,
            initial_state_indices=indices,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        o = out[0]
        final = state.transpose(-1, -2).contiguous() if output_final_state else None
        return o.to(query.dtype), final

    return gated_delta_rule


@contextlib.contextmanager
def swapped(model: torch.nn.Module, kernels: GdnKernels | None) -> Iterator[None]:
    """Within the block, the model's GDN layers call ``kernels`` (nothing changes for None)."""
    if kernels is None:
        yield
        return
    names = {CHUNK_FN: kernels.chunk, RECURRENT_FN: kernels.recurrent}
    with patched_modeling(model, names):
        yield
