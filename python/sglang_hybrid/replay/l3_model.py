"""L3 in the replay: ``hybrid`` with a store behind its host tier, transfers in modelled time.

Caches (``--caches``): ``hybrid+l3-tcp`` and ``hybrid+l3-rdma`` are ``hybrid`` (its device pools
and host tier) with ``--hybrid-l3`` pointed at an in-process store (``store/l3/memory.py``) of
``--l3-gib`` of the modelled geometry, behind a modelled link. What runs is the real L3 path
(``sglang/l3_tier.py``: write-through, lookups holding requests out of admission, verified
fetches adopted as host entries, then the ordinary host restore); what is modelled is time: every
L3 job runs when submitted and finishes in virtual time (``ClockedJobQueue``) after

    round_trips * round_trip_s + (blocks * 64 * kv_bytes_per_token + images * state_bytes) / bw

in the geometry's bytes (a lookup: two round trips, nothing moved; a fetch: one, its blocks and
snapshot image; a write: two, what the store took). Reads and writes have a queue each (a
full-duplex link); a request waits for its own lookup and fetch only, and the next pass restores
what landed from the host as any host hit (``clock.py``).

Links (one H200 of an 8-GPU node with 8 x 400 Gbps RoCE NICs, so one NIC's share):

- ``rdma``: 190 GB/s / 8 = 23.75 GB/s. Mooncake Transfer Engine's published figure: "up to 87 GB/s
  and 190 GB/s of bandwidth in 4x200 Gbps and 8x400 Gbps RoCE networks ... about 2.4x and 4.6x
  faster than the TCP protocol" (40 GB transfers; github.com/kvcache-ai/Mooncake, README,
  "Transfer Engine", and the FAST'25 paper);
- ``tcp``: the same network over TCP, 4.6x slower: 5.16 GB/s;
- a round trip (the master's metadata RPC, TCP in both cases) of 0.2 ms: an assumption, not a
  published figure.

The store's capacity is counted in objects as the host tier's is (``caches.host_cache_mib``): as
many 64-token blocks as ``--l3-gib`` of the geometry holds; state images cost less on the CPU
than modelled (the same gap). :func:`l3_report` says what moved, and what a write at host
*eviction* would have written instead of write-through (below).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_hybrid.index.presets import Geometry

if TYPE_CHECKING:
    from sglang_hybrid.sglang.l3_tier import L3Tier
    from sglang_hybrid.store.l3.jobs import Job

BLOCK = 64
L3_CACHES: dict[str, str] = {"hybrid+l3-tcp": "tcp", "hybrid+l3-rdma": "rdma"}
ROUND_TRIP_S = 0.2e-3
_RDMA = 190e9 / 8
SOURCE = (
    "Mooncake Transfer Engine README (github.com/kvcache-ai/Mooncake): 190 GB/s over 8x400 Gbps "
    "RoCE, 4.6x TCP's; one NIC's share (/8); round trip 0.2 ms assumed"
)


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bytes_per_s: float
    round_trip_s: float


LINKS: dict[str, Link] = {
    "rdma": Link("rdma", _RDMA, ROUND_TRIP_S),
    "tcp": Link("tcp", _RDMA / 4.6, ROUND_TRIP_S),
}


def base_cache(cache: str) -> str:
    """The cache whose pools an L3 variant runs (``hybrid``), else ``cache`` itself."""
    return "hybrid" if cache in L3_CACHES else cache


def store_capacity_mib(l3_bytes: int, geometry: Geometry, tiny_token_bytes: int) -> int:
    """The in-process store holding as many block objects as ``l3_bytes`` of the geometry."""
    from sglang_hybrid.store.l3.objects import HEADER_BYTES

    blocks = l3_bytes // (BLOCK * geometry.kv_bytes_per_token)
    return max(1, (blocks * (BLOCK * tiny_token_bytes + HEADER_BYTES)) >> 20)


def store_url(cache: str, capacity_mib: int) -> str:
    """A fresh store's URL: its name is unique in this process (it names nothing else)."""
    name = f"replay-{cache.replace('+', '-')}-{time.monotonic_ns()}"
    return f"memory://{name}?capacity_mib={capacity_mib}"


@dataclass(slots=True)
class L3Meter:
    """Prices each L3 job on the link and counts what moved (the geometry's bytes)."""

    link: Link
    geometry: Geometry
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    written_blocks: int = 0
    written_images: int = 0
    jobs: dict[str, int] = field(default_factory=dict)

    def seconds(self, job: Job) -> float:
        from sglang_hybrid.store.l3.client import FetchResult, ProbeResult, PutCounts

        c = job.cost
        r = job.future.result() if job.future is not None and not job.future.exception() else None
        blocks, images, kind = c.blocks, c.images, "other"
        if isinstance(r, PutCounts):  # what the store took (present objects move nothing)
            kind = "write"
            if c.images:
                blocks, images = (c.blocks, c.images) if r.objects else (0, 0)
            else:
                blocks, images = r.objects, 0
            self.written_blocks += blocks
            self.written_images += images
        elif isinstance(r, ProbeResult):
            kind, blocks, images = "probe", 0, 0
        elif isinstance(r, FetchResult) or job.cost.images:
            kind = "fetch"
        g = self.geometry
        nbytes = blocks * BLOCK * g.kv_bytes_per_token + images * g.state_bytes
        s = c.round_trips * self.link.round_trip_s + nbytes / self.link.bytes_per_s
        if kind == "write":
            self.write_bytes += nbytes
            self.write_s += s
        else:
            self.read_bytes += nbytes
            self.read_s += s
        self.jobs[kind] = self.jobs.get(kind, 0) + 1
        return s


def attach(tree_cache: Any, now: Any, cache: str, geometry: Geometry) -> L3Meter:
    """Run the cache's L3 tier in modelled time on ``cache``'s link (see the module docstring)."""
    tier: L3Tier | None = getattr(tree_cache, "l3", None)
    if tier is None:
        raise RuntimeError(f"{cache}: the hybrid backend runs without its L3 tier")
    meter = L3Meter(LINKS[L3_CACHES[cache]], geometry)
    tier.use_clock(now, meter.seconds, track_writes=True)
    if not tier.breaker.up:
        raise RuntimeError(f"{cache}: the in-process L3 store did not connect")
    return meter


def still_on_host(tier: L3Tier) -> tuple[int, int]:
    """Of the host slabs written to L3, those that still hold what was written, as (blocks,
    images): what a write at host *eviction* would not have written (yet)."""
    pool = tier.cache.index.host
    if tier.written is None or pool is None:
        return 0, 0
    image_slabs: set[int] = set()
    for s in tier.cache.index.snapshots.values():
        image_slabs.update(s.host_slabs)
    blocks = slabs = 0
    for slab, gen in tier.written.items():
        if pool.gen[slab] == gen and pool.is_used(slab):
            if slab in image_slabs:
                slabs += 1
            else:
                blocks += 1
    return blocks, slabs // pool.image_slabs


def l3_report(tree_cache: Any, meter: L3Meter, l3_bytes: int) -> dict[str, Any]:
    """What the L3 tier did in one replay (``ReplayResult.l3``).

    ``eviction_write_bytes`` is what writing at host eviction instead of write-through would
    have written: the same objects less those whose host copy was never evicted. On one server
    the two policies find the same objects (a lookup asks only for what the local tiers no longer
    hold, i.e. what left the host and so was written at eviction) as long as the store evicts
    nothing (``store_evicted`` 0); with a full store, eviction-time writes hold up to the host
    tier's size more distinct objects (L3 exclusive of the host instead of inclusive).
    """
    from sglang_hybrid.store.l3.memory import MemoryBackend

    tier: L3Tier = tree_cache.l3
    g = meter.geometry
    blocks, images = still_on_host(tier)
    resident = blocks * BLOCK * g.kv_bytes_per_token + images * g.state_bytes
    backend = tier.client.backend
    store = backend.store if isinstance(backend, MemoryBackend) else None
    return {
        "link": meter.link.name,
        "link_bytes_per_s": meter.link.bytes_per_s,
        "round_trip_s": meter.link.round_trip_s,
        "source": SOURCE,
        "capacity_bytes": l3_bytes,
        "read_bytes": meter.read_bytes,
        "read_s": meter.read_s,
        "write_bytes": meter.write_bytes,
        "write_s": meter.write_s,
        "written_blocks": meter.written_blocks,
        "written_images": meter.written_images,
        "jobs": dict(meter.jobs),
        "still_on_host_blocks": blocks,
        "still_on_host_images": images,
        "eviction_write_bytes": max(0, meter.write_bytes - resident),
        "store_objects": len(store.objects) if store is not None else -1,
        "store_evicted": store.c.evicted if store is not None else -1,
        **{k: v for k, v in tier.local_stats().items() if k.startswith("l3_refused")},
    }


def drop_store(tree_cache: Any) -> None:
    """Forget the replay's in-process store (its memory) once the replay is done."""
    from sglang_hybrid.store.l3.memory import drop

    tier = getattr(tree_cache, "l3", None)
    if tier is not None:
        drop(tier.url.target)
