"""Load a hybrid model directory into transformers' own model class, float32, for the CPU worker.

Contract: ``load_hf_model(model_path, dtype=torch.float32, device="cpu")`` returns the
``*ForCausalLM`` model built by ``AutoModelForCausalLM.from_pretrained`` (local files only, no
network), in ``dtype`` on ``device`` (float32 on the CPU; the CUDA build of the worker loads
bf16 on ``"cuda"``), in eval mode, with the row-wise attention of ``split_invariant`` as its
attention implementation, and the list of its layer types. It refuses a model without
linear-attention layers or without a ``linear_conv_kernel_dim``, because the worker's state
handling assumes a GDN hybrid.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from sglang_hybrid.cpu.split_invariant import ROWWISE_ATTENTION, register_rowwise_attention


class LoadedModel(NamedTuple):
    model: torch.nn.Module
    config: Any  # the model's transformers config (text config)
    layer_types: list[str]
    conv_kernel: int


def load_hf_model(
    model_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoadedModel:
    """The transformers model of ``model_path`` (see the module contract)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    register_rowwise_attention()
    # The weight-loading progress bar is noise in a scheduler's log.
    progress_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path),
            dtype=dtype,
            attn_implementation=ROWWISE_ATTENTION,
            local_files_only=True,
        )
    finally:
        if progress_was_enabled:
            hf_logging.enable_progress_bar()
    if device != "cpu":
        model = model.to(device)  # type: ignore[arg-type]  # transformers' wraps(Module.to): mypy sees it unbound
    model.eval()
    if model.config._attn_implementation != ROWWISE_ATTENTION:
        raise RuntimeError(f"transformers chose {model.config._attn_implementation!r} attention")
    config = model.config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or [])
    conv_kernel = getattr(config, "linear_conv_kernel_dim", None)
    if "linear_attention" not in layer_types or conv_kernel is None:
        raise ValueError(f"{model_path} is not a GDN hybrid model (layer types {layer_types})")
    return LoadedModel(model, config, layer_types, int(conv_kernel))
