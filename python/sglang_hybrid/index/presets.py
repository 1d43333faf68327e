"""Plain-data presets: device cost coefficients and model geometries (spec §3, §11.4).

Device figures are planning values, not measurements of this repository: prefill rates follow from
dense FLOPs per token at a conservative utilisation, H2D from practical pinned PCIe rates. The RTX
5090 row is fitted to the spec author's numbers (10.2k tok/s cold prefill, 4.2k tok/s at ~121k
context, 24-27 GB/s restores on a PCIe 5.0 x8 link). Replace them with a calibration where one
exists; everything that ranks or values snapshots reads them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import CostModel

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Geometry:
    """Bytes that size the cache for one model (BF16 KV, FP32 recurrent state, BF16 conv)."""

    name: str
    kv_bytes_per_token: int  # K + V of every full-attention layer
    state_bytes: int  # one image: recurrent + conv state of every linear-attention layer
    full_attention_layers: int
    linear_layers: int


GEOMETRIES: dict[str, Geometry] = {
    # 64 layers: 48 Gated DeltaNet (Hv=48, 128x128 fp32 state) + 16 attention (4 KV heads x 256).
    "qwen3.5-27b": Geometry(
        "qwen3.5-27b",
        kv_bytes_per_token=16 * 4 * 256 * 2 * 2,
        state_bytes=48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2),
        full_attention_layers=16,
        linear_layers=48,
    ),
    # 48 layers: 36 Gated DeltaNet (Hv=32, 128x128) + 12 attention (2 KV heads x 256).
    "qwen3-next-80b": Geometry(
        "qwen3-next-80b",
        kv_bytes_per_token=12 * 2 * 256 * 2 * 2,
        state_bytes=36 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2),
        full_attention_layers=12,
        linear_layers=36,
    ),
}

# Keyed by (device, geometry): prefill coefficients depend on both.
COSTS: dict[tuple[str, str], CostModel] = {
    # H200: ~990 TFLOP/s dense BF16 at ~50 % utilisation; PCIe 5.0 x16 pinned ~55 GB/s.
    ("h200", "qwen3.5-27b"): CostModel(
        token_s=1.1e-4, pair_s=8.0e-10, chunk_s=3e-3, chunk_tokens=8192, h2d_bytes_per_s=55e9
    ),
    ("h200", "qwen3-next-80b"): CostModel(
        token_s=3.5e-5, pair_s=3.0e-10, chunk_s=3e-3, chunk_tokens=8192, h2d_bytes_per_s=55e9
    ),
    # RTX 5090 fitted to the spec's measurements (§3.3, §11.2).
    ("rtx5090", "qwen3.5-27b"): CostModel(
        token_s=9.8e-5, pair_s=2.3e-9, chunk_s=4e-3, chunk_tokens=8192, h2d_bytes_per_s=25e9
    ),
    ("rtx5090", "qwen3-next-80b"): CostModel(
        token_s=4.0e-5, pair_s=9.0e-10, chunk_s=4e-3, chunk_tokens=8192, h2d_bytes_per_s=25e9
    ),
}


def cost_preset(device: str, geometry: str) -> CostModel:
    try:
        return COSTS[(device, geometry)]
    except KeyError:
        known = ", ".join(f"{d}/{g}" for d, g in COSTS)
        raise KeyError(f"no cost preset for {device}/{geometry}; known: {known}") from None
