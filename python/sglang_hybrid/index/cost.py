"""Cost model (spec §6.2, §11.4): seconds a prefix saves, one scale for admission and eviction.

prefill_seconds(base B, tokens S) = chunk_s * ceil(S / chunk) + token_s * S
                                    + pair_s * (B*S + S*(S+1)/2)
restore_seconds(bytes)            = bytes / h2d_bytes_per_s + batch_s   (0 bytes cost nothing)
split_seconds()                   = chunk_s + weight_read_s   (one more pass, ``split_rule``)

The attention-pair term makes a long prefix expensive to rebuild even when few tokens are new.
The model only ranks choices; capacity and validity never depend on it (§10.10). Presets are plain
data (see ``presets.py``); a deployment may calibrate its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    token_s: float = 1.0e-4  # per prefilled token (weights, MLP, linear attention)
    pair_s: float = 1.0e-9  # per attention (query, key) pair over all full-attention layers
    chunk_s: float = 2.0e-3  # fixed cost of one prefill pass
    chunk_tokens: int = 8192
    h2d_bytes_per_s: float = 25e9
    batch_s: float = 2.0e-5  # per restore batch
    # Reading the weights once: the floor of any forward pass, which a split pays again (a
    # ~27B BF16 model at ~4 TB/s is ~14 ms, an 80B-A3B MoE's active experts ~3 ms). The replay
    # sets its clock's decode step here (``replay/clock.py``: a decode step reads the weights).
    weight_read_s: float = 1.0e-2

    def prefill_seconds(self, base: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        passes = -(-tokens // self.chunk_tokens)
        return self.chunk_s * passes + self.compute_seconds(base, tokens)

    def compute_seconds(self, base: int, tokens: int) -> float:
        """``prefill_seconds`` without the passes' fixed cost: what the tokens themselves cost."""
        if tokens <= 0:
            return 0.0
        pairs = base * tokens + tokens * (tokens + 1) / 2
        return self.token_s * tokens + self.pair_s * pairs

    def split_seconds(self) -> float:
        """What one more prefill pass costs beyond its tokens: its launch and scheduler round
        (``chunk_s``, the fixed cost the replay's clock prices every pass at) and one more read
        of the weights (``weight_read_s``: the pass a split leaves behind is often short, and a
        short pass is bound by the weight read, not by its tokens). A tap that ends a pass pays
        it (``split_rule.py``)."""
        return self.chunk_s + self.weight_read_s

    def restore_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / self.h2d_bytes_per_s + self.batch_s
