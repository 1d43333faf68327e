"""Command-line flags of the ``hybrid`` backend and where their values live.

SGLang has no argparse hook, so the plugin adds an AFTER hook on ``ServerArgs.add_cli_args`` (the
flags, listed by ``python -m sglang.launch_server --help``) and on ``ServerArgs.from_cli_args``
(their values, stored as ``server_args._hybrid_options``, an underscore attribute that survives the
pickle into the scheduler process). ``--radix-cache`` is a declared alias whose destination is
SGLang's own ``radix_cache_backend`` field, so it does not depend on argparse abbreviations.

Unset values stay None and resolve from the spec's defaults (§14.2) once the scheduler knows the
concurrency and chunk size (:func:`resolve`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from ..index import CacheConfig, ConfigError, CostModel, resolve_config
from ..index.config import (
    DEFAULT_HOST_CACHE_MIB,
    DEFAULT_HOST_EXCLUSIVE,
    FLAG_HOST,
    FLAG_HOST_EXCLUSIVE,
    FLAG_HOST_ORDER,
    FLAG_LADDER,
    FLAG_MIN_GAP,
    FLAG_SLOTS,
    FLAG_TAPS,
    HOST_ORDER_CHOICES,
)
from ..store.copy_queue import CopyMode

BACKEND = "hybrid"
ATTR = "_hybrid_options"
FLAG_TAIL = "--hybrid-tail-tap"
FLAG_COALESCE = "--hybrid-coalesce"
FLAG_CHECK_RANKS = "--hybrid-check-ranks"
FLAG_TAP_MODE = "--hybrid-tap-mode"
FLAG_HOST_COPY = "--hybrid-host-copy"
FLAG_HOST_WRITE = "--hybrid-host-write-mib"
FLAG_CACHE_FILE = "--hybrid-cache-file"
FLAG_L3 = "--hybrid-l3"
FLAG_SPLIT = "--hybrid-split-threshold"
TapMode = Literal["split", "zero-split", "auto"]
TailTap = Literal["exact", "flexible"]


@dataclass(slots=True)
class HybridOptions:
    host_cache_mib: int | None = None
    device_snapshot_slots: int | None = None
    taps_per_request: int | None = None
    tap_ladder: int | None = None
    tap_min_gap: int | None = None
    tail_tap: TailTap = "exact"
    coalesce: bool = True
    check_ranks: bool = False
    tap_mode: TapMode = "auto"
    host_copy: CopyMode = "async"
    host_write_mib: int = 512
    cache_file: str | None = None  # --hybrid-cache-file: the host tier across restarts (§5.5)
    l3: str | None = None  # --hybrid-l3 URL: a third tier shared by a fleet (``l3_tier.py``)
    split_threshold: float = 1.0  # --hybrid-split-threshold (index/split_rule.py)
    host_order: str = "duel"  # --hybrid-host-order (index/hit_density.py)
    host_exclusive: bool | None = None  # --hybrid-host-exclusive (index/demotion.py); None: default
    # The prefill cost the split rule prices a pass and its tokens at; None: the cache's own
    # (``CostModel()``'s planning values). Not a flag: the replay sets its clock's preset.
    split_cost: CostModel | None = None
    # What a state image is charged in the index (host slabs, GDSF's size, admission's bytes),
    # when more than its own bytes; None: its own. Not a flag: the replay charges its modelled
    # geometry's image, since a tiny model's image takes 3 of its host slabs where a 27B's takes
    # 37 (``replay/caches.py``). The copies move the real bytes; the rest of the slabs is unused.
    image_charge_bytes: int | None = None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sglang-hybrid prefix cache",
        "A prefix cache for hybrid (recurrent + attention) models: 64-token KV blocks, sparse "
        "state snapshots, one host slab pool. Select it with --radix-cache hybrid.",
    )
    g.add_argument(
        "--radix-cache",
        dest="radix_cache_backend",
        default=argparse.SUPPRESS,
        metavar="NAME",
        help="Alias of --radix-cache-backend; 'hybrid' selects sglang-hybrid's cache.",
    )
    g.add_argument(
        FLAG_HOST,
        type=int,
        default=None,
        metavar="MIB",
        help="Host tier budget in MiB: one pinned slab pool shared by KV blocks and state "
        "snapshots (default 8192; 0 = device only).",
    )
    g.add_argument(
        FLAG_SLOTS,
        type=int,
        default=None,
        metavar="N",
        help="Device snapshot slots: extra MambaPool slots holding cached states (default: "
        "max running requests + 1 with a host tier, + 2 without).",
    )
    g.add_argument(
        FLAG_TAPS,
        type=int,
        default=None,
        metavar="N",
        help="Most new state snapshots (taps) one prefill may take (default 8 with a host "
        "tier, 2 without).",
    )
    g.add_argument(
        FLAG_LADDER,
        type=int,
        default=None,
        metavar="TOKENS",
        help="Base G of the tap ladder n - G*2^k that serves edits deep in history "
        "(default max(4096, 2 * chunk)).",
    )
    g.add_argument(
        FLAG_MIN_GAP,
        type=int,
        default=None,
        metavar="TOKENS",
        help="Minimum distance between ladder taps and other snapshots (default max(1024, chunk)).",
    )
    g.add_argument(
        FLAG_TAIL,
        choices=("exact", "flexible"),
        default="exact",
        help="Where the prompt-tail tap (floor64(n-1), for retries and repeats) is taken: "
        "'exact' ends a prefill pass there (SGLang's model runner cannot snapshot inside a "
        "pass; costs one short pass when no template opener absorbs it), 'flexible' only at a "
        "chunk boundary that reaches it (default exact).",
    )
    g.add_argument(
        FLAG_COALESCE,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="In-flight prefix coalescing: a waiting request sharing a new prefix with an earlier "
        "one waits for that one's snapshot at their divergence instead of prefilling the prefix "
        "again (default on; --no-hybrid-coalesce turns it off).",
    )
    g.add_argument(
        FLAG_TAP_MODE,
        choices=("split", "zero-split", "auto"),
        default="auto",
        help="How a tap inside a prefill pass is captured: 'split' ends the pass there; "
        "'zero-split' has the model worker copy the state inside the pass (the CPU workers at "
        "any position; SGLang's GPU worker through its own prefill tracking, at each "
        "request's 64-token grid with the FlashInfer GDN prefill, anywhere with the Triton one, "
        "not under full prefill CUDA graphs); 'auto' takes zero-split where the worker's "
        "in-pass states are exact and the path was verified on this hardware, split otherwise, "
        "and logs which and why (default auto). Taps the worker cannot capture split where "
        "the split pays (see --hybrid-split-threshold).",
    )
    g.add_argument(
        FLAG_SPLIT,
        type=_non_negative_float,
        default=1.0,
        metavar="RATIO",
        help="An exact tap the model worker cannot capture inside a prefill pass ends the pass "
        "there only when the prefill it is expected to save later requests (how often taps of "
        "its kind were resumed from, times the tokens it saves over the state they would find "
        "instead) exceeds RATIO times the cost of one more pass; declined splits are counted "
        "as the split_declined skip (default 1.0; 0 splits for every exact tap).",
    )
    g.add_argument(
        FLAG_CHECK_RANKS,
        action="store_true",
        help="Compare a digest of every pass's cache decisions (batch, taps, holds, evictions) "
        "across the TP group and stop the server with an error on the first divergence (one "
        "small all-reduce per scheduler iteration; for validating a deployment).",
    )
    g.add_argument(
        FLAG_HOST_ORDER,
        choices=HOST_ORDER_CHOICES,
        default="duel",
        help="Which snapshot the host tier gives up when full (after dead KV and superseded "
        "snapshots): 'gdsf' the spec's Greedy-Dual-Size-Frequency order; 'learned' the order "
        "learned from the traffic's reuse ages (hit density, snapshots only one request reached "
        "first); 'duel' (default) lets the two compete by their victims' early returns and "
        "follows the one with fewer. GDSF decides until 256 hits and evictions were seen. "
        "Decisions count requests, never time, so every TP rank takes the same victim.",
    )
    g.add_argument(
        FLAG_HOST_EXCLUSIVE,
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Hold each cached KV block on one tier: the host gives up its copies of blocks the "
        "device holds first, and blocks the device will evict next are written to the host "
        "ahead of their eviction, so the two tiers cache their sum, not the host's size. "
        f"Default {'on' if DEFAULT_HOST_EXCLUSIVE else 'off'} with a host tier.",
    )
    g.add_argument(
        FLAG_HOST_COPY,
        choices=("async", "inline"),
        default="async",
        help="How host-tier copies run: 'async' issues them on a copy stream (a worker thread on "
        "the CPU) and the scheduler only polls; a restored request waits out of admission until "
        "its copies land. 'inline' copies on the scheduler thread (reproducible timing, for "
        "benchmarks and debugging). Default async.",
    )
    g.add_argument(
        FLAG_HOST_WRITE,
        type=_non_negative,
        default=512,
        metavar="MIB",
        help="Write-through bytes in flight to the host tier at most (default 512); beyond it "
        "writes wait unissued, and are dropped under device memory pressure.",
    )

    g.add_argument(
        FLAG_CACHE_FILE,
        default=None,
        metavar="PATH",
        help="Keep the host tier across restarts: saved to PATH at an orderly stop (SIGTERM, "
        "Ctrl+C; a second Ctrl+C abandons the save and keeps the previous file), loaded at "
        "start when the model, dtypes, page size, TP layout and versions match. Needs a host "
        "tier (--hybrid-host-cache-mib > 0). Inspect a file with 'sglang-hybrid cache inspect "
        "PATH'.",
    )
    # --hybrid-l3 (issue #39): its URL is checked when the cache is built (``l3_tier.setup``).
    g.add_argument(
        FLAG_L3,
        default=None,
        metavar="URL",
        help="A third tier behind the host tier, shared by every server pointed at it: "
        "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata (Mooncake Store; "
        "segment=MIB gives it this server's memory too) or file://DIR (a directory, one "
        "machine). Blocks and state snapshots written to the host tier go there too; a prompt "
        "that misses device and host fetches its deepest snapshot from it. Needs a host tier. "
        "See docs/l3.md.",
    )


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value}: give 0 or more MiB")
    return n


def _non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value}: give a number >= 0") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: give a finite number >= 0")
    return x


def options_from_namespace(args: argparse.Namespace) -> HybridOptions:
    return HybridOptions(
        host_cache_mib=args.hybrid_host_cache_mib,
        device_snapshot_slots=args.hybrid_device_snapshot_slots,
        taps_per_request=args.hybrid_taps_per_request,
        tap_ladder=args.hybrid_tap_ladder,
        tap_min_gap=args.hybrid_tap_min_gap,
        tail_tap=args.hybrid_tail_tap,
        coalesce=args.hybrid_coalesce,
        check_ranks=args.hybrid_check_ranks,
        tap_mode=args.hybrid_tap_mode,
        host_copy=args.hybrid_host_copy,
        host_write_mib=args.hybrid_host_write_mib,
        cache_file=getattr(args, "hybrid_cache_file", None),
        l3=getattr(args, "hybrid_l3", None),
        split_threshold=getattr(args, "hybrid_split_threshold", 1.0),
        host_order=getattr(args, "hybrid_host_order", "duel"),
        host_exclusive=getattr(args, "hybrid_host_exclusive", None),
    )


def is_selected(server_args: Any) -> bool:
    """``--radix-cache hybrid`` was chosen (SGLang's own ``radix_cache_backend`` field)."""
    return getattr(server_args, "radix_cache_backend", None) == BACKEND


def get_options(server_args: Any) -> HybridOptions:
    """The options stored on a ServerArgs (defaults when it was built without our CLI)."""
    opts = getattr(server_args, ATTR, None)
    if opts is None:
        return HybridOptions()
    if isinstance(opts, dict):  # tolerate a plain dict set by a caller
        return HybridOptions(**opts)
    return opts


def resolve(
    opts: HybridOptions,
    *,
    concurrency: int,
    chunk_tokens: int,
    state_slots: int | None = None,
) -> CacheConfig:
    """Effective values (§14.2), with one decision beyond the spec for SGLang.

    SGLang sizes its MambaPool with about three slots per running request for its own cache's
    states. Left to its default, the hybrid cache takes every slot beyond the running requests
    (and one for an admission in flight) as snapshot slots, at least the spec's C+1 / C+2:
    those slots exist anyway, and more resident snapshots only add reuse. ``state_slots`` is the
    MambaPool size when known.
    """
    config = _resolve(opts, concurrency=concurrency, chunk_tokens=chunk_tokens)
    if opts.device_snapshot_slots is None and state_slots is not None:
        spare = state_slots - concurrency - 1
        if spare > config.device_snapshot_slots:
            config = _resolve(
                replace(opts, device_snapshot_slots=spare),
                concurrency=concurrency,
                chunk_tokens=chunk_tokens,
            )
    return config


def _resolve(opts: HybridOptions, *, concurrency: int, chunk_tokens: int) -> CacheConfig:
    return resolve_config(
        concurrency=concurrency,
        chunk_tokens=chunk_tokens,
        host_cache_mib=opts.host_cache_mib,
        device_snapshot_slots=opts.device_snapshot_slots,
        taps_per_request=opts.taps_per_request,
        tap_ladder_tokens=opts.tap_ladder,
        tap_min_gap_tokens=opts.tap_min_gap,
        host_order=opts.host_order,
        host_exclusive=opts.host_exclusive,
    )


# ---------------------------------------------------------------- checks at the command line
def flag_of(field_name: str) -> str:
    """A :class:`HybridOptions` field's flag (``host_cache_mib``: --hybrid-host-cache-mib)."""
    return "--hybrid-" + field_name.replace("_", "-")


NOT_FLAGS = frozenset({"split_cost", "image_charge_bytes"})  # HybridOptions fields no flag sets


def explicit_flags(opts: HybridOptions) -> list[str]:
    """The cache flags whose values differ from their defaults (as the operator would type them)."""
    default = HybridOptions()
    out = []
    for f in fields(HybridOptions):
        if f.name in NOT_FLAGS:
            continue
        value = getattr(opts, f.name)
        if value != getattr(default, f.name):
            flag = flag_of(f.name)
            out.append(flag.replace("--", "--no-", 1) if value is False else flag)
    return out


def check_options(opts: HybridOptions) -> None:
    """The option values alone, before anything is loaded: the bounds ``resolve_config`` keeps
    (the concurrency and chunk it also needs are placeholders here) and a host budget beyond
    this machine's memory (its allocation would fail after the model loaded). The cache file's
    place is ``persistence.check_cache_file``'s."""
    _resolve(opts, concurrency=1, chunk_tokens=1)
    mib = DEFAULT_HOST_CACHE_MIB if opts.host_cache_mib is None else opts.host_cache_mib
    if mib == 0 and opts.host_order != "duel":
        raise ConfigError(
            f"{FLAG_HOST_ORDER} {opts.host_order}: {FLAG_HOST} 0 turns the host tier off, and "
            f"the order chooses among its snapshots; drop one of the two"
        )
    if mib == 0 and opts.host_exclusive:
        raise ConfigError(
            f"{FLAG_HOST_EXCLUSIVE}: {FLAG_HOST} 0 turns the host tier off, and exclusivity "
            f"shares blocks between it and the device; drop one of the two"
        )
    total = _physical_memory()
    if total and mib << 20 > total:
        default = " (its default)" if opts.host_cache_mib is None else ""
        raise ConfigError(
            f"{FLAG_HOST} {mib}{default}: this machine has {total >> 20} MiB of memory; give "
            f"the host tier less (0 turns it off)"
        )


def _physical_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # an exotic platform: no bound
        return 0
