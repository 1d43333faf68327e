"""The ops as torch operators, ``torch.ops.sgl_kernel_ext.*``, registered when the CUDA library
loaded (CUDA: the kernels; CPU: the references). Each validates exactly as the Python API does.
"""

from __future__ import annotations

import torch

from . import ops
from ._lib import STATE

NAMESPACE = "sgl_kernel_ext"
SCHEMAS = {
    "kv_blocks_to_staging": "(Tensor[] kv_buffers, Tensor slot_lists, Tensor(a!) staging) -> ()",
    "staging_to_kv_blocks": "(Tensor staging, Tensor(a!)[] kv_buffers, Tensor slot_lists) -> ()",
    "gather_state_taps": "(Tensor[] h, Tensor(a!) ssm_states, Tensor taps, int[] layers) -> ()",
    "gather_conv_taps": "(Tensor[] mixed_qkv, Tensor(a!) conv_states, Tensor taps, "
    "Tensor[] incoming_conv, int[] layers) -> ()",
}


def _kv_to_staging(
    kv_buffers: list[torch.Tensor], slot_lists: torch.Tensor, staging: torch.Tensor
) -> None:
    ops.kv_blocks_to_staging(kv_buffers, slot_lists, staging)


def _staging_to_kv(
    staging: torch.Tensor, kv_buffers: list[torch.Tensor], slot_lists: torch.Tensor
) -> None:
    ops.staging_to_kv_blocks(staging, kv_buffers, slot_lists)


def _state_taps(
    h: list[torch.Tensor], ssm_states: torch.Tensor, taps: torch.Tensor, layers: list[int]
) -> None:
    ops.gather_state_taps(h, ssm_states, taps, layers=layers)


def _conv_taps(
    mixed_qkv: list[torch.Tensor],
    conv_states: torch.Tensor,
    taps: torch.Tensor,
    incoming_conv: list[torch.Tensor],
    layers: list[int],
) -> None:
    ops.gather_conv_taps(mixed_qkv, conv_states, taps, incoming_conv or None, layers=layers)


IMPLS = {
    "kv_blocks_to_staging": _kv_to_staging,
    "staging_to_kv_blocks": _staging_to_kv,
    "gather_state_taps": _state_taps,
    "gather_conv_taps": _conv_taps,
}


class _Registry:
    library: torch.library.Library | None = None
    error: str | None = None


REGISTRY = _Registry()


def register() -> bool:
    """Register the torch operators once (only with the CUDA library loaded)."""
    if REGISTRY.library is not None:
        return True
    if STATE.lib is None:
        return False
    try:
        lib = torch.library.Library(NAMESPACE, "DEF")
        for name, schema in SCHEMAS.items():
            lib.define(name + schema)
            for key in ("CPU", "CUDA"):
                lib.impl(name, IMPLS[name], key)
    except RuntimeError as e:  # e.g. the namespace registered by another copy of the package
        REGISTRY.error = str(e)
        return False
    REGISTRY.library = lib
    return True


def registered_ops() -> dict[str, bool]:
    """For each op: whether ``torch.ops.sgl_kernel_ext.<op>`` has a CUDA kernel registered."""
    out = {}
    for name in SCHEMAS:
        try:
            out[name] = torch._C._dispatch_has_kernel_for_dispatch_key(
                f"{NAMESPACE}::{name}", "CUDA"
            )
        except RuntimeError:
            out[name] = False
    return out
