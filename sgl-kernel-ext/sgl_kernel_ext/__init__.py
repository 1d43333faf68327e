"""CUDA copy kernels for sglang-hybrid, each with a pure-torch reference (docs/kernel-ext.md).

- ``gather_state_taps``: per-chunk GDN states ``h`` -> SSM pool slots (dtype converted);
- ``gather_conv_taps``: conv windows at tap positions -> conv pool slots;
- ``kv_blocks_to_staging`` / ``staging_to_kv_blocks``: 64-token blocks of every attention layer
  <-> one staging buffer in the host slab's bundle layout.

The CUDA library is optional: without it (no toolkit at build time, a CPU-only torch, or CPU
tensors) every op runs its torch reference. ``extension_status()`` says which.
"""

from __future__ import annotations

from typing import Any

from . import reference
from ._lib import STATE, build_status
from ._registry import REGISTRY, register, registered_ops
from .layout import BLOCK_TOKENS, BundleLayout, bundle_layout, from_slab_layout, staging_buffer
from .ops import (
    ConvTap,
    KernelArgError,
    StateTap,
    gather_conv_taps,
    gather_state_taps,
    kv_blocks_to_staging,
    staging_to_kv_blocks,
)
from .taps import conv_taps_for, state_tap_chunks

__all__ = [
    "BLOCK_TOKENS",
    "BundleLayout",
    "ConvTap",
    "KernelArgError",
    "StateTap",
    "bundle_layout",
    "conv_taps_for",
    "extension_available",
    "extension_status",
    "from_slab_layout",
    "gather_conv_taps",
    "gather_state_taps",
    "kv_blocks_to_staging",
    "reference",
    "registered_ops",
    "staging_buffer",
    "staging_to_kv_blocks",
    "state_tap_chunks",
]

register()


def extension_available() -> bool:
    """True when the CUDA library loaded (its kernels still need a GPU to run)."""
    return STATE.lib is not None


def extension_status() -> dict[str, Any]:
    """Whether the CUDA library loaded, from where or why not, and what the build recorded."""
    return {
        "available": STATE.lib is not None,
        "library": STATE.path,
        "reason": STATE.reason,
        "torch_ops_registered": REGISTRY.library is not None,
        "registration_error": REGISTRY.error,
        "build": build_status(),
    }
