"""The host tier's file (spec §5.5): tables before slab bytes, a checksum on every section.

Layout (little endian)::

    magic "SGLHYBC\\0" | u32 format | u32 header length | header (JSON) | u64 xxh3(header)
    block table     (header "nodes" records of NODE + BLOCK_BYTES token bytes) | u64 xxh3
    snapshot table  (records of SNAP + their tail bytes)                        | u64 xxh3
    slab sums       (u64 xxh3 of each slab, in file slab order)                 | u64 xxh3
    slabs           (header "slabs" x slab_bytes)

The header holds the fingerprint (what must match for the bytes to mean the same thing; the
binding builds it), the geometry (slab, image and block sizes) and the counts, so the exact file
size is known from it: a truncated or extended file is refused before any table is parsed. The
tables are verified and parsed first, so a loader chooses what to keep before reading any slab,
then reads only those slabs, each checked against its sum as it lands. File slabs are numbered
in order: every block's slab, then each snapshot's image slabs and its tail slab.

Writing goes to ``PATH.tmp``: flush, fsync, ``os.replace`` onto ``PATH``, fsync of the directory.
A :class:`SaveControl` may abandon a save between slabs and before the rename; the temporary file
is removed and the previous file stays, as it does when the process is killed mid-save.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import xxhash

from ..index.keys import BLOCK_BYTES
from ..index.persist import HostExport, NodeRecord, SnapshotRecord

MAGIC = b"SGLHYBC\0"
FORMAT_VERSION = 2  # 2: a snapshot's flags byte (bit 0: a client's durable pin)
PREFIX = struct.Struct("<8sII")  # magic, format, header length
SUM = struct.Struct("<Q")
NODE = struct.Struct("<qQQ")  # parent, lookup hash, extra (then BLOCK_BYTES of tokens)
# anchor, F, kind, flags, tail bytes, hits, first, tail slab, C Z H
SNAP = struct.Struct("<qqBBIqqqddd")
DURABLE = 1  # SNAP flags: the snapshot was a client's durable pin (``index/durable.py``)
WRITE_CHUNK_SLABS = 64


class CacheFileError(Exception):
    """The file cannot be used; ``reason`` says why in words for the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SaveAbandoned(Exception):
    """The save was abandoned (a second stop signal); the previous file is untouched."""


@dataclass(slots=True)
class SaveControl:
    """Shared between a save and whoever may abandon it (a signal handler)."""

    abandoned: bool = False

    def abandon(self) -> None:
        self.abandoned = True

    def check(self) -> None:
        if self.abandoned:
            raise SaveAbandoned("the save was abandoned")


class Geometry(NamedTuple):
    slab_bytes: int
    image_bytes: int
    image_slabs: int
    block_bytes: int


class Written(NamedTuple):
    nbytes: int
    nodes: int
    snapshots: int
    slabs: int
    seconds: float


class CacheFile(NamedTuple):
    path: Path
    format: int
    fingerprint: dict[str, Any]
    geometry: Geometry
    records: HostExport  # slab ids are file slab numbers
    header: dict[str, Any]
    slab_sums: list[int]
    slabs_offset: int  # byte offset of file slab 0
    size: int


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _sum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


# ================================================================ tables
def _encode_nodes(nodes: list[NodeRecord]) -> bytes:
    out = bytearray()
    for r in nodes:
        out += NODE.pack(r.parent, r.lookup_hash & (2**64 - 1), r.extra & (2**64 - 1))
        out += r.tokens
    return bytes(out)


def _decode_nodes(data: bytes, count: int, first_slab: int) -> list[NodeRecord]:
    size = NODE.size + BLOCK_BYTES
    if len(data) != count * size:
        raise CacheFileError(
            f"block table holds {len(data)} bytes, {count} blocks need {count * size}"
        )
    out = []
    for i in range(count):
        off = i * size
        parent, h, extra = NODE.unpack_from(data, off)
        if not -1 <= parent < i:
            raise CacheFileError(f"block {i} names parent {parent}, not an earlier block")
        tokens = data[off + NODE.size : off + size]
        out.append(NodeRecord(parent, h, extra, tokens, first_slab + i))
    return out


def _encode_snapshots(snaps: list[SnapshotRecord], first: list[int], tails: list[int]) -> bytes:
    out = bytearray()
    for r, f, t in zip(snaps, first, tails, strict=True):
        flags = DURABLE if r.durable else 0
        out += SNAP.pack(
            r.anchor, r.frontier, r.kind, flags, len(r.tail), r.hits, f, t, r.cost, r.size, r.h
        )
        out += r.tail
    return bytes(out)


def _decode_snapshots(
    data: bytes, count: int, n_nodes: int, image_slabs: int, n_slabs: int
) -> list[SnapshotRecord]:
    out, off = [], 0
    for i in range(count):
        if off + SNAP.size > len(data):
            raise CacheFileError(f"snapshot table ends inside snapshot {i}")
        anchor, f, kind, flags, tail_len, hits, first, tail, c, z, h = SNAP.unpack_from(data, off)
        off += SNAP.size
        tail_bytes = data[off : off + tail_len]
        off += tail_len
        if len(tail_bytes) != tail_len or not -1 <= anchor < n_nodes:
            raise CacheFileError(f"snapshot {i}: anchor {anchor} or tail length {tail_len}")
        if first < 0 or first + image_slabs > n_slabs or tail >= n_slabs:
            raise CacheFileError(f"snapshot {i}: slabs outside the file")
        slabs = tuple(range(first, first + image_slabs))
        durable = bool(flags & DURABLE)
        out.append(SnapshotRecord(anchor, f, tail_bytes, kind, hits, slabs, tail, c, z, h, durable))
    if off != len(data):
        raise CacheFileError(f"snapshot table has {len(data) - off} bytes after its records")
    return out


# ================================================================ write
def write_cache_file(
    path: Path,
    *,
    fingerprint: dict[str, Any],
    geometry: Geometry,
    records: HostExport,
    read_slab: Callable[[int], memoryview],
    control: SaveControl | None = None,
    learned: dict[str, Any] | None = None,
) -> Written:
    """Write ``records`` (slab ids: the pool's, read through ``read_slab``) atomically.

    Raises :class:`SaveAbandoned` when ``control`` is abandoned, ``OSError`` on a write error; in
    both cases the temporary file is removed and ``path`` is untouched.
    """
    t0 = time.monotonic()
    control = control or SaveControl()
    control.check()  # a save not yet begun never begins (§5.5)
    # File slab order: blocks, then each snapshot's image slabs and tail slab.
    order = [r.slab for r in records.nodes]
    first, tails = [], []
    for r in records.snapshots:
        first.append(len(order))
        order.extend(r.image_slabs)
        if r.tail:
            tails.append(len(order))
            order.append(r.tail_slab)
        else:
            tails.append(-1)
    nodes = _encode_nodes(records.nodes)
    snaps = _encode_snapshots(records.snapshots, first, tails)
    header = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "geometry": geometry._asdict(),
        "nodes": len(records.nodes),
        "snapshots": len(records.snapshots),
        "slabs": len(order),
        "node_table_bytes": len(nodes),
        "snapshot_table_bytes": len(snaps),
        "saved_at": time.time(),
    }
    if learned is not None:  # the host's learned order (``index/hit_density.py``); optional
        header["learned"] = learned
    head = json.dumps(header, sort_keys=True).encode()
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)))
            f.write(head + SUM.pack(_sum(head)))
            f.write(nodes + SUM.pack(_sum(nodes)))
            f.write(snaps + SUM.pack(_sum(snaps)))
            sums = bytearray()
            for slab in order:
                sums += SUM.pack(_sum(read_slab(slab)))
                control.check()
            f.write(bytes(sums) + SUM.pack(_sum(bytes(sums))))
            for i, slab in enumerate(order):
                f.write(read_slab(slab))
                if i % WRITE_CHUNK_SLABS == 0:
                    control.check()  # stops before its next slab (§5.5)
            f.flush()
            os.fsync(f.fileno())
            nbytes = f.tell()
        control.check()  # ... or before the rename
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return Written(
        nbytes, len(records.nodes), len(records.snapshots), len(order), time.monotonic() - t0
    )


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ================================================================ read
def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CacheFileError(f"the file ends inside the {what}")
    return data


def _checked(f: BinaryIO, n: int, what: str) -> bytes:
    data = _read_exact(f, n, what)
    (want,) = SUM.unpack(_read_exact(f, SUM.size, f"{what} checksum"))
    if _sum(data) != want:
        raise CacheFileError(f"the {what} checksum does not match (damaged file)")
    return data


def read_cache_file(path: Path) -> CacheFile:
    """Header and tables, every checksum but the slabs' verified; slabs are read on demand."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as e:
        raise CacheFileError(f"{path} does not exist") from e
    except OSError as e:
        raise CacheFileError(f"{path} cannot be opened: {e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        magic, fmt, head_len = PREFIX.unpack(_read_exact(f, PREFIX.size, "file prefix"))
        if magic != MAGIC:
            raise CacheFileError(f"{path} is not an sglang-hybrid cache file")
        if fmt != FORMAT_VERSION:
            raise CacheFileError(
                f"format version {fmt}, this sglang-hybrid reads version {FORMAT_VERSION}"
            )
        head = _checked(f, head_len, "header")
        try:
            header = json.loads(head)
            geometry = Geometry(**header["geometry"])
            n_nodes, n_snaps, n_slabs = header["nodes"], header["snapshots"], header["slabs"]
            node_bytes, snap_bytes = header["node_table_bytes"], header["snapshot_table_bytes"]
            fingerprint = dict(header["fingerprint"])
        except (ValueError, KeyError, TypeError) as e:
            raise CacheFileError(f"the header is malformed ({e})") from e
        tables = node_bytes + snap_bytes + 8 * n_slabs + 3 * SUM.size
        slabs_offset = PREFIX.size + head_len + SUM.size + tables
        want = slabs_offset + n_slabs * geometry.slab_bytes
        if size != want:
            raise CacheFileError(
                f"the file holds {size} bytes, its tables say {want} (truncated or damaged)"
            )
        nodes = _decode_nodes(_checked(f, node_bytes, "block table"), n_nodes, 0)
        snaps = _decode_snapshots(
            _checked(f, snap_bytes, "snapshot table"),
            n_snaps,
            n_nodes,
            geometry.image_slabs,
            n_slabs,
        )
        sums_raw = _checked(f, 8 * n_slabs, "slab checksum table")
        sums = list(struct.unpack(f"<{n_slabs}Q", sums_raw))
    return CacheFile(
        path,
        fmt,
        fingerprint,
        geometry,
        HostExport(nodes, snaps),
        header,
        sums,
        slabs_offset,
        size,
    )


def read_slabs(
    cf: CacheFile,
    copies: Iterable[tuple[int, Any]],
    control: SaveControl | None = None,
) -> int:
    """Read file slab ``i`` into each writable buffer ``dst`` (``slab_bytes`` long), checking
    its sum; returns bytes read. A mismatch raises :class:`CacheFileError` (the caller discards
    whatever it adopted)."""
    sb = cf.geometry.slab_bytes
    done = 0
    with open(cf.path, "rb") as f:
        for i, dst in copies:
            if control is not None:
                control.check()
            f.seek(cf.slabs_offset + i * sb)
            view = memoryview(dst).cast("B")
            if f.readinto(view) != sb:
                raise CacheFileError(f"the file ends inside slab {i}")
            if _sum(view) != cf.slab_sums[i]:
                raise CacheFileError(f"slab {i}'s checksum does not match (damaged file)")
            done += sb
    return done


def verify_slabs(cf: CacheFile) -> list[int]:
    """File slabs whose bytes do not match their sums (every slab read once)."""
    sb = cf.geometry.slab_bytes
    bad = []
    with open(cf.path, "rb") as f:
        f.seek(cf.slabs_offset)
        for i, want in enumerate(cf.slab_sums):
            data = f.read(sb)
            if len(data) != sb or _sum(data) != want:
                bad.append(i)
    return bad


def fingerprint_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field: saved -> current`` for every field that differs (missing counts as differing)."""
    out = []
    for k in sorted(set(saved) | set(current)):
        if saved.get(k) != current.get(k):
            out.append(f"{k}: {saved.get(k, '(absent)')!r} -> {current.get(k, '(absent)')!r}")
    return out
