"""``--hybrid-l3 URL``: a third tier behind the host tier, shared by a fleet (issue #39).

What moves, and when (``docs/l3.md``):

- **Out (write-through).** Whatever lands in the host tier is written to L3 as well: a lane's
  blocks once their host write retired, a snapshot's image and tail once theirs did
  (``HostTier``'s two call-outs, :meth:`L3Tier.wrote_blocks` / :meth:`L3Tier.wrote_snapshot`).
  With L3 on, the host tier writes a lane's blocks with each snapshot it publishes, not only at
  release (``HostTier.write_snapshot``): a snapshot is of use to another server only with them.
  Writing at host *eviction* instead would leave another server nothing to reuse until the
  writer ran short of host memory; the replay measures both (``docs/l3.md``). The write thread
  reads a slab only while its allocation count shows it unchanged (``store/l3/client.py``), so
  no pin holds host memory for L3 and no index decision waits for it. At most
  ``WRITE_LIMIT_BYTES`` are queued; beyond that, and while L3 is off, writes are skipped.
- **In (lookup, then fetch).** Before an admission pass, a waiting request near the queue's head
  whose prompt reaches ``MIN_GAIN_TOKENS`` past the deepest state the local tree holds gets one
  lookup: its local path is pinned, it is held out of admission, and the read thread asks L3 for
  the blocks past that path and the deepest snapshot on them (``index/l3_keys.py``). A hit
  reserves host slabs (host eviction as for any write) and fetches the objects into them, each
  verified first (``store/l3/objects.py``); once landed they enter the index as host-only
  entries (``index/l3_adopt.py``) and the request is released: its next match restores from the
  host through the ordinary path (``load_back.py``). No forward pass ever waits for L3.
- **TP ranks agree.** Each rank reads and writes its own objects (its rank is in the
  fingerprint). Lookups start on every rank alike (the queue and the index are the same on every
  rank; whether L3 is on is the MIN over the group), the number of read jobs retired is the MIN
  over the group, and so is each result: a lookup hits only at a frontier every rank found, a
  fetch succeeds only where every rank's objects verified. Writes decide nothing and are not
  agreed.
- **Failure.** An unreachable, slow (past a job's deadline) or killed store turns L3 off on that
  rank (logged once, counted; ``store/l3/health.py``); requests held for it are released as
  misses, and it is tried again with exponential backoff. A refused object (corrupt, truncated,
  foreign, misplaced) is counted and the request recomputes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..index import BLOCK_TOKENS, BlockNode, PromptKey, Snapshot
from ..index.l3_adopt import Fetched, adopt_fetched, release_reserved, reserve_host
from ..index.l3_keys import KeySpace, ProbePlan, fingerprint_digest
from ..index.node import FastResidency
from ..store.l3.backend import L3Unavailable, L3Url, parse_url
from ..store.l3.client import (
    FetchResult,
    L3Client,
    ProbeResult,
    PutCounts,
    PutTarget,
    SnapshotOut,
)
from ..store.l3.health import Breaker
from ..store.l3.jobs import ClockedJobQueue, Job, JobCost, JobQueue
from ..store.l3.objects import Geometry
from .request import ATTR, ReqState, namespace_of, token_bytes

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from .cache import HybridRadixCache

logger = logging.getLogger(__name__)
R = FastResidency

MIN_GAIN_TOKENS = 128  # a lookup only for prompts reaching this far past the local best state
LOOKUP_WINDOW = 16  # waiting requests considered per pass, from the head
MAX_LOOKUPS = 8  # lookups in flight at once
WRITE_LIMIT_BYTES = 256 << 20  # write-through to L3 queued at most
PROBE_DEADLINE_S = 5.0
CONNECT_DEADLINE_S = 120.0
# While the first connection is made, a request L3 could serve waits for it this long at most
# (from the first pass one waits): a server's first requests after a restart are the ones L3
# is for. A store that answers later turns L3 on for later requests only.
FIRST_CONNECT_WAIT_S = 5.0
FETCH_DEADLINE_S = 5.0  # plus the bytes at FETCH_FLOOR_BYTES_S
FETCH_FLOOR_BYTES_S = 50e6
DONE = "_hybrid_l3_looked_up"  # on a Req: its one lookup was decided
WAITED = "_hybrid_l3_waited"  # on a Req: held for the first connection (counted once)
TOKENS = "_hybrid_l3_tokens"  # on a Req: prefix tokens whose state or KV came from L3
L3_SOURCES = ("index/l3_keys.py", "store/l3/objects.py", "store/layout.py", "index/keys.py")


@dataclass(slots=True)
class L3Counters:
    """Counters every TP rank agrees on (they enter the cache's ``stats()``)."""

    lookups: int = 0
    lookup_hits: int = 0  # a snapshot deeper than the local one, found on every rank
    fetches_landed: int = 0
    fetch_failed: int = 0  # refused or failed on some rank: recomputed
    fetched_blocks: int = 0
    fetched_snapshots: int = 0
    fetched_tokens: int = 0  # frontier gained over the local best, summed
    no_room: int = 0  # a hit the host tier could not reserve slabs for
    skipped_off: int = 0  # lookups not made while L3 was off
    waited_connect: int = 0  # requests held for L3's first connection


@dataclass(slots=True)
class LocalCounters:
    """This rank's own counters (not agreed across ranks: never in decisions)."""

    writes_skipped_off: int = 0
    writes_skipped_busy: int = 0
    write_jobs: int = 0
    expired: int = 0
    errors: int = 0


@dataclass(slots=True, eq=False)
class Lookup:
    rid: str
    req: Any
    key: PromptKey
    path: list[BlockNode]  # the local path, pinned while the lookup runs
    plan: ProbePlan
    generation: int
    job: Job | None = None
    probe: ProbeResult | None = None
    fetched: Fetched | None = None
    frontier: int = 0


@dataclass(slots=True, eq=False)
class WriteTag:
    nbytes: int
    kind: str = "put"


def l3_fingerprint(base: dict[str, Any]) -> dict[str, Any]:
    """The cache file's fingerprint (``persistence.fingerprint``) made fleet-wide: the model's
    *path* differs between machines that load the same weights, so it counts only where the
    weights cannot be digested (not a local directory); the sources that define an L3 object's
    bytes (key derivation, object format, slab layout) replace the cache file's."""
    import xxhash

    out = dict(base)
    if not str(out.get("weights", "")).startswith("not a local directory"):
        out.pop("model_path", None)
    out.pop("sglang_hybrid_source", None)
    pkg = Path(__file__).resolve().parents[1]
    out["l3_source"] = xxhash.xxh3_64_hexdigest(
        b"".join(rel.encode() + b"\0" + (pkg / rel).read_bytes() for rel in L3_SOURCES)
    )
    return out


class L3Tier:
    def __init__(
        self,
        cache: HybridRadixCache,
        url: L3Url,
        fingerprint: dict[str, Any],
        *,
        tp_rank: int,
        tp_size: int,
        group: Any = None,
    ) -> None:
        host = cache.host_tier
        assert host is not None
        self.cache = cache
        self.url = url
        self.fields = fingerprint
        self.space = KeySpace(url.prefix, fingerprint_digest(fingerprint))
        g = Geometry(cache.block_bytes, cache.image_bytes, cache.slab_bytes)
        self.client = L3Client(url, self.space, g, host.memory, tp_rank=tp_rank, tp_size=tp_size)
        self.reader = JobQueue("hybrid-l3-read")
        self.writer = JobQueue("hybrid-l3-write")
        self.breaker = Breaker(url.describe())
        self.group = group if tp_size > 1 else None
        self.lookups: dict[str, Lookup] = {}
        self.write_bytes = 0
        self.generation = 0  # a cache reset starts a new one: older jobs' results are dropped
        self.c = L3Counters()
        self.local = LocalCounters()
        self._connecting = False
        self.waiting: set[str] = set()  # rids held this pass for the first connection
        self._wait_since: float | None = None  # monotonic: the first such hold
        # (slab, gen) of every host slab read into an object the store took (``use_clock``'s
        # ``track_writes``: the replay's write-policy comparison); None: not kept.
        self.written: dict[int, int] | None = None
        host.l3 = self
        logger.info(
            "L3 %s: objects keyed %s (rank %d of %d)",
            url.describe(),
            self.space.block(b"\0" * 16).rsplit("-b-", 1)[0],
            tp_rank,
            tp_size,
        )
        self._try_connect()

    # ================================================================ connection and health
    def _try_connect(self) -> None:
        """Connect (first time) or try the store again (a trial) on the write thread."""
        if self._connecting or self.writer.stuck:
            return
        self._connecting = True
        self.breaker.begin()
        probe_key = self.space.block(b"\0" * 16)

        def run(job: Job) -> str:
            name = self.client.connect(job)
            assert self.client.backend is not None
            self.client.backend.exists([probe_key])  # raises while the store is down
            return name

        self.writer.submit(Job(run, CONNECT_DEADLINE_S, WriteTag(0, "connect")))

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError):
            self.local.expired += 1
            reason = "no answer within the deadline"
        elif isinstance(exc, L3Unavailable):
            reason = str(exc)
        else:
            self.local.errors += 1
            reason = f"{type(exc).__name__}: {exc}"
            logger.debug("L3 job failed", exc_info=exc)
        self.breaker.fail(reason)

    # ================================================================ writes (local)
    def _write(self, nbytes: int, run: Any, cost: JobCost) -> None:
        if not self.breaker.up or self.writer.stuck:
            self.local.writes_skipped_off += 1
            return
        if self.write_bytes and self.write_bytes + nbytes > WRITE_LIMIT_BYTES:
            self.local.writes_skipped_busy += 1
            return
        self.write_bytes += nbytes
        self.local.write_jobs += 1
        deadline = FETCH_DEADLINE_S + nbytes / FETCH_FLOOR_BYTES_S
        self.writer.submit(Job(run, deadline, WriteTag(nbytes), cost))

    def wrote_blocks(self, planned: list[tuple[BlockNode, int]]) -> None:
        """HostTier: ``planned`` (one lane path's blocks) landed in the host tier."""
        nodes = [n for n, _ in planned if n.host_state is R.RESIDENT]
        if not nodes:
            return
        pool = self.cache.index.host
        assert pool is not None
        tokens, extras = _path_tokens(max(nodes, key=lambda n: n.depth))
        targets = [PutTarget(n.depth, n.host_slab, pool.gen[n.host_slab]) for n in nodes]
        nbytes = len(targets) * self.cache.block_bytes
        client = self.client
        run = lambda job: client.put_blocks(job, tokens, extras, targets, pool)  # noqa: E731
        self._write(nbytes, run, JobCost(2, len(targets)))  # exists, then put

    def wrote_snapshot(self, s: Snapshot) -> None:
        """HostTier: ``s``'s image (and tail) landed in the host tier."""
        if s.host_state is not R.RESIDENT or (s.tail and s.tail_host_state is not R.RESIDENT):
            return
        pool = self.cache.index.host
        assert pool is not None
        tokens, extras = _path_tokens(s.anchor)
        slabs = (*s.host_slabs, *((s.tail_host_slab,) if s.tail else ()))
        snap = SnapshotOut(
            s.frontier,
            s.tail,
            int(s.kind),
            tuple(s.host_slabs),
            s.tail_host_slab if s.tail else -1,
            tuple(pool.gen[x] for x in slabs),
        )
        client = self.client
        run = lambda job: client.put_snapshot(job, tokens, extras, snap, pool)  # noqa: E731
        self._write(self.cache.image_bytes, run, JobCost(2, int(bool(s.tail)), 1))

    def _poll_writes(self) -> None:
        w = self.writer
        k = w.finished() if w.jobs else 0
        for job in w.retire(k) if k else ():
            tag: WriteTag = job.tag
            self.write_bytes -= tag.nbytes
            r = job.result()
            if tag.kind == "connect":
                self._connecting = False
            if isinstance(r, BaseException):
                self._failed(r)
            elif tag.kind == "connect":
                self.breaker.ok()
            elif self.written is not None and isinstance(r, PutCounts):
                self.written.update(r.written)
        if not self.breaker.up and self.breaker.usable():
            self._try_connect()

    # ================================================================ lookups (agreed)
    def held(self, queue: list[Req]) -> list[Req]:
        """Requests to hold out of this admission pass: those whose lookup or fetch runs, after
        starting lookups for the undecided ones near the head."""
        if self.cache.disable:
            return []
        todo = [
            r
            for r in queue[:LOOKUP_WINDOW]
            if not getattr(r, DONE, False) and r.rid not in self.lookups
        ]
        self.waiting.clear()
        if todo:
            self._start_lookups(todo)
        if not self.lookups and not self.waiting:
            return []
        return [r for r in queue if r.rid in self.lookups or r.rid in self.waiting]

    def _start_lookups(self, reqs: list[Req]) -> None:
        on = self._agree_all(self.breaker.usable() and not self.reader.stuck)
        wait = not on and not self._agree_all(not self._awaiting_first_connect())
        for req in reqs:
            setattr(req, DONE, True)
            if len(self.lookups) >= MAX_LOOKUPS:
                setattr(req, DONE, False)  # looked at again next pass
                continue
            key = self._key_of(req)
            if key is None:
                continue
            n = key.n
            m = self.cache.index.match(key)
            f_local = m.best.frontier if m.best is not None else 0
            if n - 1 - f_local < MIN_GAIN_TOKENS:
                continue
            if wait:
                setattr(req, DONE, False)  # decided once the connection is up (or not)
                self.waiting.add(req.rid)
                if not getattr(req, WAITED, False):
                    setattr(req, WAITED, True)
                    self.c.waited_connect += 1
                continue
            if not on:
                self.c.skipped_off += 1
                continue
            plan = ProbePlan(len(m.path), (n - 1) // BLOCK_TOKENS, f_local, n - 1)
            path = list(m.path)
            self.cache.index.transfers.pin_for_prefetch(path)  # the fetched blocks hang here
            lk = Lookup(req.rid, req, key, path, plan, self.generation)
            extras = _extras(key, plan.blocks)
            # (bound now: the loop moves on before the job runs)
            run = partial(_probe, self.client, key.data, extras, plan)
            lk.job = Job(run, PROBE_DEADLINE_S, lk, JobCost(2))  # two exists calls
            self.reader.submit(lk.job)
            self.lookups[req.rid] = lk
            self.c.lookups += 1
            self.breaker.begin()

    def _awaiting_first_connect(self) -> bool:
        """This rank's first connection is in flight and a request may still wait for it
        (``FIRST_CONNECT_WAIT_S`` from the first wait; every rank waits while any does)."""
        if not (self._connecting and self.breaker.first_attempt):
            return False
        now = time.monotonic()
        if self._wait_since is None:
            self._wait_since = now
        return now - self._wait_since < FIRST_CONNECT_WAIT_S

    def _key_of(self, req: Req) -> PromptKey | None:
        """The prompt key as ``match_prefix`` builds it (namespace included); None for requests
        L3 does not serve: images (their extra keys come from the processor), a request that
        already ran (retracted: its outputs are part of its key)."""
        if getattr(req, "multimodal_inputs", None) is not None or req.output_ids:
            return None
        if getattr(req, "skip_radix_cache_insert", False):
            return None
        tokens = req.origin_input_ids
        n = len(tokens)
        state: ReqState | None = getattr(req, ATTR, None)
        ns = namespace_of(req)
        if state is not None and state.key.n >= n and state.key.namespace == ns:
            return state.key if state.key.n == n else state.key.prefix(n)
        return PromptKey(token_bytes(tokens, 0, n), namespace=ns)

    def poll(self) -> None:
        """Once per scheduler iteration on every rank (``HybridRadixCache.poll``)."""
        self._poll_writes()
        if not self.reader.jobs:
            return
        k = self._agree_min([self.reader.finished()])[0]
        if not k:
            return
        jobs = self.reader.retire(k)
        lo, hi = self._agree_results([self._value(j) for j in jobs])
        for job, a, b in zip(jobs, lo, hi, strict=True):
            lk: Lookup = job.tag
            if lk.generation != self.generation:  # a reset dropped it
                continue
            if lk.fetched is None:
                self._probed(lk, a if a == b else 0)
            else:
                self._landed(lk, job, a == 1)
        self.cache.free_dropped()

    def _value(self, job: Job) -> int:
        """A retired read job's result as one agreeable number: a probe's frontier found (0:
        none), a fetch's success (1) or failure (0)."""
        r = job.result()
        lk: Lookup = job.tag
        if isinstance(r, BaseException):
            self._failed(r)
            return 0
        if lk.generation == self.generation and self.breaker.trial:
            self.breaker.ok()
        if isinstance(r, ProbeResult):
            lk.probe = r
            return r.frontier
        assert isinstance(r, FetchResult)
        return 1 if r.refusal is None else 0

    def _probed(self, lk: Lookup, frontier: int) -> None:
        if frontier <= lk.plan.min_frontier or lk.probe is None:
            self._finish(lk)
            return
        self.c.lookup_hits += 1
        index = self.cache.index
        first = lk.plan.first_block
        anchor = frontier // BLOCK_TOKENS - 1
        nblocks = max(0, anchor + 1 - first)
        has_tail = frontier % BLOCK_TOKENS != 0
        assert index.host is not None
        need = nblocks + index.host.image_slabs + (1 if has_tail else 0)
        slabs = reserve_host(index, need)
        if slabs is None:
            self.c.no_room += 1
            self._finish(lk)
            return
        image_end = nblocks + index.host.image_slabs
        tail_slab = slabs[image_end] if has_tail else -1
        block_bytes = self.cache.block_bytes
        tail = lk.key.data[4 * BLOCK_TOKENS * (anchor + 1) : 4 * frontier]
        lk.fetched = Fetched(
            first, slabs[:nblocks], frontier, tail, 0, slabs[nblocks:image_end], tail_slab
        )
        lk.frontier = frontier
        data, digests, client, f = lk.key.data, lk.probe.digests, self.client, lk.fetched
        nbytes = nblocks * block_bytes + self.cache.image_bytes

        def run(job: Job) -> FetchResult:
            return client.fetch(
                job, data, digests, first, frontier, f.block_slabs, f.image_slabs, f.tail_slab
            )

        cost = JobCost(1, nblocks + int(has_tail), 1)
        lk.job = Job(run, FETCH_DEADLINE_S + nbytes / FETCH_FLOOR_BYTES_S, lk, cost)
        self.reader.submit(lk.job)

    def _landed(self, lk: Lookup, job: Job, ok: bool) -> None:
        f = lk.fetched
        assert f is not None
        index = self.cache.index
        r = job.result()
        if ok and isinstance(r, FetchResult):
            f = f._replace(kind=r.snapshot_kind)
            got = adopt_fetched(index, lk.key, lk.path, f)
            self.c.fetches_landed += 1
            self.c.fetched_blocks += got.new_blocks + got.backed_blocks
            self.c.fetched_snapshots += int(got.snapshot)
            gained = lk.frontier - lk.plan.min_frontier
            self.c.fetched_tokens += gained
            setattr(lk.req, TOKENS, gained)
        else:
            job.cancel()  # waits for a copy into the slabs under way, stops any later one
            self.c.fetch_failed += 1
            release_reserved(
                index,
                [*f.block_slabs, *f.image_slabs, *((f.tail_slab,) if f.tail_slab >= 0 else ())],
            )
        self._finish(lk)

    def _finish(self, lk: Lookup) -> None:
        self.cache.index.transfers.unpin_for_prefetch(lk.path)
        self.lookups.pop(lk.rid, None)

    # ================================================================ ranks
    def _agree_min(self, values: list[int]) -> list[int]:
        if self.group is None or not values:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(x) for x in t.tolist()]

    def _agree_results(self, values: list[int]) -> tuple[list[int], list[int]]:
        """(MIN, MAX) of each retired job's value over the TP group: a probe hits only at a
        frontier every rank found (MIN == MAX), a fetch lands only where every rank's did."""
        lo = self._agree_min(values)
        hi = [-v for v in self._agree_min([-v for v in values])]
        return lo, hi

    def _agree_all(self, flag: bool) -> bool:
        return bool(self._agree_min([int(flag)])[0])

    # ================================================================ life cycle
    def on_reset(self) -> None:
        """The cache was reset (a flush): lookups in flight belong to the old index; their jobs
        are cancelled (no more writes into the old slabs) and their results dropped."""
        for lk in self.lookups.values():
            if lk.job is not None:
                lk.job.cancel()
        self.lookups.clear()
        self.waiting.clear()
        self.generation += 1

    def use_clock(self, now: Any, seconds: Any, *, track_writes: bool = False) -> None:
        """Run L3 jobs in modelled time from now on (the replay, ``replay/l3_model.py``): each
        job runs when submitted, on the scheduler's thread, and finishes once ``now()`` passes
        the time ``seconds(job)`` gives it (``ClockedJobQueue``); deadlines do not apply. With
        ``track_writes``, the host slabs read into stored objects are kept (``written``)."""
        wait_idle(self)  # the connection, made on the write thread
        for q in (self.reader, self.writer):
            q.close()
        self.reader = ClockedJobQueue(now, seconds)
        self.writer = ClockedJobQueue(now, seconds)
        self.written = {} if track_writes else None

    def next_ready(self) -> float | None:
        """The modelled time the next L3 job finishes (``use_clock``); None: none in flight."""
        ends = [
            t
            for q in (self.reader, self.writer)
            if isinstance(q, ClockedJobQueue) and (t := q.next_ready()) is not None
        ]
        return min(ends) if ends else None

    def in_flight(self) -> bool:
        return bool(self.reader.jobs or self.writer.jobs)

    def close(self) -> None:
        self.reader.wait(timeout_s=10.0)
        self.writer.wait(timeout_s=30.0)
        self.reader.close(wait=False)
        self.writer.close(wait=False)
        self.client.close()

    def stats(self) -> dict[str, int]:
        """The agreed counters, as ``stats()`` keys."""
        return {f"l3_{k}": getattr(self.c, k) for k in self.c.__dataclass_fields__}

    def local_stats(self) -> dict[str, Any]:
        """This rank's own: writes, refusals by reason, whether L3 is on."""
        p = self.client.counters.put
        out: dict[str, Any] = {
            f"l3_{k}": getattr(self.local, k) for k in self.local.__dataclass_fields__
        }
        out.update(
            l3_on=int(self.breaker.up),
            l3_offs=self.breaker.offs,
            l3_put_objects=p.objects,
            l3_put_bytes=p.nbytes,
            l3_put_present=p.present,
            l3_put_changed=p.changed,
            l3_put_failed=p.failed,
        )
        for why, n in self.client.counters.refused.items():
            out[f"l3_refused_{why}"] = n
        return out


def _path_tokens(node: BlockNode) -> tuple[bytes, list[int] | None]:
    """The packed tokens (and extra keys, None when all 0) of the path from the root to
    ``node``: O(depth) attribute reads and one join."""
    chain: list[BlockNode] = []
    n: BlockNode | None = node
    while n is not None and not n.is_root:
        chain.append(n)
        n = n.parent
    chain.reverse()
    extras = [c.extra for c in chain]
    return b"".join(c.tokens for c in chain), (extras if any(extras) else None)


def _probe(
    client: L3Client, data: bytes, extras: list[int] | None, plan: ProbePlan, job: Job
) -> ProbeResult:
    return client.probe(job, data, extras, plan)


def _extras(key: PromptKey, blocks: int) -> list[int] | None:
    if not key.has_extras:
        return None
    return [key.extra(b) for b in range(blocks)]


def setup(cache: HybridRadixCache, ctx: Any, opts: Any) -> L3Tier | None:
    """Called by the cache factory with ``--hybrid-l3``: a URL this build cannot use, or no host
    tier to land in, is a startup error naming the flag; None with --disable-radix-cache."""
    from ..index import ConfigError
    from ..store.l3.backend import L3ConfigError
    from .persistence import fingerprint

    spec = getattr(opts, "l3", None)
    if not spec or cache.disable:
        return None
    try:
        url = parse_url(spec)
    except L3ConfigError as e:
        raise ConfigError(str(e)) from e
    if cache.host_tier is None:
        raise ConfigError(
            f"--hybrid-l3 {spec}: L3 lands in the host tier, and --hybrid-host-cache-mib 0 turns "
            f"it off; give the host tier a budget or drop --hybrid-l3"
        )
    tp_rank, tp_size = int(ctx.tp_rank), int(ctx.tp_size)
    tier = L3Tier(
        cache,
        url,
        l3_fingerprint(fingerprint(ctx, cache)),
        tp_rank=tp_rank,
        tp_size=tp_size,
        group=getattr(ctx.params, "tp_cache_group", None),
    )
    cache.l3 = tier
    return tier


def wait_idle(tier: L3Tier, timeout_s: float = 30.0) -> None:
    """Tests: poll until no L3 job is in flight."""
    end = time.monotonic() + timeout_s
    while tier.in_flight() and time.monotonic() < end:
        tier.poll()
        time.sleep(0.01)
