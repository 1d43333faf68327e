"""Per-request records the backend keeps beside SGLang's ``Req``.

``MatchHandle`` is what ``match_prefix`` returns as the node handle (SGLang stores it in
``req.last_node`` and passes it back to ``lock`` and ``path_device_indices``): the matched path up
to the chosen source, the source snapshot, and the lane a lock opened. ``ReqState`` hangs on the
``Req`` as ``req.hybrid`` and keeps what spans a request's life: its prompt key (hashes computed
once, extended as tokens arrive) and its planned taps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..index import BLOCK_TOKENS, Lane, Match, PromptKey, Snapshot, SnapshotKind
from ..index.keys import xxh3_chain
from .mirror import PassSlots, RowMirror

ATTR = "hybrid"


class InPassTap(NamedTuple):
    """A tap captured as part of the next pass: the snapshot slot reserved for it before the
    forward, published at the pass's checkpoint. Inside the pass the model worker captures it
    (``--hybrid-tap-mode zero-split``); at the pass's end, under overlap scheduling, the cache
    copies the live state right after the pass is launched (``Publisher.capture_pass_ends``)."""

    position: int
    slot: int  # index snapshot slot (staging)
    kind: SnapshotKind
    demand: int
    covers: tuple[int, ...] = ()  # a pass-end tap: the planned taps it realises (taken with it)
    origin: int = 0  # why it was planned (``TapSource``; 0: not planned)


@dataclass(slots=True, eq=False)
class MatchHandle:
    match: Match | None  # None: the root handle
    source: Snapshot | None  # the snapshot the request resumes from (None: the root)
    prefix_len: int
    state: ReqState | None = None
    lane: Lane | None = None  # opened by the first lock(), closed by the last unlock()
    locks: int = 0
    tail_copy: torch.Tensor | None = None  # the lane's private copy of the source's tail KV
    state_slot: int | None = None  # the request's MambaPool slot id, read once (``slot_of``)
    # ... copied to the host when its first batch was built (``mirror.feed_batch``)
    state_copy: tuple[PassSlots, int] | None = None
    rows: RowMirror = field(default_factory=RowMirror)  # its req_to_token row on the host
    inpass: list[InPassTap] = field(default_factory=list)  # reserved for the pass in flight
    children: dict = field(default_factory=dict)  # SGLang's dfs_weight_order walks .children

    @property
    def blocks(self) -> int:
        return self.prefix_len // BLOCK_TOKENS

    def slot_of(self, req: Any) -> int:
        """The request's MambaPool slot id on the host, from the copy made when its first batch
        was built (``mirror.py``; no wait once that pass's result was processed). Read once per
        admission (a retracted request is matched anew, with a new handle, and may get another
        slot). Before that copy exists (never on the per-pass paths, which use the device value
        ``req.kv.mamba_pool_idx``) it reads the device value, a host sync."""
        if self.state_slot is None:
            if self.state_copy is not None:
                copy, i = self.state_copy
                self.state_slot = int(copy.host()[i])
            else:
                self.state_slot = int(req.kv.mamba_pool_idx)
        return self.state_slot


@dataclass(slots=True, eq=False)
class ReqState:
    key: PromptKey
    n_prompt: int
    enabled: bool
    cuts: list[int] = field(default_factory=list)  # exact taps: a prefill pass ends here
    flexible: list[int] = field(default_factory=list)  # taken where a pass ends at or after
    boundary: set[int] = field(default_factory=set)  # positions published as Boundary
    demand: dict[int, int] = field(default_factory=dict)  # position -> requests waiting for it
    origin: dict[int, int] = field(default_factory=dict)  # position -> its ``TapSource`` value
    taken: set[int] = field(default_factory=set)
    capture_grid: int = 0  # zero-split: taps on the pass's grid of this many tokens (0: split)
    best_frontier: int = 0  # the deepest state any tier held at the last match
    sources_unpinned: bool = False
    tail_copied: int = 0  # tokens of the source's tail copied into the request's own pages
    restored_bytes: int = 0
    restored_tokens: int = 0  # prefix tokens whose KV came back from the host tier
    restore: Any = None  # the host tier's PendingRestore while one is in flight or unadmitted
    no_host: bool = False  # a restore of this request failed: resume from the device only
    prefetch_room: int | None = None  # spare device room at the last prefetch attempt
    prefetch_copied: int = 0
    waits: bool | None = None  # whether it may wait on another's prefix (``waiting_key``)
    # Speculative decode rounds of this request launched, and whose results were processed:
    # under overlap scheduling a round may run before the previous one's result is seen.
    rounds_launched: int = 0
    rounds_processed: int = 0

    def next_cut(self, after: int) -> int | None:
        """The first exact tap past ``after`` that must end the pass starting there: all of
        them when splitting; with in-pass capture, those off the pass's grid."""
        g = self.capture_grid
        for p in self.cuts:
            if p > after and not (g and (p - after) % g == 0):
                return p
        return None

    def due_at(self, end: int, excluded: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The taps a pass ending at ``end`` realises with one snapshot there: passes end on the
        64-token grid except at exact cuts, so a frontier inside a block must be a cut (its
        snapshot gets a tail, §5.3); every planned tap at or below ``end`` not taken yet (nor
        ``excluded``: captured inside the same pass) is realised there."""
        if end in self.taken or (end % BLOCK_TOKENS and end not in self.cuts):
            return []
        return [
            p
            for p in (*self.cuts, *self.flexible)
            if p <= end and p not in self.taken and p not in excluded
        ]

    def capturable(self, start: int, end: int) -> list[int]:
        """Taps due strictly inside the pass [start, end) that the worker can capture there:
        exact taps on the pass's grid, and flexible taps unless the pass ends on the block grid
        before the prompt's end (then they are taken at that chunk end, as when splitting)."""
        g = self.capture_grid
        if not g:
            return []
        flexible = () if end % BLOCK_TOKENS == 0 and end < self.n_prompt else self.flexible
        return sorted(
            p
            for p in {*self.cuts, *flexible}
            if start < p < end and (p - start) % g == 0 and p not in self.taken
        )


def token_bytes(tokens: Any, begin: int = 0, end: int | None = None) -> bytes:
    """Packed int32 bytes of ``tokens[begin:end]`` (an ``array('q')``, list or tensor).

    SGLang keeps token ids in ``array('q')``: read them in place (no slice copy) and narrow. An
    id outside int32 raises ``ValueError``, as ``index.keys.pack_tokens`` does: narrowing it would
    alias another token's key.
    """
    if isinstance(tokens, torch.Tensor):
        arr = tokens[begin:end].to(torch.int64).numpy()
    elif getattr(tokens, "typecode", None) == "q":
        end = len(tokens) if end is None else end
        arr = np.frombuffer(tokens, dtype=np.int64, count=end - begin, offset=8 * begin)
    else:
        arr = np.asarray(tokens[begin:end], dtype=np.int64)
    if arr.size:
        hi, lo = int(arr.max()), int(arr.min())
        if hi > _INT32_MAX or lo < -_INT32_MAX - 1:
            bad = hi if hi > _INT32_MAX else lo
            raise ValueError(f"token id {bad} does not fit the cache's int32 keys")
    return arr.astype(np.int32).tobytes()


_INT32_MAX = 2**31 - 1


def namespace_of(radix_key: Any) -> int:
    """SGLang's key namespaces (``extra_key``, e.g. a LoRA adapter, and ``cache_salt``)."""
    extra, salt = getattr(radix_key, "extra_key", None), getattr(radix_key, "cache_salt", None)
    if not extra and not salt:
        return 0
    return xxh3_chain(f"{extra}\0{salt}".encode(), 0) | 1


def key_for(state: ReqState | None, tokens: Any, n: int, namespace: int = 0) -> PromptKey:
    """A key for ``tokens[:n]`` that reuses the request's key and its hashes.

    SGLang's fill ids only grow (prompt, then outputs), so a longer key extends the kept one and
    a shorter one (a capped match) is its prefix.
    """
    if state is None:
        return PromptKey(token_bytes(tokens, 0, n), namespace=namespace)
    key = state.key
    if key.n == n:
        return key
    if n < key.n:
        return key.prefix(n)
    state.key = key.extend(token_bytes(tokens, key.n, n))
    return state.key


def waiting_key(req: Any) -> PromptKey | None:
    """A waiting request's prompt key, kept on the request for its match (coalescing, and the
    fill holds of ``load_back.py``); None for requests that never wait on another's prefix:
    images, a namespace (LoRA, cache salt), or not inserting into the cache. The decision is
    kept too: it reads attributes fixed at a request's creation, and the admission window asks
    it of the same requests every pass."""
    state: ReqState | None = getattr(req, ATTR, None)
    if state is None or state.waits is None:
        waits = not (
            getattr(req, "multimodal_inputs", None) is not None
            or getattr(req, "lora_id", None)
            or getattr(req, "extra_key", None)
            or getattr(req, "cache_salt", None)
            or getattr(req, "skip_radix_cache_insert", False)
        )
        if state is None:
            if not waits:
                return None
            n = len(req.origin_input_ids)
            state = ReqState(
                key=PromptKey(token_bytes(req.origin_input_ids, 0, n)), n_prompt=n, enabled=True
            )
            setattr(req, ATTR, state)
        state.waits = waits
    if not state.waits or state.key.namespace:
        return None
    n = len(req.origin_input_ids)
    key = state.key
    return key if key.n == n else key.prefix(min(n, key.n))
