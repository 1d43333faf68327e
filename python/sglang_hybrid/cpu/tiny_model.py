"""Write a tiny random-weight hybrid (Gated DeltaNet + full attention) model directory.

Contract:
- ``write_tiny_model(out_dir, arch, seed=0) -> Path`` writes ``config.json``,
  ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
  and a fingerprint file, and returns ``out_dir``. It is idempotent: a directory whose fingerprint
  matches the requested (arch, seed, generator version) and whose files are all present is reused
  untouched; anything else is rebuilt. The fingerprint is written last, so a crash mid-write
  leaves a directory that the next call rebuilds.
- ``arch`` is ``"qwen3_5"`` (``Qwen3_5ForCausalLM``, model type ``qwen3_5_text``: SGLang maps it
  to its own ``Qwen3_5TextConfig``, a hybrid GDN config) or ``"qwen3_next"``
  (``Qwen3NextForCausalLM``, a small MoE). Both: hidden 256, 8 layers in the pattern
  3 linear-attention : 1 full-attention, vocab 2048, float32, linear-attention key head dim 32
  and value head dim 48 (unequal, so a missing transpose of the recurrent state fails loudly),
  conv kernel 4. ``full_attention_interval: 4`` is added to the JSON because SGLang's
  Qwen3-Next config class derives the layer pattern from it.
- Weights are transformers' own initialisation of the architecture's class under
  ``torch.manual_seed(seed)`` (the global RNG is restored afterwards), saved with
  ``save_pretrained``, so ``from_pretrained`` loads every tensor back by name.
- Nothing is downloaded; this works with ``HF_HUB_OFFLINE=1``.

CLI: ``python -m sglang_hybrid.cpu.tiny_model --arch {qwen3_5,qwen3_next} --out DIR [--seed 0]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, get_args

from sglang_hybrid.cpu import tiny_tokenizer

TinyArch = Literal["qwen3_5", "qwen3_next"]
ARCHS: tuple[str, ...] = get_args(TinyArch)

# Bump when the written files change for the same (arch, seed), so stale directories rebuild.
GENERATOR_VERSION = 1
FINGERPRINT_FILE = "sglang_hybrid_tiny_model.json"
MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

NUM_LAYERS = 8
FULL_ATTENTION_INTERVAL = 4
VOCAB_SIZE = tiny_tokenizer.MAX_VOCAB


def layer_types() -> list[str]:
    """Every FULL_ATTENTION_INTERVAL-th layer is full attention, the rest linear attention."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(NUM_LAYERS)
    ]


def config_kwargs(arch: TinyArch, special_ids: dict[str, int]) -> dict[str, object]:
    """Keyword arguments for the transformers config class of ``arch``."""
    common: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": layer_types(),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 48,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": special_ids[tiny_tokenizer.IM_END],
        "pad_token_id": special_ids[tiny_tokenizer.ENDOFTEXT],
        "bos_token_id": None,
        "dtype": "float32",
    }
    if arch == "qwen3_5":
        return {**common, "architectures": ["Qwen3_5ForCausalLM"]}
    if arch == "qwen3_next":
        return {
            **common,
            "architectures": ["Qwen3NextForCausalLM"],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        }
    raise ValueError(f"unknown tiny model arch {arch!r}; expected one of {ARCHS}")


def fingerprint(arch: TinyArch, seed: int) -> dict[str, object]:
    """What a complete directory for (arch, seed) must record; covers template and corpus edits."""
    digest = hashlib.sha256()
    for part in (
        tiny_tokenizer.CHAT_TEMPLATE,
        tiny_tokenizer.build_tokenizer().to_str(),
        json.dumps(config_kwargs(arch, {t: 0 for t in tiny_tokenizer.SPECIAL_TOKENS})),
    ):
        digest.update(part.encode())
    return {
        "generator_version": GENERATOR_VERSION,
        "arch": arch,
        "seed": seed,
        "spec_sha256": digest.hexdigest(),
    }


def is_complete(out_dir: Path, arch: TinyArch, seed: int) -> bool:
    """True when ``out_dir`` holds every file and a fingerprint equal to the requested one."""
    fp_path = out_dir / FINGERPRINT_FILE
    if not fp_path.is_file() or not all((out_dir / f).is_file() for f in MODEL_FILES):
        return False
    try:
        recorded = json.loads(fp_path.read_text())
    except (OSError, ValueError):
        return False
    return recorded == fingerprint(arch, seed)


def _build_weights(arch: TinyArch, out_dir: Path, special_ids: dict[str, int], seed: int) -> None:
    import torch
    import transformers

    kwargs: dict[str, Any] = config_kwargs(arch, special_ids)  # each key typed by the class
    config: transformers.PretrainedConfig
    model_cls: type[transformers.PreTrainedModel]
    if arch == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(**kwargs)
        model_cls = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.Qwen3NextConfig(**kwargs)
        model_cls = transformers.Qwen3NextForCausalLM
    # fork_rng: the seed must fix the weights without disturbing the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()  # type: ignore[arg-type]  # transformers' wraps(Module.to): mypy sees it unbound
    model.save_pretrained(out_dir, safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # SGLang's Qwen3-Next config class computes the layer pattern from this key only.
    cfg["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_tiny_model(out_dir: str | os.PathLike[str], arch: TinyArch, seed: int = 0) -> Path:
    """Write (or reuse) the tiny model directory for ``arch`` and ``seed``; return its path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; expected one of {ARCHS}")
    out = Path(out_dir)
    if is_complete(out, arch, seed):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / FINGERPRINT_FILE).unlink(missing_ok=True)
    # Build next to the target, then move the files in: readers never see half-written tensors.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp") as tmp:
        staging = Path(tmp)
        special_ids = tiny_tokenizer.write_tokenizer_files(staging)
        _build_weights(arch, staging, special_ids, seed)
        for name in MODEL_FILES:
            shutil.move(str(staging / name), str(out / name))
    (out / FINGERPRINT_FILE).write_text(json.dumps(fingerprint(arch, seed), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_hybrid.cpu.tiny_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="model directory to write (or reuse)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_model(args.out, args.arch, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
