"""``sglang-hybrid cache inspect PATH``: what a host tier file holds (spec §5.5).

Prints the header (format, size, when it was saved), the fingerprint, each section's size and
checksum status (every slab is read and checked), and counts of blocks, snapshots and bytes by
snapshot kind. Exits 1 with the reason on a damaged or unreadable file.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..index.snapshot import SnapshotKind
from .cache_file import SUM, CacheFileError, read_cache_file, tmp_path, verify_slabs

MiB = 1 << 20


def inspect(path: Path, out: TextIO | None = None) -> int:
    w = out if out is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=w)

    try:
        cf = read_cache_file(path)
    except CacheFileError as e:
        print(f"sglang-hybrid cache inspect: {path}: unusable: {e.reason}", file=sys.stderr)
        return 1
    h, g, rec = cf.header, cf.geometry, cf.records
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("saved_at", 0)))
    say(f"file        {path} ({cf.size / MiB:.1f} MiB), format {cf.format}, saved {saved}")
    if tmp_path(path).exists():
        say(f"note        {tmp_path(path).name} exists: an unfinished save (ignored at load)")
    say(
        f"geometry    slab {g.slab_bytes} B, image {g.image_bytes} B ({g.image_slabs} slabs), "
        f"block bundle {g.block_bytes} B"
    )
    say("fingerprint")
    for k, v in sorted(cf.fingerprint.items()):
        say(f"  {k:22} {v}")
    bad = verify_slabs(cf)
    sections = [
        ("block table", h["node_table_bytes"], "ok"),
        ("snapshot table", h["snapshot_table_bytes"], "ok"),
        ("slab checksums", SUM.size * len(cf.slab_sums), "ok"),
        (
            "slabs",
            len(cf.slab_sums) * g.slab_bytes,
            "ok" if not bad else f"DAMAGED: {len(bad)} slabs (first {bad[:5]})",
        ),
    ]
    say("sections")
    for name, nbytes, status in sections:
        say(f"  {name:16} {nbytes:>14,} B  checksum {status}")
    say(f"blocks      {len(rec.nodes)} ({len(rec.nodes) * g.slab_bytes / MiB:.1f} MiB of KV)")
    by_kind: Counter[str] = Counter()
    bytes_by_kind: Counter[str] = Counter()
    for r in rec.snapshots:
        try:
            kind = SnapshotKind(r.kind).name.lower()
        except ValueError:
            kind = f"kind {r.kind}"
        by_kind[kind] += 1
        bytes_by_kind[kind] += (len(r.image_slabs) + (r.tail_slab >= 0)) * g.slab_bytes
    pinned = sum(1 for r in rec.snapshots if r.durable)
    say(f"snapshots   {len(rec.snapshots)}" + (f" ({pinned} durable)" if pinned else ""))
    for kind in sorted(by_kind):
        say(f"  {kind:10} {by_kind[kind]:>6}  {bytes_by_kind[kind] / MiB:10.1f} MiB")
    if rec.snapshots:
        fr = [r.frontier for r in rec.snapshots]
        say(f"frontiers   {min(fr)} .. {max(fr)} tokens; hits {sum(r.hits for r in rec.snapshots)}")
    learned = h.get("learned")
    if isinstance(learned, dict):  # the host's learned order (``index/hit_density.py``)
        say(
            f"learned     host order from {learned.get('events', 0):,} hits and evictions, "
            f"{len(learned.get('ghosts', ())):,} ghosts"
        )
    if bad:
        print(f"sglang-hybrid cache inspect: {path}: {len(bad)} damaged slabs", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="sglang-hybrid cache",
        description="Host tier files written by --hybrid-cache-file.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print what a cache file holds; exit 1 if damaged")
    p.add_argument("path", type=Path)
    args = ap.parse_args(list(argv))
    return inspect(args.path)
