"""``--hybrid-cache-file PATH``: the host tier outlives the process (spec §5.5).

- **Load**, when the scheduler builds the cache (``plugin.build_cache``), before any request:
  the file is used only when its fingerprint equals this server's (below) and its geometry the
  host tier's. A tier that holds the whole file restores all of it; a smaller one keeps whole
  snapshots by GDSF density (``index/persist.py``). Entries come back host-only; their first
  requests restore through the ordinary host restore path. A missing, mismatched or damaged
  file loads nothing and the log says why; with TP > 1 the ranks agree or all load nothing
  (each rank has its own file, ``PATH.tp<rank>``, since each holds its own KV heads).
- **Save**, in the scheduler's orderly exit: SGLang calls ``tree_cache.release_host_resources``
  after the event loop ends gracefully (a ``ShutdownReq``, or the stop handlers below), which
  drains the write-through and writes ``PATH.tmp``, fsync, rename (``store/cache_file.py``):
  what the host tier holds and what lives only on the device (superseded snapshots too), up to
  the host tier's size, densest first (``index.persist.export_for_save``, issue #38); slabs
  without a host copy are read from the device through the host tier's copier
  (:class:`DeviceSlabs`), so they are byte for byte what a write-through would have stored.
  A scheduler that ended on an error saves nothing, so the previous file stays.
- **Stop signals**, installed in each scheduler when its event loop starts: the first SIGTERM or
  SIGINT ends the loop at its next iteration (the save follows); SIGUSR1 does the same and is
  what the launcher sends; a SIGTERM/SIGINT after a stop was requested abandons the save (the
  temporary file is removed, the previous file stays; a save not yet begun never begins).
  Without them SGLang's default would kill the scheduler on SIGTERM, and on Ctrl+C the launcher
  SIGKILLs its children right after the HTTP server stops.
- **Launcher**: around ``http_server.launch_server``, once the server stopped, each scheduler
  still alive is asked to stop (SIGUSR1) and waited for while it saves; a second SIGINT (or
  SIGTERM) there forwards SIGINT, i.e. abandons, and waits at most 2 s more. SGLang's own grace
  between its ``ShutdownReq`` and SIGKILL (15 s) is raised to :data:`SAVE_WAIT_S` so a large save
  is not cut short. A SIGKILL at any moment leaves the previous file intact.

Fingerprint decision: hashing every weight byte at startup would take minutes for a large model,
so each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf`` and index
JSONs in the model directory) contributes its name, size and the xxh3 of its first and last MiB;
the model's HF config is hashed whole. A re-quantised or retrained checkpoint changes its sizes or
its first/last bytes in practice; an edit confined to the middle of a shard of the same size is
not detected (delete the file after such an edit). The fingerprint also holds the model path,
revision and load format, the model, KV and state dtypes, SGLang's page size, the cache's block
size, TP rank and size, SGLang's and sglang-hybrid's versions, and an xxh3 of the sources that
define what the bytes mean (:data:`SOURCE_FILES`: block hashing, slab layout, records, file
format), since a dev checkout keeps its version number across edits.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

import xxhash

from ..index import BLOCK_TOKENS, ConfigError
from ..index.persist import (
    SOURCE_IMAGE,
    SOURCE_TAIL,
    AdoptError,
    AdoptPlan,
    HostExport,
    SaveSource,
    export_for_save,
)
from ..store.cache_file import (
    CacheFileError,
    Geometry,
    SaveAbandoned,
    SaveControl,
    fingerprint_mismatch,
    read_cache_file,
    read_slabs,
    write_cache_file,
)
from .flags import FLAG_CACHE_FILE

logger = logging.getLogger(__name__)


SAVE_WAIT_S = 600.0  # how long a launcher waits for its schedulers' saves
ABANDON_WAIT_S = 2.0  # ... and after a second Ctrl+C (spec §5.5)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE_BYTES = 1 << 20
MiB = 1 << 20
SOURCE_FILES = ("index/keys.py", "index/persist.py", "store/layout.py", "store/cache_file.py")


class LoadReport(NamedTuple):
    loaded: bool
    reason: str  # why nothing (or only part) was restored; "" when all of it was
    snapshots: int = 0
    nodes: int = 0
    nbytes: int = 0
    durable: int = 0  # clients' durable pins (without a TTL) pinned again
    learned: int = 0  # events of the host's learned order taken from the file (0: none)
    digest: int = 0  # what TP ranks compare (``load_digest``): what was loaded, not how much


# ================================================================ configuration
def check_cache_file(path: str | None, host_cache_mib: int | None) -> Path | None:
    """The resolved absolute path, or a refusal naming the flag and the fix (before caching)."""
    if not path:
        return None
    if host_cache_mib == 0:
        raise ConfigError(
            f"{FLAG_CACHE_FILE} keeps the host tier across restarts, and --hybrid-host-cache-mib 0 "
            f"turns the host tier off; give the host tier a budget or drop {FLAG_CACHE_FILE}"
        )
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise ConfigError(f"{FLAG_CACHE_FILE} {path}: is a directory; name a file in it")
    if not p.parent.is_dir():
        raise ConfigError(f"{FLAG_CACHE_FILE} {path}: the directory {p.parent} does not exist")
    return p


def rank_path(path: Path, tp_rank: int, tp_size: int) -> Path:
    """Each TP rank holds its own KV heads, so its own file; rank 0 of one rank is ``path``."""
    return path if tp_size <= 1 else path.with_name(f"{path.name}.tp{tp_rank}")


# ================================================================ fingerprint
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def weights_digest(model_path: str) -> str:
    """Name, size and first/last MiB of every weight file (see the module docstring)."""
    root = Path(model_path)
    if not root.is_dir():
        return f"not a local directory: {model_path}"
    h = xxhash.xxh3_128()
    for p in sorted(root.iterdir()):
        name = p.name
        if not p.is_file() or not (name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")):
            continue
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def source_digest() -> str:
    """xxh3 of the sources that define what saved bytes mean: block hashing, slab layout, the
    records and the file format (a dev checkout keeps its version number across such edits)."""
    pkg = Path(__file__).resolve().parents[1]
    h = xxhash.xxh3_64()
    for rel in SOURCE_FILES:
        h.update(rel.encode())
        h.update((pkg / rel).read_bytes())
    return h.hexdigest()


def _config_digest(hf_config: Any) -> str:
    try:
        data = hf_config.to_dict()
    except AttributeError:
        data = dict(vars(hf_config)) if hf_config is not None else {}
    return xxhash.xxh3_64_hexdigest(json.dumps(data, sort_keys=True, default=str).encode())


def fingerprint(ctx: Any, cache: Any) -> dict[str, Any]:
    """What must equal for saved bytes to mean the same to this server (spec §5.5)."""
    sa, mc = ctx.server_args, ctx.model_config
    model_path = str(getattr(mc, "model_path", None) or getattr(sa, "model_path", ""))
    with contextlib.suppress(OSError):
        if Path(model_path).exists():
            model_path = str(Path(model_path).resolve())
    return {
        "model_path": model_path,
        "revision": str(getattr(sa, "revision", None)),
        "load_format": str(getattr(sa, "load_format", None)),
        "model_config": _config_digest(getattr(mc, "hf_config", None)),
        "weights": weights_digest(model_path),
        "dtype": str(getattr(mc, "dtype", getattr(sa, "dtype", None))),
        "kv_cache_dtype": str(getattr(sa, "kv_cache_dtype", None)),
        "kv_dtypes": sorted({str(b.dtype) for b in cache.pools.kv_buffers}),
        # A slab holds the draft model's KV too under speculative decoding (``draft.py``).
        "draft_kv_layers": int(cache.pools.draft_layers),
        "draft_model_path": str(getattr(sa, "speculative_draft_model_path", None)),
        "state_dtypes": cache.state_dtypes,
        "page_size": int(cache.page_size),
        "block_tokens": BLOCK_TOKENS,
        "tp_rank": int(ctx.tp_rank),
        "tp_size": int(ctx.tp_size),
        "sglang": _version("sglang"),
        "sglang_hybrid": _version("sglang-hybrid"),
        "sglang_hybrid_source": source_digest(),
    }


def geometry_of(cache: Any) -> Geometry:
    return Geometry(
        slab_bytes=int(cache.slab_bytes),
        image_bytes=int(cache.image_bytes),
        image_slabs=int(cache.index.host.image_slabs),
        block_bytes=int(cache.block_bytes),
    )


# ================================================================ load / save
def load_digest(
    records: HostExport, plan: AdoptPlan, learned_state: Any, learned_events: int
) -> int:
    """A 62-bit digest of what a load adopted, equal on TP ranks that loaded the same: the kept
    blocks (parent, hash, tokens) and snapshots (anchor, frontier, tail, kind, hits, durable pin)
    in record order, and the learned order's saved state and the events taken from it. Slab
    numbers and the bytes are left out (each rank holds its own KV heads). xxh3 with its fixed
    seed: the same on every process (Python's ``hash`` is salted per process)."""
    h = xxhash.xxh3_64()
    nodes, snaps = records.nodes, records.snapshots
    for i in plan.nodes:
        n = nodes[i]
        h.update(b"n%d:%d:%d:" % (n.parent, n.lookup_hash, n.extra))
        h.update(n.tokens)
    for i in plan.snapshots:
        r = snaps[i]
        h.update(b"s%d:%d:%d:%d:%d:" % (r.anchor, r.frontier, r.kind, r.hits, r.durable))
        h.update(r.tail)
    h.update(json.dumps(learned_state, sort_keys=True).encode())
    h.update(b"e%d" % learned_events)
    return h.intdigest() >> 2  # non-negative, and -digest fits the int64 all-reduce


class Persistence:
    """One scheduler's cache file: loads it once at start, saves at the orderly stop."""

    def __init__(
        self, path: Path, fingerprint: dict[str, Any], geometry: Geometry, tp_group: Any = None
    ) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.geometry = geometry
        self.tp_group = tp_group
        self.control = SaveControl()
        self.saved = False

    # ---------------------------------------------------------------- load
    def load(self, cache: Any) -> LoadReport:
        t0 = time.monotonic()
        try:
            report = self._load(cache)
        except Exception as e:  # never a reason not to start: serve with an empty tier
            logger.exception("reading %s failed", self.path)
            cache.empty_index()
            report = LoadReport(False, f"reading it failed ({type(e).__name__}: {e})")
        report = self._agree(cache, report)
        dt = time.monotonic() - t0
        if report.loaded and not report.reason:
            logger.info(
                "host tier restored from %s: %d snapshots (%d durable), %d blocks, %.1f MiB in "
                "%.2f s; the learned host order: %s",
                self.path,
                report.snapshots,
                report.durable,
                report.nodes,
                report.nbytes / MiB,
                dt,
                f"{report.learned} events" if report.learned else "none saved",
            )
        elif report.loaded:
            logger.warning(
                "host tier partly restored from %s: %d snapshots, %d blocks, %.1f MiB in %.2f s; "
                "%s",
                self.path,
                report.snapshots,
                report.nodes,
                report.nbytes / MiB,
                dt,
                report.reason,
            )
        else:
            logger.warning(
                "host tier not restored from %s: %s; the save at shutdown replaces the file",
                self.path,
                report.reason,
            )
        return report

    def _load(self, cache: Any) -> LoadReport:
        if not self.path.exists():
            return LoadReport(False, "no file yet (it is written at an orderly stop)")
        logger.info("loading host tier from %s", self.path)
        try:
            cf = read_cache_file(self.path)
        except CacheFileError as e:
            return LoadReport(False, e.reason)
        diff = fingerprint_mismatch(cf.fingerprint, self.fingerprint)
        if diff:
            return LoadReport(False, "the fingerprint differs: " + "; ".join(diff))
        if cf.geometry != self.geometry:
            return LoadReport(False, f"the slab geometry differs: {cf.geometry} -> {self.geometry}")
        index = cache.index
        plan = index.plan_adopt(cf.records)
        try:
            adopted = index.adopt_host(cf.records, plan)
            memory = cache.host_tier.memory
            nbytes = read_slabs(
                cf, ((src, memory.slab(dst).numpy()) for src, dst in adopted.copies)
            )
        except (CacheFileError, AdoptError) as e:
            cache.empty_index()  # nothing loaded: a fresh index, same memory
            reason = e.reason if isinstance(e, CacheFileError) else str(e)
            return LoadReport(False, reason)
        total = len(cf.records.snapshots)
        reason = ""
        if adopted.durable_dropped:
            logger.warning(
                "%d durable checkpoints of %s were not pinned again (the host tier is smaller "
                "than the file's, or they exceed the share pins may hold)",
                adopted.durable_dropped,
                self.path,
            )
        if adopted.snapshots < total:
            need = cf.header["slabs"] * cf.geometry.slab_bytes
            reason = (
                f"kept {adopted.snapshots} of {total} snapshots: the file needs a host tier of "
                f"{need / MiB:.0f} MiB, this one holds "
                f"{cache.config.host_cache_bytes / MiB:.0f} MiB"
            )
            if adopted.snapshots == 0:
                cache.empty_index()
                return LoadReport(False, reason)
        learned = self._adopt_learned(index, cf.header.get("learned"))
        digest = load_digest(cf.records, plan, cf.header.get("learned"), learned)
        return LoadReport(
            True, reason, adopted.snapshots, adopted.nodes, nbytes, adopted.durable, learned, digest
        )

    def _adopt_learned(self, index: Any, state: Any) -> int:
        """The file's learned host order, when it has one this version reads; its events."""
        if not isinstance(state, dict):
            return 0
        try:
            return int(index.adopt_learned(state))
        except ValueError as e:
            logger.warning("the learned host order in %s is not used: %s", self.path, e)
            return 0

    def _agree(self, cache: Any, report: LoadReport) -> LoadReport:
        """TP ranks must hold the same entries (their decisions must match): all or none."""
        if self.tp_group is None or int(self.fingerprint.get("tp_size", 1)) <= 1:
            return report
        from .ranks import all_reduce_range

        # One reduce of a content digest: equal counts from different files (two saves of
        # unequal age, another run's file renamed) must disagree too.
        lo, hi = all_reduce_range(report.digest if report.loaded else -1, self.tp_group)
        if lo == hi:
            return report
        cache.empty_index()
        return LoadReport(False, "the TP ranks' files disagree (one is missing, damaged or older)")

    # ---------------------------------------------------------------- save
    def save(self, cache: Any) -> bool:
        """Write the host tier; False when abandoned or failed (the previous file stays)."""
        if self.saved:
            return True
        if self.control.abandoned:
            logger.warning("host tier save abandoned before it began; %s stays", self.path)
            return False
        index, memory = cache.index, cache.host_tier.memory
        # What the host tier holds and what lives only on the device, as much as the host tier
        # holds (the restarted server loads it there), densest first (issue #38).
        saved = export_for_save(index, index.host.n_slabs)
        records = saved.records
        slabs = len(records.nodes) + sum(
            len(r.image_slabs) + (1 if r.tail else 0) for r in records.snapshots
        )
        logger.info(
            "saving host tier to %s: %d snapshots (%d from the device), %d blocks, %.1f MiB%s "
            "(a second Ctrl+C abandons the save and keeps the previous file)",
            self.path,
            len(records.snapshots),
            saved.device_snapshots,
            len(records.nodes),
            slabs * self.geometry.slab_bytes / MiB,
            f"; {saved.left_out} snapshots left out (the host tier's size)"
            if saved.left_out
            else "",
        )
        reader = DeviceSlabs(cache, saved.device) if saved.device else None
        host_slabs = index.host.n_slabs

        def read_slab(i: int) -> memoryview:
            if i < host_slabs:
                return memoryview(memory.slab(i).numpy())
            assert reader is not None
            return reader.read(i)

        try:
            w = write_cache_file(
                self.path,
                fingerprint=self.fingerprint,
                geometry=self.geometry,
                records=records,
                read_slab=read_slab,
                control=self.control,
                learned=index.export_learned(),
            )
        except SaveAbandoned:
            logger.warning("host tier save abandoned; the previous %s stays", self.path)
            return False
        except OSError as e:
            logger.error("host tier save to %s failed: %s; the previous file stays", self.path, e)
            return False
        self.saved = True
        logger.info(
            "host tier saved to %s: %.1f MiB in %.2f s", self.path, w.nbytes / MiB, w.seconds
        )
        return True


class DeviceSlabs:
    """A save's slabs that have no host copy, read from the device into one scratch slab set,
    laid out exactly as the host tier lays them out (the same ``SlabCopier``, so a restarted
    server restores them like any host slab). An image is copied once for its slabs (the file
    reads them in order); the save runs after the event loop ended, so nothing moves them."""

    def __init__(self, cache: Any, sources: dict[int, SaveSource]) -> None:
        from ..index.host_slabs import HostSlabPool
        from ..store.host_memory import HostMemory
        from ..store.transfer import SlabCopier

        tier = cache.host_tier
        layout = tier.layout
        self.image_slabs = int(cache.index.host.image_slabs)
        pool = HostSlabPool(
            (self.image_slabs + 1) * layout.slab_bytes, layout.slab_bytes, layout.image_bytes
        )
        self.memory = HostMemory(pool, pin=False)
        self.copier = SlabCopier(
            layout, self.memory, tier.pools.kv_buffers, tier.copier.state, staging="never"
        )
        self.sources = sources
        self.slot_id = cache.slot_id
        self.device = tier.pools.device
        self._image: int | None = None  # the snapshot whose image the scratch slabs hold

    def read(self, i: int) -> memoryview:
        import torch

        from ..store.device import handle_to_slots
        from ..store.transfer import BlockCopy

        src = self.sources[i]
        spare = self.image_slabs  # blocks and tails: the slab after the image's
        if src.what == SOURCE_IMAGE:
            if self._image != src.snapshot:
                self.copier.image(
                    self.slot_id(cast(int, src.ref)), list(range(self.image_slabs)), to_host=True
                )
                self._sync()
                self._image = src.snapshot
            return self.memory.slab(src.part).numpy().data
        slab = self.memory.slab(spare)
        slab.zero_()
        slots = handle_to_slots(src.ref, "cpu")
        if src.what == SOURCE_TAIL:
            slots = slots[: src.tokens]
        self.copier.blocks([BlockCopy(slots.to(torch.int64), spare)], to_host=True)
        self._sync()
        return slab.numpy().data

    def _sync(self) -> None:
        import torch

        if torch.device(self.device).type == "cuda":  # unverified on a GPU
            torch.cuda.synchronize(self.device)


def setup(cache: Any, ctx: Any, opts: Any) -> Persistence | None:
    """Called by the cache factory: attach a :class:`Persistence` to ``cache`` and load."""
    path = check_cache_file(getattr(opts, "cache_file", None), opts.host_cache_mib)
    if path is None:
        return None
    if cache.host_tier is None:  # --disable-radix-cache: nothing to keep
        return None
    tp_rank, tp_size = int(ctx.tp_rank), int(ctx.tp_size)
    p = Persistence(
        rank_path(path, tp_rank, tp_size),
        fingerprint(ctx, cache),
        geometry_of(cache),
        tp_group=getattr(ctx.params, "tp_cache_group", None) if tp_size > 1 else None,
    )
    cache.persistence = p
    p.load(cache)
    return p


# ================================================================ scheduler stop handlers
def before_event_loop(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler.run_event_loop`` (the scheduler's main thread)."""
    install_stop_handlers(scheduler)


def install_stop_handlers(scheduler: Any) -> None:
    """The stop signals of the module doc, when the scheduler's cache has a file."""
    cache = getattr(scheduler, "tree_cache", None)
    p: Persistence | None = getattr(cache, "persistence", None)
    if p is None:
        return
    state: dict[str, Any] = {"stop_at": None, "by": None}

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        first = state["stop_at"] is None
        if first:
            state["stop_at"], state["by"] = time.monotonic(), name
            scheduler.gracefully_exit = True
            logger.info(
                "%s: the scheduler stops and saves its host tier to %s (send it again to "
                "abandon the save)",
                name,
                p.path,
            )
            return
        if signum == signal.SIGUSR1:
            return  # the launcher's request repeats a stop already under way
        # A signal from the launcher's request and the user's Ctrl+C may cross: a press that
        # follows the launcher's SIGUSR1 within a second is the same stop, not a second one.
        if state["by"] == "SIGUSR1" and time.monotonic() - state["stop_at"] < 1.0:
            return
        if not p.control.abandoned:
            logger.warning("%s again: abandoning the host tier save", name)
        p.control.abandon()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, stop)


# ================================================================ launcher
def _scheduler_processes() -> list[Any]:
    from sglang.srt.utils.cudacore_pyspy_dump_utils import collect_scheduler_processes

    return collect_scheduler_processes()


def around_launch_server(orig: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``http_server.launch_server``: the launcher waits for its schedulers' saves."""
    from .flags import BACKEND, get_options

    opts = get_options(server_args)
    if getattr(server_args, "radix_cache_backend", None) != BACKEND or not getattr(
        opts, "cache_file", None
    ):
        return orig(server_args, *args, **kwargs)
    check_cache_file(opts.cache_file, opts.host_cache_mib)
    from sglang.srt.managers import tokenizer_manager

    grace = getattr(tokenizer_manager, "_SCHEDULER_EXIT_TIMEOUT_SECS", None)
    if isinstance(grace, (int, float)) and grace < SAVE_WAIT_S:
        tokenizer_manager._SCHEDULER_EXIT_TIMEOUT_SECS = SAVE_WAIT_S  # type: ignore[assignment]  # int from its literal 15; read as seconds
    try:
        return orig(server_args, *args, **kwargs)
    finally:
        wait_for_saves()


def wait_for_saves(timeout_s: float = SAVE_WAIT_S) -> None:
    """Ask every live scheduler to stop and save (SIGUSR1), wait; a second signal abandons."""
    import psutil

    procs = [p for p in _scheduler_processes() if p.is_running()]
    if not procs:
        return
    deadline = [time.monotonic() + timeout_s]

    def abandon(signum: int, frame: Any) -> None:
        logger.warning("abandoning the host tier save (%s again)", signal.Signals(signum).name)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGINT)
        deadline[0] = min(deadline[0], time.monotonic() + ABANDON_WAIT_S)

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in old:
            signal.signal(s, abandon)
    except ValueError:  # not the main thread: wait without a second-press handler
        old = {}
    try:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGUSR1)
        logger.info(
            "waiting for %d scheduler(s) to save the host tier (Ctrl+C abandons)", len(procs)
        )
        alive = procs
        while alive and time.monotonic() < deadline[0]:
            _, alive = psutil.wait_procs(alive, timeout=0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
