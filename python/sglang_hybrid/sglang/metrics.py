"""Prometheus metrics of the hybrid cache, on SGLang's ``/metrics`` with ``--enable-metrics``.

SGLang's own radix-cache collector (``BasePrefixCache.init_metrics_collector``, made by the cache
when metrics are on) gets what it defines: tokens and time of every eviction, tokens restored from
the host (pool ``kv``) and written through (``backup``). The cache's own series are prefixed
``sglang_hybrid:`` and carry the same rank labels (every rank runs its own cache). Every series
measures one quantity, its unit in its name; every label value that can occur is exported from
the start, at 0, so a dashboard shows 0 rather than "No data" (issue #38). The table
(:data:`SERIES`) is also what ``docs/compaction.md`` ("Metrics") lists and what the dashboard in
``dashboards/`` queries (``test_metrics.py`` checks both against a running server).

Prompt tokens and short resumes are counted when a request's first pass has run (its hit is final
then); the mirrored counters advance by the change of the index's cumulative counters at each
request's release; the gauges are set at each release, the snapshot census (a walk over the
snapshots) at each release while they are few, else every ``CENSUS`` releases.
``prometheus_client`` is imported here, inside the scheduler process, after SGLang has set its
multiprocess directory.

**Short resumes** (``short_resumes_total`` / ``short_resume_tokens_total``, by ``reason``): a
request whose KV blocks matched deeper than the state it resumed from prefills the difference
again (a recurrent state cannot be rebuilt from KV). Why (:func:`short_resume_reason`):

- ``no_state``: no valid state lies on the matched path past the resume point, and none was seen
  there (the prompt left an earlier one where no snapshot was taken: a new branch);
- ``evicted``: none lies there now, but one was (its anchor block held a snapshot at a census;
  a snapshot published and evicted between two censuses counts as ``no_state``);
- ``restore_declined``: a deeper state is on the host, and restoring it cost more than the
  prefill it saves (spec §6.2);
- ``restore_failed``: an earlier restore of this request failed, so it resumed without one;
- ``in_flight``: copies still landing on the path hid the deeper states;
- ``no_state_slot``: a deeper state is on the device, but the request found no state slot to
  resume into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..index import BLOCK_TOKENS
from ..index.checkpoint_kinds import CHECKPOINT_KINDS, checkpoint_kind

# The snapshot census walks every snapshot: at each release while there are at most CENSUS_SMALL
# of them (~100 us), else every CENSUS releases.
CENSUS = 64
CENSUS_SMALL = 1024
# Lookup hashes of blocks that anchored a snapshot at a census (``evicted`` vs ``no_state``).
ANCHORS_SEEN = 1 << 16
SHORT_REASONS = (
    "no_state",
    "evicted",
    "restore_declined",
    "restore_failed",
    "in_flight",
    "no_state_slot",
)
TIERS = ("device", "host")
# Why an object fetched from L3 was not taken (``store/l3/objects.Refusal``, lower-cased).
L3_REFUSALS = ("missing", "truncated", "corrupt", "foreign", "misplaced", "error")


@dataclass(frozen=True, slots=True)
class Series:
    name: str  # without the ``sglang_hybrid:`` prefix
    type: str  # counter / gauge
    help: str
    labels: tuple[str, ...] = ()
    values: tuple[tuple[str, ...], ...] = ((),)  # every label combination that can occur


PREFIX = "sglang_hybrid:"
SERIES: tuple[Series, ...] = (
    Series(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests, by where they came from: reused from a device or a "
        "host-tier state and KV, or computed by prefill",
        ("source",),
        (("reused_device",), ("reused_host",), ("computed",)),
    ),
    Series(
        "short_resumes_total",
        "counter",
        "Admitted requests that resumed from a state short of their matched KV blocks, by why "
        "(no_state, evicted, restore_declined, restore_failed, in_flight, no_state_slot)",
        ("reason",),
        tuple((r,) for r in SHORT_REASONS),
    ),
    Series(
        "short_resume_tokens_total",
        "counter",
        "Prompt tokens whose KV blocks matched but were prefilled again because the request "
        "resumed from a shallower state, by why",
        ("reason",),
        tuple((r,) for r in SHORT_REASONS),
    ),
    Series(
        "snapshots",
        "gauge",
        "State snapshots held, by kind (why it exists, as /hybrid/boundaries names it) and tier "
        "(device: its state image is on the device; host: on the host only)",
        ("kind", "tier"),
        tuple((k, t) for k in CHECKPOINT_KINDS for t in TIERS),
    ),
    Series(
        "device_snapshot_slots_used",
        "gauge",
        "Device snapshot slots (MambaPool slots the cache holds states in) holding a snapshot",
    ),
    Series(
        "device_snapshot_slots_capacity",
        "gauge",
        "Device snapshot slots reserved by the cache (cache capacity, not request load)",
    ),
    Series(
        "host_tier_used_bytes",
        "gauge",
        "Host-tier bytes holding KV blocks and state images",
    ),
    Series(
        "host_tier_capacity_bytes",
        "gauge",
        "Host-tier bytes reserved (--hybrid-host-cache-mib, in whole slabs)",
    ),
    Series(
        "host_tier_written_bytes_total",
        "counter",
        "Bytes written through from the device to the host tier (KV blocks, state images, tails)",
    ),
    Series(
        "host_tier_demoted_blocks_total",
        "counter",
        "KV blocks an exclusive host tier took from the device ahead of their eviction",
    ),
    Series(
        "host_tier_restored_bytes_total",
        "counter",
        "Bytes restored from the host tier to the device for requests resuming from host states",
    ),
    Series(
        "skipped_taps_total",
        "counter",
        "Planned state snapshots (taps) not taken, by why: no device snapshot slot worth taking "
        "(no_slot), no KV page for an exact tap's tail (no_tail_page), past "
        "--hybrid-taps-per-request (over_budget)",
        ("reason",),
        (("no_slot",), ("no_tail_page",), ("over_budget",)),
    ),
    Series(
        "evicted_blocks_total",
        "counter",
        "KV block copies evicted (a snapshot's tail counts as one): from the device with a host "
        "copy kept (backed), as the last copy of a path some snapshot resumes through "
        "(unbacked, with what lies below it) or of one none does (dead), and from the host as "
        "dead KV (dead_kv) or, with an exclusive host, as a copy of a block the device holds "
        "(duplicate)",
        ("tier", "reason"),
        (
            ("device", "backed"),
            ("device", "unbacked"),
            ("device", "dead"),
            ("host", "dead_kv"),
            ("host", "duplicate"),
        ),
    ),
    Series(
        "evicted_snapshots_total",
        "counter",
        "State snapshots evicted from the host tier: superseded ones first, then by GDSF value",
        ("tier", "reason"),
        (("host", "superseded"), ("host", "gdsf")),
    ),
    Series(
        "coalesced_requests_total",
        "counter",
        "Requests held back to wait for an earlier request's state on a shared new prefix "
        "(in-flight prefix coalescing), each counted once",
    ),
    Series(
        "coalesce_held_passes_total",
        "counter",
        "Scheduler passes a coalescing request spent held, summed over requests",
    ),
    # L3 (--hybrid-l3, docs/l3.md); all 0 on a server without it.
    Series(
        "l3_up",
        "gauge",
        "1 while the shared L3 store is in use, 0 while it is off after failures or without "
        "--hybrid-l3",
    ),
    Series(
        "l3_off_events_total",
        "counter",
        "Times L3 was turned off after the store failed or timed out (retried with backoff)",
    ),
    Series(
        "l3_lookups_total",
        "counter",
        "Waiting requests looked up in L3, by result (hit: a deeper state than the local one "
        "found on every TP rank; miss; skipped_off: not looked up while L3 was off)",
        ("result",),
        (("hit",), ("miss",), ("skipped_off",)),
    ),
    Series(
        "l3_first_connect_waits_total",
        "counter",
        "Requests held out of admission while the server's first connection to its L3 store "
        "was being made (each at most 5 s), each counted once",
    ),
    Series(
        "l3_fetches_total",
        "counter",
        "L3 hits fetched into the host tier, by result (landed; failed: refused or failed on "
        "some rank, recomputed; no_room: the host tier could not reserve slabs)",
        ("result",),
        (("landed",), ("failed",), ("no_room",)),
    ),
    Series(
        "l3_fetched_tokens_total",
        "counter",
        "Prompt tokens past the local tree that requests resumed from L3's states and blocks",
    ),
    Series(
        "l3_written_bytes_total",
        "counter",
        "Bytes of KV blocks and state images this rank wrote to L3",
    ),
    Series(
        "l3_refused_objects_total",
        "counter",
        "Objects fetched from L3 and not taken, by why (missing, truncated, corrupt, foreign: "
        "another model, layout, TP rank or version, misplaced, error)",
        ("reason",),
        tuple((r,) for r in L3_REFUSALS),
    ),
)
# (series, label values, the cache.stats() fields whose sum it mirrors)
_MIRRORED: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("skipped_taps_total", ("no_slot",), ("tap_no_slot", "skipped_no_slot")),
    ("skipped_taps_total", ("no_tail_page",), ("tap_no_tail_page",)),
    ("skipped_taps_total", ("over_budget",), ("tap_over_budget",)),
    ("evicted_blocks_total", ("device", "backed"), ("device_evicted_backed",)),
    ("evicted_blocks_total", ("device", "unbacked"), ("device_evicted_unbacked",)),
    ("evicted_blocks_total", ("device", "dead"), ("device_evicted_dead",)),
    ("evicted_blocks_total", ("host", "dead_kv"), ("host_dead_swept",)),
    ("evicted_blocks_total", ("host", "duplicate"), ("host_duplicates_dropped",)),
    ("evicted_snapshots_total", ("host", "superseded"), ("host_superseded_evicted",)),
    ("evicted_snapshots_total", ("host", "gdsf"), ("host_gdsf_evicted",)),
    ("coalesced_requests_total", (), ("coalesce_waiters",)),
    ("coalesce_held_passes_total", (), ("coalesce_holds",)),
    ("host_tier_written_bytes_total", (), ("host_written_bytes",)),
    ("host_tier_restored_bytes_total", (), ("host_restored_bytes",)),
    ("host_tier_demoted_blocks_total", (), ("blocks_demoted",)),
    ("l3_off_events_total", (), ("l3_offs",)),
    ("l3_lookups_total", ("hit",), ("l3_lookup_hits",)),
    ("l3_lookups_total", ("miss",), ("l3_lookup_misses",)),
    ("l3_lookups_total", ("skipped_off",), ("l3_skipped_off",)),
    ("l3_first_connect_waits_total", (), ("l3_waited_connect",)),
    ("l3_fetches_total", ("landed",), ("l3_fetches_landed",)),
    ("l3_fetches_total", ("failed",), ("l3_fetch_failed",)),
    ("l3_fetches_total", ("no_room",), ("l3_no_room",)),
    ("l3_fetched_tokens_total", (), ("l3_fetched_tokens",)),
    ("l3_written_bytes_total", (), ("l3_put_bytes",)),
    *(("l3_refused_objects_total", (r,), (f"l3_refused_{r}",)) for r in L3_REFUSALS),
)


def with_dp_rank(labels: dict[str, Any]) -> dict[str, Any]:
    """SGLang's cache labels with the scheduler's DP rank. SGLang labels a cache ``dp_rank`` 0
    unless DP attention is on, so with ``--dp-size N`` every rank's series would share labels:
    the multiprocess registry would add the ranks' counters and keep one rank's gauges."""
    from .ranks import dp_rank

    rank = dp_rank()
    if rank is None or str(labels.get("dp_rank", "0")) != "0":
        return dict(labels)  # one DP rank, or DP attention's own rank label
    return {**labels, "dp_rank": rank}


def _served_model_name() -> str:
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().served_model_name)
    except Exception:  # no runtime context (a cache built outside SGLang's scheduler)
        return ""


def short_resume_reason(handle: Any, state: Any, anchors_seen: Any = ()) -> tuple[str, int] | None:
    """(why, tokens) when a request resumed short of its matched KV blocks, else None (see the
    module docstring). O(1) unless short; then O(blocks between the resume point and the match).
    ``handle``: its ``MatchHandle``; ``state``: its ``ReqState``."""
    m = handle.match
    if m is None:
        return None
    resumed = handle.prefix_len
    short = m.kv_tokens - resumed
    if short <= 0:
        return None
    best = m.best
    if best is not None and best.frontier > resumed:
        if state is not None and state.no_host:
            return "restore_failed", short
        if best.complete_on_device:
            return "no_state_slot", short
        return "restore_declined", short
    if m.settled_blocks < len(m.path):
        return "in_flight", short
    path = m.path
    for j in range(max(1, resumed // BLOCK_TOKENS), len(path) + 1):
        if path[j - 1].lookup_hash in anchors_seen:
            return "evicted", short
    return "no_state", short


class CacheMetrics:
    """The cache's series for one scheduler rank (see the module docstring)."""

    def __init__(self, labels: dict[str, Any], registry: Any = None) -> None:
        """``registry``: prometheus_client's default (SGLang's multiprocess collector reads it)
        unless a test passes its own."""
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        # SGLang's cache collector labels ranks only; its scheduler's series also carry
        # ``model_name``, which dashboards select by: ours carry it too.
        labels = {"model_name": _served_model_name(), **labels}
        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.series: dict[str, Any] = {}
        self._label_names = {s.name: s.labels for s in SERIES}
        for s in SERIES:
            metric: Counter | Gauge
            if s.type == "counter":
                metric = Counter(PREFIX + s.name, s.help, names + list(s.labels), registry=registry)
            else:
                metric = Gauge(
                    PREFIX + s.name,
                    s.help,
                    names + list(s.labels),
                    multiprocess_mode="mostrecent",
                    registry=registry,
                )
            self.series[s.name] = metric
            for values in s.values:  # every known label value, exported at 0 from the start
                self.child(s.name, *values)
        self._seen: dict[tuple[str, tuple[str, ...]], int] = {}
        self._releases = 0
        # Insertion-ordered, bounded: the oldest entries go first.
        self.anchors_seen: dict[int, None] = {}

    def child(self, name: str, *values: str) -> Any:
        extra = dict(zip(self._label_names[name], values, strict=True))
        return self.series[name].labels(**self.labels, **extra)

    def on_admitted(self, handle: Any, state: Any) -> None:
        """A request's first pass has run: its prompt tokens by source, and a short resume."""
        host = min(state.restored_tokens, handle.prefix_len)
        for source, n in (
            ("reused_device", handle.prefix_len - host),
            ("reused_host", host),
            ("computed", max(0, state.n_prompt - handle.prefix_len)),
        ):
            if n > 0:
                self.child("prompt_tokens_total", source).inc(n)
        short = short_resume_reason(handle, state, self.anchors_seen)
        if short is not None:
            reason, tokens = short
            self.child("short_resumes_total", reason).inc()
            self.child("short_resume_tokens_total", reason).inc(tokens)

    def on_release(self, cache: Any) -> None:
        self._releases += 1
        small = len(cache.index.snapshots) <= CENSUS_SMALL
        self.refresh(cache, census=small or self._releases % CENSUS == 1)

    def refresh(self, cache: Any, *, census: bool = True) -> None:
        stats = cache.stats()  # a fresh dict
        if cache.l3 is not None:  # this rank's own L3 counters (writes, refusals, on/off)
            stats.update(cache.l3.local_stats())
            # A lookup is a hit or a miss; the index counts lookups and hits.
            stats["l3_lookup_misses"] = stats.get("l3_lookups", 0) - stats.get("l3_lookup_hits", 0)
        self.child("l3_up").set(int(stats.get("l3_on", 0)))
        for name, values, fields in _MIRRORED:
            total = sum(int(stats.get(f, 0)) for f in fields)
            delta = total - self._seen.get((name, values), 0)
            if delta > 0:
                self.child(name, *values).inc(delta)
            self._seen[(name, values)] = total  # a reset (flush) restarts the index's counters
        slots = cache.index.slots
        self.child("device_snapshot_slots_capacity").set(slots.n)
        self.child("device_snapshot_slots_used").set(slots.n - slots.free)
        host = cache.index.host
        if host is not None:
            slab = cache.slab_bytes
            self.child("host_tier_used_bytes").set(host.used * slab)
            self.child("host_tier_capacity_bytes").set(host.n_slabs * slab)
        if census:
            self._census(cache)

    def _census(self, cache: Any) -> None:
        counts = dict.fromkeys(((k, t) for k in CHECKPOINT_KINDS for t in TIERS), 0)
        seen = self.anchors_seen
        for s in cache.index.snapshots.values():
            tier = "device" if s.image_on_device else "host"
            counts[(checkpoint_kind(s.kind, s.origin), tier)] += 1
            if not s.anchor.is_root:
                h = s.anchor.lookup_hash
                seen.pop(h, None)
                seen[h] = None
        while len(seen) > ANCHORS_SEEN:
            del seen[next(iter(seen))]
        for (kind, tier), n in counts.items():
            self.child("snapshots", kind, tier).set(n)
