"""Move a request's model state between SGLang's pools and a transformers cache.

SGLang's pools are the storage of record; a transformers ``DynamicCache`` exists only for the
duration of one forward call. Layouts (checked against the pools when a ``PoolView`` is built):

- Full-attention K/V: the KV pool's ``get_key_buffer(global_layer_id)`` /
  ``get_value_buffer`` are ``[kv slots, Hkv, D]`` (post-RoPE); a request's slots are its
  ``req_to_token`` row. transformers keeps ``[B, Hkv, T, D]``.
- Conv state: ``mamba_cache.conv[0]`` is ``[linear layers, mamba slots, conv_dim, W - 1]``, the
  last ``W - 1`` conv inputs. transformers keeps ``[B, conv_dim, W]`` and never reads column 0,
  so a restore pads column 0 with zeros and a store keeps the last ``W - 1`` columns.
- Recurrent state: ``mamba_cache.temporal`` is ``[linear layers, slots, Hv, V, K]``;
  transformers uses ``[B, Hv, K, V]``: the last two dims are transposed both ways, and the
  restored tensor is made contiguous (a transposed view rounds differently, ~8e-7).
- Linear layers are indexed densely through ``req_to_token_pool.mamba_map`` (global id ->
  dense index). Slots are physical (already translated) mamba slot indices.

Tensors are built on the pools' device, K/V and conv state in ``PoolView.compute_dtype`` (the
model dtype: float32 on the CPU, bf16 in the CUDA build), the recurrent state in float32.

A restore marks every linear layer ``has_previous_state`` (via ``update_conv_state``); without it
transformers would treat the resumed pass as a fresh prompt. ``prefix_len == 0`` restores
nothing: a fresh prompt starts from zero states whatever the slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool tensors and index maps one model's state lives in."""

    req_to_token: torch.Tensor  # [req slots, max context] int32 KV slot ids
    kv_pool: Any  # SGLang KV pool (get_key_buffer / get_value_buffer by global layer id)
    conv: torch.Tensor  # [linear layers, mamba slots, conv_dim, W - 1]
    temporal: torch.Tensor  # [linear layers, mamba slots, Hv, V, K]
    mamba_index: dict[int, int]  # global layer id -> dense linear-layer index
    layer_types: tuple[str, ...]
    conv_kernel: int
    compute_dtype: torch.dtype = torch.float32  # the model's dtype (K/V, conv inputs)

    @classmethod
    def from_pools(
        cls,
        req_to_token_pool: Any,
        kv_pool: Any,
        layer_types: list[str],
        conv_kernel: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> PoolView:
        cache = req_to_token_pool.mamba_pool.mamba_cache
        if len(cache.conv) != 1:
            raise NotImplementedError(f"{len(cache.conv)} conv state tensors per layer")
        conv = cache.conv[0]
        linear_ids = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        mamba_index = dict(req_to_token_pool.mamba_map)
        if sorted(mamba_index) != linear_ids:
            raise RuntimeError(f"pool linear layers {sorted(mamba_index)} != model {linear_ids}")
        if conv.shape[-1] != conv_kernel - 1:
            raise RuntimeError(f"conv state keeps {conv.shape[-1]} columns, kernel {conv_kernel}")
        return cls(
            req_to_token=req_to_token_pool.req_to_token,
            kv_pool=kv_pool,
            conv=conv,
            temporal=cache.temporal,
            mamba_index=mamba_index,
            layer_types=tuple(layer_types),
            conv_kernel=conv_kernel,
            compute_dtype=compute_dtype,
        )

    def kv_slots(self, req_pool_idx: int, start: int, end: int) -> torch.Tensor:
        """KV slot ids of positions ``[start, end)`` of a request, as int64."""
        return self.req_to_token[req_pool_idx, start:end].to(torch.int64)


def restore_cache(
    view: PoolView, hf_config: Any, req_pool_idx: int, prefix_len: int, slot: int
) -> DynamicCache:
    """A transformers cache holding the request's first ``prefix_len`` tokens of state."""
    cache = DynamicCache(config=hf_config)
    if prefix_len == 0:
        return cache
    locs = view.kv_slots(req_pool_idx, 0, prefix_len)
    width = view.conv_kernel
    for layer_id, kind in enumerate(view.layer_types):
        # transformers types each layer as the union of both kinds; layer_types says which
        layer: Any = cache.layers[layer_id]
        if kind == "linear_attention":
            dense = view.mamba_index[layer_id]
            conv = view.conv[dense, slot]  # [conv_dim, W - 1]
            padded = torch.zeros(
                1, conv.shape[0], width, dtype=view.compute_dtype, device=conv.device
            )
            padded[0, :, 1:] = conv
            layer.update_conv_state(padded)  # also sets has_previous_state
            recurrent = view.temporal[dense, slot].transpose(-1, -2)  # [Hv, K, V]
            layer.update_recurrent_state(recurrent.unsqueeze(0).to(torch.float32).contiguous())
        else:
            keys = view.kv_pool.get_key_buffer(layer_id)[locs]  # [P, Hkv, D]
            values = view.kv_pool.get_value_buffer(layer_id)[locs]
            layer.update(
                keys.permute(1, 0, 2).unsqueeze(0).to(view.compute_dtype).contiguous(),
                values.permute(1, 0, 2).unsqueeze(0).to(view.compute_dtype).contiguous(),
            )
    return cache


def store_linear_states(view: PoolView, cache: DynamicCache, slot: int) -> None:
    """Write every linear layer's conv and recurrent state of ``cache`` into mamba ``slot``."""
    keep = view.conv_kernel - 1
    for layer_id, dense in view.mamba_index.items():
        layer: Any = cache.layers[layer_id]  # a linear-attention layer (see restore_cache)
        view.conv[dense, slot].copy_(layer.conv_states[0][0, :, -keep:])
        view.temporal[dense, slot].copy_(layer.recurrent_states[0][0].transpose(-1, -2))


def store_new_kv(
    view: PoolView, cache: DynamicCache, prefix_len: int, out_cache_loc: torch.Tensor
) -> None:
    """Write the K/V of the tokens after ``prefix_len`` to their KV slots ``out_cache_loc``."""
    for layer_id, kind in enumerate(view.layer_types):
        if kind == "linear_attention":
            continue
        layer: Any = cache.layers[layer_id]  # an attention layer (see restore_cache)
        if layer.keys.shape[2] != prefix_len + out_cache_loc.numel():
            raise RuntimeError(
                f"layer {layer_id} holds {layer.keys.shape[2]} tokens, expected "
                f"{prefix_len} + {out_cache_loc.numel()}"
            )
        key_buf = view.kv_pool.get_key_buffer(layer_id)
        value_buf = view.kv_pool.get_value_buffer(layer_id)
        key_buf[out_cache_loc] = layer.keys[0, :, prefix_len:, :].permute(1, 0, 2).to(key_buf.dtype)
        value_buf[out_cache_loc] = (
            layer.values[0, :, prefix_len:, :].permute(1, 0, 2).to(value_buf.dtype)
        )
