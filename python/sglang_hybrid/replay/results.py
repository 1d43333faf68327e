"""What a replay measured: one record per request and the summaries reports are made of.

Contract:
- ``RequestRecord``: per request, times in virtual seconds (release, first token, finish), the
  prompt length, the reuse SGLang reported (``cached_tokens``), the tokens the worker computed
  before the first answer token (``prefill_tokens``) and after retractions
  (``recompute_tokens``). For a request that was never retracted,
  ``cached_tokens + prefill_tokens == prompt_tokens`` (two independent sources: SGLang's output
  stream and the worker's pass counts).
- ``ReplayResult``: a cache's run over a trace: the pool plan, the clock, the records, loop
  counters, wall time and the cache's own counters when it keeps any (``HybridRadixCache.stats()``:
  the index's counters, the skipped opportunities, host bytes), counted over the measured
  requests; ``warmup`` describes the unrelated warm-up that ran before them (empty if none).
  ``summary()`` folds it into a ``CacheSummary``; ``by_tag()`` into one per request tag.
- Percentiles are nearest-rank on the requests that produced a first token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .budget import PoolPlan


@dataclass(slots=True)
class RequestRecord:
    rid: str
    tag: str
    session: str | None
    release_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    first_prefix: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_type: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.release_s

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not computed for the first answer token."""
        return self.prompt_tokens - self.prefill_tokens


class CacheSummary(NamedTuple):
    cache: str
    requests: int
    finished: int
    prompt_tokens: int
    reused_tokens: int
    prefill_tokens: int  # computed, retraction recompute included
    recompute_tokens: int
    host_bytes_restored: int
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_mean_s: float
    makespan_s: float

    @property
    def reuse_fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    # inverted_cdf is nearest rank: the smallest value with at least q% of values at or below it.
    return float(np.percentile(values, q, method="inverted_cdf"))


def summarize(cache: str, records: list[RequestRecord], host_bytes: int) -> CacheSummary:
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    finishes = [r.finish_s for r in records if r.finish_s is not None]
    prefill = sum(r.prefill_tokens for r in records)
    recompute = sum(r.recompute_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    return CacheSummary(
        cache=cache,
        requests=len(records),
        finished=len(finishes),
        prompt_tokens=prompt,
        reused_tokens=prompt - prefill,
        prefill_tokens=prefill + recompute,
        recompute_tokens=recompute,
        host_bytes_restored=host_bytes,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        makespan_s=max(finishes) if finishes else 0.0,
    )


@dataclass(slots=True)
class ReplayResult:
    cache: str
    trace: str
    plan: PoolPlan
    clock: dict[str, object]
    records: list[RequestRecord]
    wall_s: float = 0.0
    passes: int = 0
    extend_passes: int = 0
    decode_passes: int = 0
    prefill_s: float = 0.0  # modelled seconds of the prefill (EXTEND) passes, restores included
    host_bytes_restored: int = 0
    cache_stats: dict[str, int] = field(default_factory=dict)  # the cache's own counters
    notes: list[str] = field(default_factory=list)
    warmup: dict[str, Any] = field(default_factory=dict)  # the unrelated warm-up, if any ran
    l3: dict[str, Any] = field(default_factory=dict)  # an L3 variant's link and traffic

    def summary(self) -> CacheSummary:
        return summarize(self.cache, self.records, self.host_bytes_restored)

    def mean_in_flight(self) -> float:
        """Requests released and not finished, on average from the first release to the last
        finish (1.0: one at a time; the concurrency of the measured traffic)."""
        spans = [(r.release_s, r.finish_s) for r in self.records if r.finish_s is not None]
        if not spans:
            return 0.0
        window = max(f for _, f in spans) - min(s for s, _ in spans)
        return sum(f - s for s, f in spans) / window if window > 0 else float(len(spans))

    def by_tag(self) -> dict[str, CacheSummary]:
        tags: dict[str, list[RequestRecord]] = {}
        for r in self.records:
            tags.setdefault(r.tag or "-", []).append(r)
        return {t: summarize(self.cache, rs, 0) for t, rs in sorted(tags.items())}
