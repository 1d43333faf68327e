"""The replay's clock: virtual seconds per forward pass, from the work the pass did.

Contract: ``BatchClock(device, geometry)`` prices one pass (a ``BatchWork`` from the token
worker) on a modelled device running the modelled model:

- prefill (EXTEND): one pass of the index's cost model (``index.presets.COSTS``, spec §6.2):
  ``chunk_s + token_s * tokens + pair_s * attention_pairs``;
- decode: ``step_s + per_req_s * requests + kv_bytes_per_token * context_tokens / hbm_bytes_per_s``
  (``DECODE_COSTS``): weights are read once per step, each sequence reads and writes its
  recurrent state and reads its KV (a decode step's attention pairs are its context tokens);
- host-to-device bytes restored for the pass (host tier): ``CostModel.restore_seconds``, added
  to the pass. The spec overlaps restores with the first pass layer by layer (§6.5); adding
  them is the conservative bound.

``DECODE_COSTS`` are planning values like ``index.presets`` (derivations beside each entry), not
measurements. They belong in ``index/presets.py``; they live here until that file grows a decode
row (it is owned by the index).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sglang_hybrid.cpu.token_worker import BatchWork
from sglang_hybrid.index.cost import CostModel
from sglang_hybrid.index.presets import GEOMETRIES, Geometry, cost_preset


@dataclass(frozen=True, slots=True)
class DecodeCost:
    step_s: float  # per decode pass: reading the weights
    per_req_s: float  # per sequence: its recurrent state read + written, sampling
    hbm_bytes_per_s: float  # practical HBM bandwidth for KV reads


DECODE_COSTS: dict[tuple[str, str], DecodeCost] = {
    # H200: 4.8 TB/s HBM3e, ~3.8 TB/s practical. 27B BF16 weights (54 GB) -> ~14 ms per step;
    # a 154 MB state read + written per sequence -> ~81 us, plus sampling.
    ("h200", "qwen3.5-27b"): DecodeCost(step_s=14e-3, per_req_s=1.0e-4, hbm_bytes_per_s=3.8e12),
    # 80B-A3B MoE in FP8: ~3B active parameters plus expert spread with batch -> ~3 ms per step;
    # 77 MB state per sequence -> ~40 us, MoE routing and sampling on top.
    ("h200", "qwen3-next-80b"): DecodeCost(step_s=3e-3, per_req_s=1.0e-4, hbm_bytes_per_s=3.8e12),
    # RTX 5090: 1.79 TB/s GDDR7, ~1.5 TB/s practical. 27B NVFP4 (~14 GB) -> ~9 ms per step;
    # 154 MB state per sequence -> ~205 us.
    ("rtx5090", "qwen3.5-27b"): DecodeCost(step_s=9e-3, per_req_s=2.2e-4, hbm_bytes_per_s=1.5e12),
    # 80B-A3B NVFP4 does not fit 32 GB; kept for symmetry with the prefill presets (offloaded
    # experts would dominate): ~4 ms per step, 77 MB state -> ~105 us.
    ("rtx5090", "qwen3-next-80b"): DecodeCost(
        step_s=4e-3, per_req_s=1.2e-4, hbm_bytes_per_s=1.5e12
    ),
}


def decode_preset(device: str, geometry: str) -> DecodeCost:
    try:
        return DECODE_COSTS[(device, geometry)]
    except KeyError:
        known = ", ".join(f"{d}/{g}" for d, g in DECODE_COSTS)
        raise KeyError(f"no decode preset for {device}/{geometry}; known: {known}") from None


class BatchClock:
    """Seconds per pass for one (device, geometry) pair (see the module contract)."""

    def __init__(self, device: str, geometry: str) -> None:
        self.device = device
        self.geometry: Geometry = GEOMETRIES[geometry]
        self.prefill: CostModel = cost_preset(device, geometry)
        self.decode: DecodeCost = decode_preset(device, geometry)

    def split_cost(self) -> CostModel:
        """The prefill cost model with this device's weight read (a decode step reads the
        weights once): what the hybrid cache's split rule prices an extra pass at
        (``CostModel.split_seconds``)."""
        return dataclasses.replace(self.prefill, weight_read_s=self.decode.step_s)

    def pass_seconds(self, work: BatchWork, h2d_bytes: int = 0) -> float:
        if work.num_reqs == 0:
            return 0.0
        if work.decode_reqs and not work.extend_tokens:
            d = self.decode
            kv_read = self.geometry.kv_bytes_per_token * work.attention_pairs / d.hbm_bytes_per_s
            t = d.step_s + d.per_req_s * work.decode_reqs + kv_read
        else:
            c = self.prefill
            t = c.chunk_s + c.token_s * work.extend_tokens + c.pair_s * work.attention_pairs
        return t + self.prefill.restore_seconds(h2d_bytes)

    def describe(self) -> dict[str, object]:
        return {
            "device": self.device,
            "geometry": self.geometry.name,
            "prefill": {
                "chunk_s": self.prefill.chunk_s,
                "token_s": self.prefill.token_s,
                "pair_s": self.prefill.pair_s,
                "h2d_bytes_per_s": self.prefill.h2d_bytes_per_s,
            },
            "decode": {
                "step_s": self.decode.step_s,
                "per_req_s": self.decode.per_req_s,
                "hbm_bytes_per_s": self.decode.hbm_bytes_per_s,
            },
        }
