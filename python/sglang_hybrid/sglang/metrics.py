"""Prometheus metrics of the hybrid cache, on SGLang's ``/metrics`` with ``--enable-metrics``.

SGLang's own radix-cache collector (``BasePrefixCache.init_metrics_collector``, made by the cache
when metrics are on) gets what it defines: tokens and time of every eviction, tokens restored from
the host (pool ``kv``) and written through (``backup``). The cache's own series, prefixed
``sglang_hybrid:`` and labelled with the same rank labels (every rank runs its own cache):

=========================================  ===============================================
``prompt_tokens_total{source}``            ``reused_device``, ``reused_host``, ``computed``
``host_bytes_total{direction}``            ``written``, ``restored``
``snapshots{kind,tier}``                   gauge: ``tap`` / ``boundary`` / ``endpoint`` on
                                           the ``device`` (image resident) or ``host`` only
``taps_skipped_total{reason}``             ``no_slot``, ``no_tail_page``, ``over_budget``
``evictions_total{reason}``                ``device_backed``, ``device_unbacked`` (blocks),
                                           ``dead_kv``, ``superseded``, ``gdsf`` (host)
``coalesce_total{event}``                  ``holds`` (requests held), ``waiters``
``host_tier_bytes{state}``                 gauge: ``used``, ``capacity``
=========================================  ===============================================

Prompt tokens are counted when a request's first pass has run (its hit is final then); the other
counters mirror the index's cumulative counters and advance by their change at each request's
release; the snapshot census (a walk over the snapshots) at each release while they are few, else
every ``CENSUS`` releases. ``prometheus_client`` is imported here, inside the scheduler process,
after SGLang has set its multiprocess directory.
"""

from __future__ import annotations

from typing import Any

# The snapshot census walks every snapshot: at each release while there are at most CENSUS_SMALL
# of them (~100 us), else every CENSUS releases.
CENSUS = 64
CENSUS_SMALL = 1024

# (our counter, label, the cache.stats() fields it sums)
_MIRRORED: list[tuple[str, str, tuple[str, ...]]] = [
    ("taps_skipped", "no_slot", ("tap_no_slot", "skipped_no_slot")),
    ("taps_skipped", "no_tail_page", ("tap_no_tail_page",)),
    ("taps_skipped", "over_budget", ("tap_over_budget",)),
    ("evictions", "device_backed", ("device_evicted_backed",)),
    ("evictions", "device_unbacked", ("device_evicted_unbacked",)),
    ("evictions", "dead_kv", ("host_dead_swept",)),
    ("evictions", "superseded", ("host_superseded_evicted",)),
    ("evictions", "gdsf", ("host_gdsf_evicted",)),
    ("coalesce", "holds", ("coalesce_holds",)),
    ("coalesce", "waiters", ("coalesce_waiters",)),
    ("host_bytes", "written", ("host_written_bytes",)),
    ("host_bytes", "restored", ("host_restored_bytes",)),
]
_LABEL = {
    "taps_skipped": "reason",
    "evictions": "reason",
    "coalesce": "event",
    "host_bytes": "direction",
}


def with_dp_rank(labels: dict[str, Any]) -> dict[str, Any]:
    """SGLang's cache labels with the scheduler's DP rank. SGLang labels a cache ``dp_rank`` 0
    unless DP attention is on, so with ``--dp-size N`` every rank's series would share labels:
    the multiprocess registry would add the ranks' counters and keep one rank's gauges."""
    from .ranks import dp_rank

    rank = dp_rank()
    if rank is None or str(labels.get("dp_rank", "0")) != "0":
        return dict(labels)  # one DP rank, or DP attention's own rank label
    return {**labels, "dp_rank": rank}


class CacheMetrics:
    """The cache's series for one scheduler rank (see the module docstring)."""

    def __init__(self, labels: dict[str, Any]) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.prompt_tokens = Counter(
            "sglang_hybrid:prompt_tokens_total",
            "Prompt tokens of admitted requests: reused from the device or the host, or computed",
            names + ["source"],
        )
        self.counters = {
            name: Counter(
                f"sglang_hybrid:{name}_total",
                f"The hybrid cache's {name.replace('_', ' ')} by {_LABEL[name]}",
                names + [_LABEL[name]],
            )
            for name in _LABEL
        }
        self.snapshots = Gauge(
            "sglang_hybrid:snapshots",
            "Snapshots held, by kind and by where the image is",
            names + ["kind", "tier"],
            multiprocess_mode="mostrecent",
        )
        self.host_tier = Gauge(
            "sglang_hybrid:host_tier_bytes",
            "Host tier slab bytes in use and in all",
            names + ["state"],
            multiprocess_mode="mostrecent",
        )
        self._seen: dict[tuple[str, str], int] = {}
        self._releases = 0

    def count_prompt(self, reused_device: int, reused_host: int, computed: int) -> None:
        for source, n in (
            ("reused_device", reused_device),
            ("reused_host", reused_host),
            ("computed", computed),
        ):
            if n > 0:
                self.prompt_tokens.labels(**self.labels, source=source).inc(n)

    def on_release(self, cache: Any) -> None:
        self._releases += 1
        small = len(cache.index.snapshots) <= CENSUS_SMALL
        self.refresh(cache, census=small or self._releases % CENSUS == 1)

    def refresh(self, cache: Any, *, census: bool = True) -> None:
        stats = cache.stats()
        for name, label, fields in _MIRRORED:
            total = sum(int(stats.get(f, 0)) for f in fields)
            delta = total - self._seen.get((name, label), 0)
            if delta > 0:
                self.counters[name].labels(**self.labels, **{_LABEL[name]: label}).inc(delta)
            self._seen[(name, label)] = total
        host = cache.index.host
        if host is not None:
            slab = cache.slab_bytes
            self.host_tier.labels(**self.labels, state="used").set(host.used * slab)
            self.host_tier.labels(**self.labels, state="capacity").set(host.n_slabs * slab)
        if census:
            self._census(cache)

    def _census(self, cache: Any) -> None:
        counts: dict[tuple[str, str], int] = {
            (k, t): 0 for k in ("tap", "boundary", "endpoint") for t in ("device", "host")
        }
        for s in cache.index.snapshots.values():
            tier = "device" if s.image_on_device else "host"
            counts[(s.kind.name.lower(), tier)] += 1
        for (kind, tier), n in counts.items():
            self.snapshots.labels(**self.labels, kind=kind, tier=tier).set(n)
