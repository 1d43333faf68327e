"""A plain-torch stand-in with the signature of SGLang's Triton ``chunk_gated_delta_rule``.

For the CPU smoke mode only: SGLang's kernel needs a GPU (Triton's interpreter did not compute it
correctly here), so on the CPU the stages call this instead, through exactly the code the GPU
path uses (``sglang_hybrid.cpu.gdn_kernels``'s adapter in stage B, the chunk-state comparisons
in stage C). It computes with transformers' reference ``torch_chunk_gated_delta_rule`` one
64-token chunk at a time, so that it can return ``h`` like the kernel: the state at the start of
every chunk, ``[B, NT, H, V, K]`` in the inputs' dtype. Semantics as SGLang's: q/k ``[B, T, Hg,
K]`` (Hg divides H), v ``[B, T, H, V]``, state ``[N, H, V, K]`` float32 read at and written back
to ``initial_state[initial_state_indices]``; returns ``(o, None, h)``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_next import modeling_qwen3_next

# Taken at import, before any forward swaps the module's function for an adapter.
_REFERENCE = modeling_qwen3_next.torch_chunk_gated_delta_rule
CHUNK = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    cu_seqlens: Any = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    inplace_update: bool = True,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    if cu_seqlens is not None or head_first:
        raise NotImplementedError("the stand-in takes equal-length sequences, head last")
    batch, length, k_heads, k_dim = k.shape
    heads, v_dim = v.shape[2], v.shape[3]
    if heads != k_heads:
        q = q.repeat_interleave(heads // k_heads, dim=2)
        k = k.repeat_interleave(heads // k_heads, dim=2)
    if scale is not None and abs(scale - k_dim**-0.5) > 1e-12:
        raise NotImplementedError("the stand-in uses the default scale 1/sqrt(K)")
    if initial_state is not None:
        idx = initial_state_indices.long()
        state = initial_state[idx].transpose(-1, -2).to(torch.float32)  # [B, H, K, V]
    else:
        state = torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    chunks = -(-length // CHUNK)
    h = torch.empty(batch, chunks, heads, v_dim, k_dim, dtype=k.dtype, device=k.device)
    outs = []
    for c in range(chunks):
        h[:, c] = state.transpose(-1, -2).to(k.dtype)
        sl = slice(c * CHUNK, min(length, (c + 1) * CHUNK))
        o, state = _REFERENCE(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g=g[:, sl],
            beta=beta[:, sl],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outs.append(o)
    if initial_state is not None and inplace_update:
        initial_state[initial_state_indices.long()] = state.transpose(-1, -2).to(
            initial_state.dtype
        )
    return torch.cat(outs, dim=1), None, h
