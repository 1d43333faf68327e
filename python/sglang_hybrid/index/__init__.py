"""The model-agnostic index of the hybrid prefix cache: it decides, it never moves bytes.

Pure Python (no torch, no sglang). One concept per module, named as in the spec:
``keys`` (§5.1), ``node`` / ``tree`` (§5.2), ``snapshot`` (§5.3), ``host_slabs`` (§5.4),
``match`` (§6.1), ``admission`` (§6.2-6.3), ``taps`` (§7.1) with ``split_rule`` (issue #36),
``device_lru`` (§9.1), ``device_slots`` (§9.2), ``valuation`` / ``host_eviction`` /
``supersession`` / ``links`` (§9.3), ``path_counts`` (§5.2), ``invariants`` (§10), ``cost`` /
``presets`` (§6.2, §11.4), ``config`` (§14.2) and the facade ``prefix_index`` with its parts
``residency`` and ``transfers`` and its function modules ``publication`` (§7.4, §9.2-9.3),
``eviction`` (§9.1, §9.4), ``persist``.

Its modules run compiled by mypyc when a current build exists (``native``: the folder of the
build joins ``__path__`` ahead of the sources; ``native.status()`` says which runs; the build is
``tools/build_index.py``, docs/index.md "Compiled").
"""

from . import native as _native

__path__, NATIVE = _native.search_path(__path__)

from .admission import Candidate, Quote, Readiness, quote
from .config import CacheConfig, resolve_config
from .cost import CostModel
from .host_slabs import ConfigError, HostSlabPool
from .invariants import IntegrityError, check_integrity
from .keys import BLOCK_TOKENS, PromptKey, pack_tokens
from .lane import Lane
from .match import Match
from .node import BlockNode, Residency
from .prefix_index import PrefixIndex
from .snapshot import Snapshot, SnapshotKind
from .split_rule import SplitRule
from .stats import IndexStats
from .taps import HintKind, Tap, TapHint, TapPlanner, TapSource

__all__ = [
    "BLOCK_TOKENS",
    "BlockNode",
    "CacheConfig",
    "Candidate",
    "ConfigError",
    "CostModel",
    "HintKind",
    "HostSlabPool",
    "IndexStats",
    "IntegrityError",
    "Lane",
    "Match",
    "PrefixIndex",
    "PromptKey",
    "Quote",
    "Readiness",
    "Residency",
    "Snapshot",
    "SnapshotKind",
    "SplitRule",
    "Tap",
    "TapHint",
    "TapPlanner",
    "TapSource",
    "check_integrity",
    "pack_tokens",
    "quote",
    "resolve_config",
]
