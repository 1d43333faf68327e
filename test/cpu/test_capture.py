"""In-pass capture (``cpu/capture.py``): the states one model call captures at inner positions
equal the states a call ending there leaves, and capturing changes nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from sglang_hybrid.cpu.capture import PassCapture, modeling_fns
from sglang_hybrid.cpu.hf_model import load_hf_model
from sglang_hybrid.cpu.split_invariant import split_invariant_conv

N = 300
# On the 64-token grid, off it, closer than the conv width to the call's start, and one past
# the last full chunk.
OFFSETS = (1, 2, 64, 100, 128, 255, 256, 299)


def _model(model_dir: Path):
    return load_hf_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))


def _ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


def _run(model, ids: torch.Tensor, start: int, cache: DynamicCache, capture=None):
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    with torch.no_grad(), split_invariant_conv(model):
        if capture is None:
            return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        with capture.active(model, modeling_fns(model)):
            return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)


def _linear_states(cache: DynamicCache, linear: list[int], keep: int):
    return [
        (cache.layers[i].conv_states[0][0, :, -keep:], cache.layers[i].recurrent_states[0])
        for i in linear
    ]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("prefix", [0, 40])
def test_captured_states_equal_a_call_that_ends_there(tiny_models, arch: str, prefix: int):
    loaded = _model(tiny_models[arch])
    model, keep = loaded.model, loaded.conv_kernel - 1
    linear = [i for i, t in enumerate(loaded.layer_types) if t == "linear_attention"]
    ids = _ids(loaded.config.vocab_size, prefix + N)

    def fresh() -> DynamicCache:
        cache = DynamicCache(config=loaded.config)
        if prefix:
            _run(model, ids[:, :prefix], 0, cache)
        return cache

    capture = PassCapture(OFFSETS, N, keep)
    captured = _run(model, ids[:, prefix:], prefix, cache := fresh(), capture)
    plain = _run(model, ids[:, prefix:], prefix, cache_plain := fresh())
    # Capturing leaves the call itself alone: the rule runs over the same chunks.
    torch.testing.assert_close(captured.logits, plain.logits, rtol=0, atol=1e-6)
    for (c1, r1), (c2, r2) in zip(
        _linear_states(cache, linear, keep), _linear_states(cache_plain, linear, keep), strict=True
    ):
        assert torch.equal(c1, c2)
        torch.testing.assert_close(r1, r2, rtol=0, atol=1e-6)
    assert len(capture.conv) == len(capture.recurrent) == len(linear)
    for k, o in enumerate(OFFSETS):
        ref = _run(model, ids[:, prefix : prefix + o], prefix, ref_cache := fresh())
        del ref
        for layer, (conv, rec) in enumerate(_linear_states(ref_cache, linear, keep)):
            # Only the GEMMs before the rule see another number of rows (~1e-6 absolute here;
            # a wrong position or window would be off by the states themselves, O(0.1-1)).
            torch.testing.assert_close(capture.conv[layer][k], conv, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(capture.recurrent[layer][k], rec, rtol=1e-4, atol=1e-5)


def test_offsets_outside_the_call_are_refused():
    with pytest.raises(ValueError, match="not inside a call of 10 tokens"):
        PassCapture((0, 5), 10, 3)
    with pytest.raises(ValueError, match="not inside"):
        PassCapture((10,), 10, 3)
