"""Next-token choice for the CPU model worker: greedy, or seeded temperature / top-k sampling.

Contract: ``next_token(logits, params, position, rid, default_seed)`` returns the argmax when
SGLang normalised the request to greedy (``top_k == 1``, what ``temperature=0`` becomes).
Otherwise it samples from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest
logits, with a generator seeded by (seed, position): ``params.sampling_seed`` when given, else
(``default_seed``, ``rid``). The draw therefore depends only on the logits, the seed and the
absolute position, not on batch composition or on how the prompt was split, so a cached run
samples what an uncached one samples. Sampling options the worker does not implement (top-p,
min-p, penalties, logit bias) raise ``NotImplementedError`` naming them.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

_MASK64 = (1 << 64) - 1


def _seed_for(seed: int, position: int) -> int:
    # SplitMix64 of (seed, position): neighbouring positions get unrelated generator seeds.
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def unsupported_sampling(params: Any) -> list[str]:
    """The sampling parameters of ``params`` that ``next_token`` cannot honour."""
    unsupported = []
    if params.top_p < 1.0:
        unsupported.append("top_p")
    if params.min_p > 0.0:
        unsupported.append("min_p")
    if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0:
        unsupported.append("penalties")
    if params.logit_bias:
        unsupported.append("logit_bias")
    return unsupported


def _refuse_unsupported(params: Any) -> None:
    unsupported = unsupported_sampling(params)
    if unsupported:
        raise NotImplementedError(
            f"the sglang_hybrid CPU model worker does not sample with {', '.join(unsupported)}"
        )


def next_token(
    logits: torch.Tensor, params: Any, position: int, rid: str, default_seed: int
) -> int:
    """The token to emit at absolute ``position`` given the last-position ``logits``."""
    _refuse_unsupported(params)
    if params.top_k == 1:
        return int(torch.argmax(logits))
    seed = params.sampling_seed
    if seed is None:
        seed = (default_seed << 32) ^ zlib.crc32(rid.encode())
    scaled = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    generator = torch.Generator().manual_seed(_seed_for(int(seed), position))
    return int(torch.multinomial(probs, 1, generator=generator))
