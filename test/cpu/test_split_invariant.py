"""The split-invariant ops: same values as transformers' own, and independent of how a sequence
is cut into pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_hybrid.cpu.split_invariant import (
    rowwise_attention,
    shift_add_conv_fn,
    shift_add_conv_update,
)


def _conv_inputs(seed: int = 0, channels: int = 24, length: int = 70, width: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, channels, length, generator=g), torch.randn(channels, width, generator=g)


def test_shift_add_conv_matches_a_causal_depthwise_conv():
    x, w = _conv_inputs()
    ref = F.conv1d(x, w.unsqueeze(1), padding=w.shape[-1] - 1, groups=x.shape[1])[
        ..., : x.shape[-1]
    ]
    out = shift_add_conv_fn(x, w, activation="silu")
    torch.testing.assert_close(out, F.silu(ref), rtol=0, atol=1e-6)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_shift_add_conv_is_split_invariant(activation):
    x, w = _conv_inputs(seed=1)
    width = w.shape[-1]
    whole = shift_add_conv_fn(x, w, activation=activation)
    # Prefill the first 37 tokens, then continue with the state, as a resumed request does:
    # transformers prepends the W-column conv state and drops the extra outputs.
    cut = 37
    first = shift_add_conv_fn(x[..., :cut], w, activation=activation)
    state = F.pad(x[..., :cut], (width, 0))[..., -width:]
    resumed = shift_add_conv_fn(torch.cat([state, x[..., cut:]], -1), w, activation=activation)
    pieces = torch.cat([first, resumed[..., width:]], -1)
    # Decode steps one token at a time.
    conv_state = state.clone()
    steps = [
        shift_add_conv_update(x[..., t : t + 1], conv_state, w, activation=activation)
        for t in range(cut, x.shape[-1])
    ]
    decoded = torch.cat([first, *steps], -1)
    if activation is None:
        # The conv arithmetic itself (products and sums in a fixed order) is bitwise invariant.
        assert torch.equal(pieces, whole)
        assert torch.equal(decoded, whole)
    else:
        # Vectorised SiLU may round the last elements of a tensor differently (documented).
        torch.testing.assert_close(pieces, whole, rtol=3e-7, atol=1e-8)  # ~1 ulp
        torch.testing.assert_close(decoded, whole, rtol=3e-7, atol=1e-8)


def _attention_inputs(seed: int = 0, n_keys: int = 50, heads: int = 4, kv_heads: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n_keys, 16, generator=g)
    k = torch.randn(1, kv_heads, n_keys, 16, generator=g)
    v = torch.randn(1, kv_heads, n_keys, 8, generator=g)
    return q, k, v


def test_rowwise_attention_matches_causal_attention():
    q, k, v = _attention_inputs()
    out, _ = rowwise_attention(torch.nn.Module(), q, k, v, None, scaling=0.25)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-5)


def test_rowwise_attention_rows_do_not_depend_on_the_piece():
    q, k, v = _attention_inputs(seed=3)
    whole, _ = rowwise_attention(torch.nn.Module(), q, k, v, None)
    # The last 13 queries as a resumed piece (all keys cached before them), then one decode row.
    tail, _ = rowwise_attention(torch.nn.Module(), q[:, :, -13:], k, v, None)
    assert torch.equal(tail, whole[:, -13:])
    row, _ = rowwise_attention(torch.nn.Module(), q[:, :, 20:21], k[:, :, :21], v[:, :, :21], None)
    assert torch.equal(row, whole[:, 20:21])
