"""Split-invariant replacements for the ops of the tiny models whose rounding depends on length.

A request's tokens reach the model in pieces that depend on caching: one whole prompt, 64-token
chunks, a resumed suffix, single decode steps. For a cached run to reproduce an uncached one
bit for bit, every op must compute a token's output the same way whatever piece it is in.
transformers' pure-torch paths mostly do; these two do not, and are replaced cheaply:

- The causal depthwise conv of the linear-attention layers (``causal_conv1d_fn`` for prefill
  and ``causal_conv1d_update`` for decode use ``F.conv1d`` on inputs of different lengths).
  ``shift_add_conv_fn`` / ``shift_add_conv_update`` compute every output as the same fixed-order
  sum of ``W`` products, so a token's conv output depends only on its ``W`` inputs.
- Full attention: a masked matmul-softmax-matmul over all keys reduces over a length that
  depends on the piece. ``rowwise_attention`` computes each query row against exactly the keys
  it may see, in one fixed shape per row; decode (one row) is the same computation as the
  matching prefill row. Registered with transformers' ``AttentionInterface`` as
  ``ROWWISE_ATTENTION`` and chosen per model with ``attn_implementation``.

``split_invariant_conv(model)`` swaps the conv functions into the model's modeling module for
the duration of a forward and restores them afterwards (transformers calls them as module
globals; there is no per-model hook).

What stays split-dependent (documented, not fixed): ``nn.Linear`` / MoE expert GEMMs on 1 row
vs N rows (~4e-7 relative); the chunked gated-delta rule, whose 64-token chunks are aligned to
the start of each forward call; and vectorised transcendental element-wise ops (SiLU, exp,
rsqrt), whose last elements may take a different code path when the tensor length changes
(1 ulp, ~3e-8). Two runs that cut a request into the same pieces compute every op on the same
shapes and agree bit for bit; runs cut differently agree to ~1e-6 in the logits.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

ROWWISE_ATTENTION = "sglang_hybrid_rowwise"


def shift_add_conv_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **_: Any,
) -> torch.Tensor:
    """Causal depthwise conv over ``[B, C, T]`` with zero left context, as a fixed-order sum."""
    seq_len = hidden_states.shape[-1]
    width = weight.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (width - 1, 0))
    out = x[:, :, 0:seq_len] * weight[:, 0, None]
    for j in range(1, width):
        out = out + x[:, :, j : j + seq_len] * weight[:, j, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def shift_add_conv_update(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Decode step of the conv: same arithmetic as ``shift_add_conv_fn``; updates ``conv_state``."""
    seq_len = hidden_states.shape[-1]
    width = weight.shape[-1]
    state_len = conv_state.shape[-1]
    x = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(x[:, :, -state_len:])
    first = x.shape[-1] - seq_len - (width - 1)  # oldest input of the first new output
    out = x[:, :, first : first + seq_len] * weight[:, 0, None]
    for j in range(1, width):
        out = out + x[:, :, first + j : first + j + seq_len] * weight[:, j, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention, one query row at a time against exactly its visible keys.

    ``query`` is ``[B, Hq, T, D]``; ``key``/``value`` are ``[B, Hkv, S, D]`` where the last ``T``
    keys belong to the queries (S - T cached keys precede them). The mask is not read: the
    workers run one unpadded sequence per call, so causality is the only constraint.
    """
    _, n_heads, n_queries, head_dim = query.shape
    n_keys = key.shape[2]
    groups = n_heads // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = head_dim**-0.5 if scaling is None else scaling
    out = torch.empty(
        query.shape[0], n_heads, n_queries, value.shape[-1], dtype=query.dtype, device=query.device
    )
    for i in range(n_queries):
        visible = n_keys - n_queries + i + 1
        scores = torch.matmul(query[:, :, i : i + 1, :], key[:, :, :visible, :].transpose(-1, -2))
        probs = torch.softmax((scores * scale).float(), dim=-1).to(value.dtype)
        out[:, :, i : i + 1, :] = torch.matmul(probs, value[:, :, :visible, :])
    return out.transpose(1, 2).contiguous(), None


def register_rowwise_attention() -> None:
    """Make ``attn_implementation=ROWWISE_ATTENTION`` available to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)


@contextlib.contextmanager
def split_invariant_conv(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's modeling module uses the shift-and-add conv functions."""
    names = {"causal_conv1d_fn": shift_add_conv_fn, "causal_conv1d_update": shift_add_conv_update}
    with patched_modeling(model, names):
        yield


@contextlib.contextmanager
def patched_modeling(model: torch.nn.Module, names: dict[str, Any]) -> Iterator[None]:
    """Within the block, the functions ``names`` of the model's modeling module are replaced."""
    module = sys.modules.get(type(model).__module__) or importlib.import_module(
        type(model).__module__
    )
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"{module.__name__} has no {missing}: transformers changed its layout")
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in names.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
