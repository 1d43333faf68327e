"""Slab transfer throughput against the raw copy ceiling, measured side by side (spec §11.2).

    python benchmark/store/bench_transfer.py [--device cpu|cuda] [--json out.json]

KV buffers shaped like SGLang's pool for a Qwen3.5-27B-class model (16 full-attention layers,
4 KV heads x 256, bf16: 128 KiB per 64-token plane) are copied to and from host slabs by
``SlabCopier`` in runs of 16 consecutive blocks, so every strided copy moves a 2 MiB run of one
plane. Two sizes are timed: one layer (its K and V runs, 4 MiB) and the whole 64 MiB batch; the
ceiling of each is one contiguous copy of the same bytes, timed in the same process. Also
reported: blocks whose 64 slots are scattered (page size 1), which gather and scatter by index.
The CPU target is a ratio >= 0.85; nothing is asserted. Runs on a GPU box with only torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang_hybrid.index import HostSlabPool
from sglang_hybrid.store.host_memory import HostMemory
from sglang_hybrid.store.layout import build_layout
from sglang_hybrid.store.transfer import BlockCopy, SlabCopier

LAYERS, HEADS, DIM = 16, 4, 256
RUN_BLOCKS = 16  # 16 x 128 KiB = one 2 MiB run per plane


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeat: int) -> float:
    fn()
    _sync(device)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def setup(device: str, dtype: torch.dtype = torch.bfloat16, scattered_blocks: int = 16):
    slots = 64 * (RUN_BLOCKS + scattered_blocks) + 1024
    kv = [torch.randn(slots, HEADS, DIM, device=device).to(dtype) for _ in range(2 * LAYERS)]
    state = [torch.randn(LAYERS * 3, 4, 8, 16, device=device)]  # stand-in image; unused here
    layout = build_layout(kv, state)
    n_slabs = RUN_BLOCKS + scattered_blocks + 8
    pool = HostSlabPool(n_slabs * layout.slab_bytes, layout.slab_bytes, layout.image_bytes)
    mem = HostMemory(pool, pin=device == "cuda")
    return kv, state, layout, pool, mem, SlabCopier(layout, mem, kv, state)


def measure(device: str, repeat: int = 20) -> dict:
    kv, _, layout, pool, _, copier = setup(device)
    run_slabs = pool.alloc(RUN_BLOCKS)
    assert run_slabs == list(range(RUN_BLOCKS)), "a fresh pool hands out consecutive slabs"
    run = [BlockCopy(torch.arange(64 * i, 64 * i + 64), s) for i, s in enumerate(run_slabs)]
    total = RUN_BLOCKS * layout.block_bytes
    plane_run = RUN_BLOCKS * layout.planes[0].row_bytes * 64
    gbs = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    res = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "run_bytes": plane_run,
        "batch_bytes": total,
    }
    # The ceiling: one contiguous copy of the same bytes, same direction, in this process.
    for label, nbytes, fn in (
        ("run", 2 * plane_run, lambda to_host: copier.blocks(run, to_host, layer=0)),
        ("batch", total, lambda to_host: copier.blocks(run, to_host)),
    ):
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        for d, to_host in (("d2h", True), ("h2d", False)):
            ours = _time(lambda f=fn, th=to_host: f(th), device, repeat)
            dst, src = (host, flat) if to_host else (flat, host)
            ceil = _time(lambda d=dst, s=src: d.copy_(s, non_blocking=True), device, repeat)
            res[f"{label}_{d}_gbs"] = gbs(nbytes, ours)
            res[f"{label}_ceiling_{d}_gbs"] = gbs(nbytes, ceil)
            res[f"{label}_ratio_{d}"] = ceil / ours
    # Scattered slots (page size 1): one gather / scatter per block and plane.
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(64 * 16, generator=g) + 64 * RUN_BLOCKS
    scat = [BlockCopy(perm[64 * i : 64 * i + 64], s) for i, s in enumerate(pool.alloc(16))]
    t_sd2h = _time(lambda: copier.blocks(scat, to_host=True), device, repeat)
    t_sh2d = _time(lambda: copier.blocks(scat, to_host=False), device, repeat)
    res["scattered_d2h_gbs"] = gbs(16 * layout.block_bytes, t_sd2h)
    res["scattered_h2d_gbs"] = gbs(16 * layout.block_bytes, t_sh2d)
    # The round trip is bit-exact.
    dst = [
        BlockCopy(torch.arange(64 * i, 64 * i + 64) + 64 * RUN_BLOCKS, s)
        for i, s in enumerate(run_slabs)
    ]
    copier.blocks(run, to_host=True)
    copier.blocks(dst, to_host=False)
    _sync(device)
    res["round_trip_exact"] = all(
        torch.equal(b[: 64 * RUN_BLOCKS], b[64 * RUN_BLOCKS : 128 * RUN_BLOCKS]) for b in kv
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return
    r = measure(args.device, args.repeat)
    print(
        f"slab transfers on {r['device']}: one layer's 2 MiB plane runs (K and V), and a "
        f"{r['batch_bytes'] >> 20} MiB batch of every layer, each against one contiguous "
        f"copy of the same bytes:"
    )
    for label in ("run", "batch"):
        for d in ("d2h", "h2d"):
            print(
                f"  {label:5s} {d}: {r[f'{label}_{d}_gbs']:6.2f} GB/s vs ceiling "
                f"{r[f'{label}_ceiling_{d}_gbs']:6.2f} GB/s = {r[f'{label}_ratio_{d}']:.2f}x "
                f"(target >= 0.85)"
            )
    print(
        f"  scattered slots (page 1): d2h {r['scattered_d2h_gbs']:.2f} GB/s, "
        f"h2d {r['scattered_h2d_gbs']:.2f} GB/s; round trip bit-exact: {r['round_trip_exact']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
