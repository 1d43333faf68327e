"""Block keys: 64-token blocks, chained lookup hashes and exact identity (spec §5.1).

A prompt is held as packed int32 token bytes, so a block's exact identity is a 256-byte string
compared with one C-level ``==`` and no per-token Python work. The lookup hash of block ``b``
chains the hash of block ``b - 1``; it only *selects* a child in the tree. A hit always compares
tokens and the extra (media) key exactly, so a hash collision can cost a probe but never a false
hit (spec §5.1, tested with a constant hash).

We chain through xxh3's seed (``xxh3_64(tokens || extra, seed=lookup_hash(b-1))``): the same
dependency on the parent as the spec's concatenation, without building a new buffer per block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations only (the package supports 3.10)

try:
    import xxhash
except ImportError:  # e.g. a bare GPU box with only torch: stay importable, hash with blake2b
    xxhash = None  # type: ignore[assignment]  # the optional-import idiom; xxh3_chain checks it

BLOCK_TOKENS = 64
TOKEN_BYTES = 4
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_BYTES
ROOT_HASH = 0x9E3779B97F4A7C15  # lookup_hash(-1): any fixed seed

HashFn = Callable[[bytes, int], int]


def xxh3_chain(data: bytes, seed: int) -> int:
    if xxhash is None:
        h = hashlib.blake2b(data, digest_size=8, key=seed.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little")
    return xxhash.xxh3_64_intdigest(data, seed)


def pack_tokens(ids: Iterable[int]) -> bytes:
    """Token ids as the packed int32 bytes every key uses; ``ValueError`` for an id outside
    int32 (narrowing it would alias another token's key)."""
    try:
        return array("i", ids).tobytes()
    except OverflowError:
        bad = next(t for t in ids if not -(2**31) <= t < 2**31)
        raise ValueError(f"token id {bad} does not fit the cache's int32 keys") from None


def media_key(items: Sequence[tuple[bytes, int, int, int, int]]) -> int:
    """Extra key of a block from the Vision items overlapping it and every earlier item (§5.1).

    Each item is ``(content_digest, modality, grid, span_begin, span_len)``; earlier items are
    included because they shift later rotary positions.
    """
    data = b"".join(
        digest + array("q", (modality, grid, begin, length)).tobytes()
        for digest, modality, grid, begin, length in items
    )
    return xxh3_chain(data, 0) or 1  # 0 means "no media"


class KeyOptions(TypedDict, total=False):
    """The keyword arguments of :class:`PromptKey` besides its token bytes."""

    extras: Mapping[int, int] | None
    vision_spans: Sequence[tuple[int, int]]
    hash_fn: HashFn
    namespace: int


class PromptKey:
    """The exact token sequence of a prompt plus per-block extra keys and Vision spans.

    Hashes are computed lazily and kept, so a request matched several times (priority, admission,
    each chunk) pays for hashing once; :meth:`extend` keeps them when tokens are appended.
    """

    __slots__ = ("_extra_at", "_hash_fn", "data", "hashes", "n", "namespace", "vision_spans")

    def __init__(
        self,
        data: bytes,
        *,
        extras: Mapping[int, int] | None = None,
        vision_spans: Sequence[tuple[int, int]] = (),
        hash_fn: HashFn | None = None,
        namespace: int = 0,
    ) -> None:
        if len(data) % TOKEN_BYTES:
            raise ValueError(f"token bytes must be a multiple of {TOKEN_BYTES}, got {len(data)}")
        self.data = data
        self.n = len(data) // TOKEN_BYTES
        self._extra_at = dict(extras) if extras else None
        self.vision_spans = tuple(sorted(vision_spans))  # half-open [begin, end) token spans
        # None: the module's ``xxh3_chain``, looked up now (a test may replace it to collide).
        self._hash_fn: HashFn = xxh3_chain if hash_fn is None else hash_fn
        # A namespace (SGLang's extra_key / cache_salt, e.g. a LoRA adapter) joins every block's
        # extra key, so prompts in different namespaces never share a block.
        self.namespace = namespace
        self.hashes: list[int] = []

    @classmethod
    def from_ids(cls, ids: Iterable[int], **kw: Unpack[KeyOptions]) -> PromptKey:
        return cls(pack_tokens(ids), **kw)

    @property
    def has_extras(self) -> bool:
        return bool(self._extra_at) or bool(self.namespace)

    @property
    def full_blocks(self) -> int:
        return self.n // BLOCK_TOKENS

    def extra(self, b: int) -> int:
        media = self._extra_at.get(b, 0) if self._extra_at else 0
        return media ^ self.namespace

    def block(self, b: int) -> bytes:
        return self.data[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]

    def tokens(self, begin: int, end: int) -> bytes:
        return self.data[begin * TOKEN_BYTES : end * TOKEN_BYTES]

    def hash(self, b: int) -> int:
        if b >= len(self.hashes):
            self.ensure_hashes(b + 1)
        return self.hashes[b]

    def ensure_hashes(self, blocks: int) -> list[int]:
        """Hashes of blocks [0, blocks) computed (one tight loop); returns the list."""
        hashes = self.hashes
        if blocks <= len(hashes):
            return hashes
        if blocks > self.full_blocks:
            raise IndexError(f"block {blocks - 1} is not full (prompt has {self.n} tokens)")
        h = hashes[-1] if hashes else ROOT_HASH
        fn, data = self._hash_fn, self.data
        extra = self.extra if self.has_extras else None
        for i in range(len(hashes), blocks):
            blk = data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]
            if extra is not None and (x := extra(i)):
                blk += x.to_bytes(8, "little")
            h = fn(blk, h)
            hashes.append(h)
        return hashes

    def prefix(self, n: int) -> PromptKey:
        """The key of the first ``n`` tokens, keeping the hashes of its full blocks."""
        out = PromptKey(
            self.data[: n * TOKEN_BYTES],
            extras=self._extra_at,
            vision_spans=self.vision_spans,
            hash_fn=self._hash_fn,
            namespace=self.namespace,
        )
        out.hashes = self.hashes[: n // BLOCK_TOKENS]
        return out

    def extend(self, more: bytes) -> PromptKey:
        """A key for ``self + more`` that keeps the hashes already computed."""
        out = PromptKey(
            self.data + more,
            extras=self._extra_at,
            vision_spans=self.vision_spans,
            hash_fn=self._hash_fn,
            namespace=self.namespace,
        )
        out.hashes = self.hashes[:]  # full blocks of self stay full blocks of out
        return out

    def in_vision_span(self, p: int) -> tuple[int, int] | None:
        """The span strictly containing position ``p`` (a frontier after ``p`` tokens), if any."""
        for begin, end in self.vision_spans:
            if begin < p < end:
                return begin, end
            if begin >= p:
                break
        return None
