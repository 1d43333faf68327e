"""The host tier file (spec §5.5): round trip, and every damage case loads nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_hybrid.index.keys import BLOCK_BYTES
from sglang_hybrid.index.persist import HostExport, NodeRecord, SnapshotRecord
from sglang_hybrid.store.cache_file import (
    FORMAT_VERSION,
    PREFIX,
    SUM,
    CacheFileError,
    Geometry,
    SaveAbandoned,
    SaveControl,
    fingerprint_mismatch,
    read_cache_file,
    read_slabs,
    tmp_path,
    verify_slabs,
    write_cache_file,
)
from sglang_hybrid.store.cache_inspect import inspect

GEO = Geometry(slab_bytes=512, image_bytes=1000, image_slabs=2, block_bytes=500)
FP = {"model_path": "/m", "tp_rank": 0, "tp_size": 1, "page_size": 1, "sglang": "0.5.23"}


def records(seed: int = 0) -> tuple[HostExport, dict[int, bytes]]:
    """Three blocks in a chain and a fork; two snapshots (one with a tail). Pool slab ids are
    scattered, as a real pool's are."""
    rng = random.Random(seed)
    pool = iter(rng.sample(range(100, 1000), 20))
    nodes = [
        NodeRecord(p, rng.getrandbits(64), x, rng.randbytes(BLOCK_BYTES), next(pool))
        for p, x in ((-1, 0), (0, 0), (0, 2**64 - 5))
    ]
    snaps = [
        SnapshotRecord(1, 128, b"", 0, 3, (next(pool), next(pool)), -1, 1.5, 2000.0, 0.7),
        SnapshotRecord(
            2,
            130,
            rng.randbytes(8),
            1,
            0,
            (next(pool), next(pool)),
            next(pool),
            0.1,
            9.0,
            0.2,
            durable=True,  # a client's pin (``index/durable.py``)
        ),
    ]
    slabs = (
        [r.slab for r in nodes] + [s for r in snaps for s in r.image_slabs] + [snaps[1].tail_slab]
    )
    data = {s: rng.randbytes(GEO.slab_bytes) for s in slabs}
    return HostExport(nodes, snaps), data


def save(path: Path, seed: int = 0, control: SaveControl | None = None, fp: dict | None = None):
    rec, data = records(seed)
    w = write_cache_file(
        path,
        fingerprint=fp or FP,
        geometry=GEO,
        records=rec,
        read_slab=lambda i: memoryview(data[i]),
        control=control,
    )
    return rec, data, w


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    rec, data, w = save(path)
    assert w.nodes == 3 and w.snapshots == 2 and w.slabs == 8 and path.stat().st_size == w.nbytes
    assert not tmp_path.joinpath("h.cache.tmp").exists()
    cf = read_cache_file(path)
    assert cf.fingerprint == FP and cf.geometry == GEO
    got = cf.records
    assert [(n.parent, n.lookup_hash, n.extra, n.tokens) for n in got.nodes] == [
        (n.parent, n.lookup_hash, n.extra, n.tokens) for n in rec.nodes
    ]
    for a, b in zip(got.snapshots, rec.snapshots, strict=True):
        assert (a.anchor, a.frontier, a.tail, a.kind, a.hits) == (
            b.anchor,
            b.frontier,
            b.tail,
            b.kind,
            b.hits,
        )
        assert (a.cost, a.size, a.h, a.durable) == (b.cost, b.size, b.h, b.durable)
    # file slab numbers: blocks, then images and the tail; their bytes are the pool's
    pairs = [(n.slab, o.slab) for n, o in zip(got.nodes, rec.nodes, strict=True)]
    for a, b in zip(got.snapshots, rec.snapshots, strict=True):
        pairs += list(zip(a.image_slabs, b.image_slabs, strict=True))
        if b.tail:
            pairs.append((a.tail_slab, b.tail_slab))
    assert sorted(f for f, _ in pairs) == list(range(8))
    bufs = {f: bytearray(GEO.slab_bytes) for f, _ in pairs}
    assert read_slabs(cf, bufs.items()) == 8 * GEO.slab_bytes
    for f, pool in pairs:
        assert bytes(bufs[f]) == data[pool]
    assert verify_slabs(cf) == []


def section_offsets(path: Path) -> dict[str, int]:
    """A byte in the middle of each section."""
    raw = path.read_bytes()
    _, _, head_len = PREFIX.unpack_from(raw, 0)
    head = json.loads(raw[PREFIX.size : PREFIX.size + head_len])
    o = PREFIX.size
    out = {"header": o + head_len // 2}
    o += head_len + SUM.size
    out["block table"] = o + head["node_table_bytes"] // 2
    o += head["node_table_bytes"] + SUM.size
    out["snapshot table"] = o + head["snapshot_table_bytes"] // 2
    o += head["snapshot_table_bytes"] + SUM.size
    out["slab checksum table"] = o + 4 * head["slabs"]
    o += 8 * head["slabs"] + SUM.size
    out["slab"] = o + 3 * GEO.slab_bytes + 17
    return out


@pytest.mark.parametrize(
    "section", ["header", "block table", "snapshot table", "slab checksum table", "slab"]
)
def test_a_flipped_byte_in_any_section_is_refused(tmp_path: Path, section: str) -> None:
    path = tmp_path / "h.cache"
    save(path)
    raw = bytearray(path.read_bytes())
    raw[section_offsets(path)[section]] ^= 0x40
    path.write_bytes(bytes(raw))
    if section != "slab":
        with pytest.raises(CacheFileError, match="checksum"):
            read_cache_file(path)
        assert inspect(path) == 1
        return
    cf = read_cache_file(path)  # tables are intact; the slab is caught when read
    assert verify_slabs(cf) == [3]
    with pytest.raises(CacheFileError, match="slab 3"):
        read_slabs(cf, ((i, bytearray(GEO.slab_bytes)) for i in range(8)))
    assert inspect(path) == 1


@pytest.mark.parametrize("cut", [1, 100, 600, 5000])
def test_a_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "h.cache"
    save(path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - cut])
    with pytest.raises(CacheFileError, match=r"truncated|ends inside"):
        read_cache_file(path)


def test_an_extended_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    save(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(CacheFileError, match="truncated or damaged"):
        read_cache_file(path)


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    save(path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 8, 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match="format version 99"):
        read_cache_file(path)


def test_not_a_cache_file(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    path.write_bytes(b"hello world, this is not it")
    with pytest.raises(CacheFileError, match="not an sglang-hybrid cache file"):
        read_cache_file(path)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CacheFileError, match="does not exist"):
        read_cache_file(tmp_path / "nope.cache")
    assert inspect(tmp_path / "nope.cache") == 1


def test_a_fingerprint_field_that_differs_is_named(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    save(path, fp={**FP, "tp_size": 2})
    cf = read_cache_file(path)
    diff = fingerprint_mismatch(cf.fingerprint, FP)
    assert diff == ["tp_size: 2 -> 1"]
    assert fingerprint_mismatch(cf.fingerprint, {**FP, "tp_size": 2}) == []
    assert fingerprint_mismatch({**FP, "x": 1}, FP) == ["x: 1 -> '(absent)'"]


def test_an_abandoned_save_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    save(path, seed=1)
    before = path.read_bytes()
    rec, data = records(2)
    control = SaveControl()
    seen = []

    def read_slab(i: int) -> memoryview:
        seen.append(i)
        if len(seen) == 10:  # the second Ctrl+C arrives while slabs are being written
            control.abandon()
        return memoryview(data[i])

    with pytest.raises(SaveAbandoned):
        write_cache_file(
            path, fingerprint=FP, geometry=GEO, records=rec, read_slab=read_slab, control=control
        )
    assert path.read_bytes() == before and not tmp_path.joinpath("h.cache.tmp").exists()
    # a save not yet begun never begins
    with pytest.raises(SaveAbandoned):
        save(path, seed=3, control=control)
    assert path.read_bytes() == before


KILLED_WRITER = """
import sys, time
sys.path[:0] = {paths!r}
from pathlib import Path
from test_cache_file import GEO, FP, records
from sglang_hybrid.store.cache_file import write_cache_file
rec, data = records(5)
def slow(i):
    time.sleep(0.2)
    return memoryview(data[i])
write_cache_file(Path({path!r}), fingerprint=FP, geometry=GEO, records=rec, read_slab=slow)
"""


def test_kill_9_during_a_save_leaves_the_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "h.cache"
    save(path, seed=1)
    before = path.read_bytes()
    code = KILLED_WRITER.format(paths=[str(Path(__file__).parent), *sys.path], path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code])
    tmp = tmp_path_of(path)
    t0 = time.monotonic()
    while not tmp.exists() and time.monotonic() - t0 < 60 and proc.poll() is None:
        time.sleep(0.02)
    assert tmp.exists(), "the writer never started its temporary file"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert tmp.exists() and path.read_bytes() == before  # the leftover is never read
    cf = read_cache_file(path)
    assert verify_slabs(cf) == [] and cf.records.nodes[0].tokens == records(1)[0].nodes[0].tokens
    save(path, seed=6)  # the next save replaces the leftover
    assert not tmp.exists() and read_cache_file(path).records.nodes[0].tokens == (
        records(6)[0].nodes[0].tokens
    )


def tmp_path_of(path: Path) -> Path:
    return tmp_path(path)


def test_inspect_prints_what_the_file_holds(tmp_path: Path, capsys) -> None:
    path = tmp_path / "h.cache"
    save(path)
    assert inspect(path) == 0
    out = capsys.readouterr().out
    assert f"format {FORMAT_VERSION}" in out and "model_path" in out and "checksum ok" in out
    assert "snapshots   2 (1 durable)" in out
    assert "blocks      3" in out and "snapshots   2" in out
    assert "tap" in out and "endpoint" in out
