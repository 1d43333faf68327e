"""``benchmark/replay/tier_census.py``: what the two tiers hold, counted on a known index.

Blocks are 64 tokens; a block slab is 100 B and an image 10 slabs (``helpers.make_index``)."""

from __future__ import annotations

from helpers import Device, make_index, run

A = list(range(1, 514))  # 8 blocks and a token; a tap at 512 anchors on the 8th
B = list(range(1000, 1384))  # 6 blocks, no snapshot


def test_the_census_counts_each_block_and_image_by_tier_and_what_lies_below(script) -> None:
    census = script("benchmark/replay/tier_census.py").census
    idx, dev = make_index(host_slabs=40, slots=4), Device()
    run(idx, dev, A, taps=[512], endpoint=False)  # written through: both tiers
    run(idx, dev, B, endpoint=False, write=False)  # device only, no snapshot below: dead
    c = census(idx)
    assert c["blocks"] == {"dup/host_snap": 8, "device/none": 6}
    assert c["images"] == {"HD": 1}
    assert c["host_slabs"] == 40 and c["host_free_slabs"] == 40 - 8 - 10
    idx.evict_device(14 * 64)  # B's blocks go; A's keep their host copies
    dev.collect(idx)
    c = census(idx)
    assert c["blocks"] == {"host/host_snap": 8}
    assert c["images"] == {"HD": 1}  # the snapshot keeps its device slot
    (s,) = idx.snapshots.values()
    idx.drop_snapshot_host(s)  # the image on the device alone: A's KV is served by it only
    assert census(idx)["images"] == {"D": 1}
    assert census(idx)["blocks"] == {"host/device_snap": 8}
