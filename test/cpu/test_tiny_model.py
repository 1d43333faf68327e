"""Tiny model writer: SGLang sees a hybrid GDN model; weights load back; tokenizer; template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hybrid.cpu import tiny_tokenizer
from sglang_hybrid.cpu.tiny_model import FINGERPRINT_FILE, write_tiny_model

ARCHS = ("qwen3_5", "qwen3_next")


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_model_config_sees_a_hybrid_gdn_model(tiny_models: dict[str, Path], arch: str):
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from sglang_hybrid.cpu.install import cpu_server_args

    server_args = ServerArgs(**cpu_server_args(model_path=str(tiny_models[arch])))
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    model_config = ModelConfig.from_server_args(server_args)
    gdn = hybrid_gdn_config(model_config)
    assert gdn is not None and mambaish_config(model_config) is gdn
    assert model_config.hf_config.architectures == [
        {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}[arch]
    ]
    assert str(model_config.dtype) == "torch.float32"
    assert model_config.vocab_size == 2048
    assert gdn.linear_layer_ids == [0, 1, 2, 4, 5, 6]
    assert gdn.full_attention_layer_ids == [3, 7]
    shape = gdn.mamba2_cache_params.shape
    # Unequal key/value head dims, so a missing transpose of the recurrent state cannot hide.
    assert shape.temporal == (8, 48, 32)
    assert shape.head_dim != shape.state_size


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_load_back_by_name(tiny_models: dict[str, Path], arch: str):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_models[arch], dtype=torch.float32, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.layer_types.count("full_attention") == 2


def test_writer_is_idempotent_and_rebuilds_incomplete_dirs(qwen35_dir: Path, tmp_path: Path):
    weights = qwen35_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert write_tiny_model(qwen35_dir, "qwen3_5", seed=0) == qwen35_dir
    assert weights.stat().st_mtime_ns == before  # reused, not rewritten

    # A different seed is a different model: the fingerprint no longer matches.
    other = tmp_path / "copy"
    other.mkdir()
    for f in qwen35_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    fp = json.loads((other / FINGERPRINT_FILE).read_text())
    assert fp["seed"] == 0
    (other / "model.safetensors").unlink()  # incomplete directory
    write_tiny_model(other, "qwen3_5", seed=0)
    assert (other / "model.safetensors").read_bytes() == weights.read_bytes()  # same seed


def test_cli_reuses_a_complete_directory(qwen35_dir: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "sglang_hybrid.cpu.tiny_model", "--arch", "qwen3_5", "--out",
         str(qwen35_dir)],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == str(qwen35_dir)


def test_unknown_arch_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown tiny model arch"):
        write_tiny_model(tmp_path, "llama")  # type: ignore[arg-type]  # the refused arch


# ---------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer(qwen35_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen35_dir, local_files_only=True)


def test_tokenizer_round_trips_and_fits_the_vocab(tokenizer):
    assert len(tokenizer) <= 2048
    text = 'Hello, wörld! The cache keeps 42 states; {"a": [1, 2]}\n\tTabs and ünïcödé 🚀.'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < 2048
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"


def test_markers_are_single_tokens(tokenizer):
    for marker in (*tiny_tokenizer.SPECIAL_TOKENS, *tiny_tokenizer.TAG_TOKENS):
        ids = tokenizer.encode(f"a{marker}b", add_special_tokens=False)
        assert tokenizer.convert_ids_to_tokens(ids).count(marker) == 1, marker


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "EARLY-THOUGHT need the tool",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "TOOL-RESULT-1"},
    {"role": "tool", "content": "TOOL-RESULT-2"},
    {"role": "assistant", "content": "<think>MIDDLE-THOUGHT</think>It is sunny."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "LAST-THOUGHT"},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]


def test_chat_template_keeps_thinking_for_the_last_assistant_turn_only(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert "EARLY-THOUGHT" not in text
    assert "MIDDLE-THOUGHT" not in text
    assert "<think>\nLAST-THOUGHT\n</think>\n\nYou're welcome.<|im_end|>" in text
    assert text.count("<think>") == 1
    assert "It is sunny." in text
    # Within the last turn every assistant message keeps its thinking (tool-call loops).
    in_progress = tokenizer.apply_chat_template(
        CONVERSATION[:5], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<think>\nEARLY-THOUGHT need the tool\n</think>\n\n<tool_call>" in in_progress


def test_chat_template_renders_tools_tool_calls_and_tool_roles(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are terse.")
    assert '"name": "get_weather"' in system and "<tools>" in system
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert call in text
    # Consecutive tool messages share one user block, in order.
    assert (
        "<|im_start|>user\n<tool_response>\nTOOL-RESULT-1\n</tool_response>\n"
        "<tool_response>\nTOOL-RESULT-2\n</tool_response><|im_end|>"
    ) in text


def test_chat_template_generation_prompt_and_history_rerender(tokenizer):
    turn1 = CONVERSATION[:2]
    prompt1 = tokenizer.apply_chat_template(turn1, tokenize=False, add_generation_prompt=True)
    assert prompt1.endswith("<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(turn1, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    # The next turn re-renders the answered turn without its thinking: the rendered history is
    # not a continuation of what the model saw when it produced the thinking.
    answered = [*turn1, {"role": "assistant", "content": "Sunny.", "reasoning_content": "hmm"}]
    seen = tokenizer.apply_chat_template(answered, tokenize=False)
    nxt = tokenizer.apply_chat_template(
        [*answered, {"role": "user", "content": "And Rome?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "hmm" in seen and "hmm" not in nxt
    assert nxt.startswith(prompt1)
