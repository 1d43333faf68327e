"""The GPU check: everything in sglang-hybrid that needs CUDA, in one run of a few minutes.

    bash benchmark/gpu/check.sh            # writes $OUT/gpu_check.json (or ./gpu_check.json)

Needs only torch (a GPU box without SGLang); skips cleanly without CUDA. Checks and times:

1. the pinned host slab pool: allocation in chunks of at most 4 GiB of whole slabs;
2. slab transfers H2D and D2H against the device's measured copy ceiling (one contiguous copy of
   the same bytes, same direction, same process), for 2 MiB plane runs and whole batches, plus
   scattered-slot blocks; bit-exact round trips;
3. a restore batch of a Qwen3.5-27B-class geometry (16 attention layers of KV, 48 linear layers
   of state) on its own stream with an event per layer in forward order: after waiting for layer
   l the compute stream reads exactly the restored bytes of layer l, and when each layer became
   ready relative to the start (the layer pipelining a forward pass can use).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benchmark" / "store"))


def pinned_pool(results: dict) -> None:
    from sglang_hybrid.index import HostSlabPool
    from sglang_hybrid.store.host_memory import HostMemory

    slab = 4 << 20  # a 27B BF16 block bundle
    budget = 6 << 30  # two chunks: 4 GiB + 2 GiB
    t0 = time.perf_counter()
    pool = HostSlabPool(budget, slab, 144 << 20)
    mem = HostMemory(pool, pin=True)
    dt = time.perf_counter() - t0
    results["pinned_pool"] = {
        "budget_gib": budget / 2**30,
        "chunks": len(mem.chunks),
        "chunk_bytes": [c.numel() for c in mem.chunks],
        "pinned": all(c.is_pinned() for c in mem.chunks),
        "alloc_s": dt,
        "slab_never_crosses_chunk": all(
            pool.address(s).offset + slab <= mem.chunks[pool.address(s).chunk].numel()
            for s in range(pool.n_slabs)
        ),
    }
    del mem


def transfers(results: dict) -> None:
    import bench_transfer

    results["transfers"] = bench_transfer.measure("cuda", repeat=30)


def restore_pipeline(results: dict, dev: str = "cuda", scale: int = 1) -> None:
    from sglang_hybrid.index import HostSlabPool
    from sglang_hybrid.store.host_memory import HostMemory
    from sglang_hybrid.store.layout import build_layout
    from sglang_hybrid.store.transfer import BlockCopy, SlabCopier, TransferBatch

    full, linear, heads, dim, blocks = 16 // scale, 48 // scale, 4, 256, 128 // scale
    cuda = dev == "cuda"
    slots = 64 * blocks + 64
    kv = [torch.zeros(slots, heads, dim, device=dev, dtype=torch.bfloat16) for _ in range(2 * full)]
    # One state slot per linear layer: the 27B GDN recurrent state (48 x 128 x 128 fp32).
    state = [torch.zeros(linear, 2, 48 // scale, 128, 128, device=dev, dtype=torch.float32)]
    layout = build_layout(kv, state)
    pool = HostSlabPool(
        (blocks + layout.image_slabs + 4) * layout.slab_bytes, layout.slab_bytes, layout.image_bytes
    )
    mem = HostMemory(pool, pin=cuda)
    copier = SlabCopier(layout, mem, kv, state)
    # Source contents on the device, written to host, then the device is wiped.
    g = torch.Generator(device=dev).manual_seed(0)
    for b in kv:
        b.copy_(torch.randn(b.shape, generator=g, device=dev).to(b.dtype))
    state[0][:, 0].copy_(torch.randn(state[0][:, 0].shape, generator=g, device=dev))
    slabs = pool.alloc(blocks)
    img = pool.alloc(layout.image_slabs)
    items = [BlockCopy(torch.arange(64 * i, 64 * i + 64), s) for i, s in enumerate(slabs)]
    copier.blocks(items, to_host=True)
    copier.image(0, img, to_host=True)
    _sync(cuda)
    want_kv = [float(b[: 64 * blocks].float().sum()) for b in kv]
    want_state = [float(state[0][layer, 0].sum()) for layer in range(linear)]
    for b in kv:
        b.zero_()
    state[0].zero_()
    # Forward order of a 64-layer model: three linear layers, then one attention layer.
    order: list[tuple[str, int]] = []
    for i in range(full):
        order += [("state", 3 * i + j) for j in range(3)] + [("kv", i)]
    batch = TransferBatch(copier, order)
    batch.add_blocks(items)
    batch.add_image(1, img)
    _sync(cuda)
    start = _Event(cuda)
    t0 = time.perf_counter()
    if cuda:  # the host tier's copy stream (store/copy_queue.py: StreamQueue)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moved = batch.run(to_host=False)
    else:
        moved = batch.run(to_host=False)
    issue_s = time.perf_counter() - t0
    ready, sums_ok = [], True
    for pos, (kind, idx) in enumerate(order):
        batch.wait_layer(pos)
        ready.append(_Event(cuda))
        if kind == "kv":  # read right after the wait, on the compute stream
            got = [
                float(kv[idx][: 64 * blocks].float().sum()),
                float(kv[full + idx][: 64 * blocks].float().sum()),
            ]
            sums_ok &= got == [want_kv[idx], want_kv[full + idx]]
        else:
            sums_ok &= float(state[0][idx, 1].sum()) == want_state[idx]
    _sync(cuda)
    times = [start.elapsed_ms(e) for e in ready]
    results["restore_pipeline"] = {
        "layers": len(order),
        "bytes": moved,
        "issue_ms": issue_s * 1e3,
        "total_ms": times[-1],
        "first_layer_ready_ms": times[0],
        "ready_ms_monotonic": all(b >= a for a, b in itertools.pairwise(times)),
        "gbs": moved / (times[-1] / 1e3) / 1e9,
        "every_layer_read_exact_after_its_event": sums_ok,
        "ready_ms_every_8th_layer": times[::8],
    }


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class _Event:
    """A CUDA timing event recorded now on the current stream (wall clock on the CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.ev = torch.cuda.Event(enable_timing=True)
            self.ev.record()
        else:
            self.t = time.perf_counter()

    def elapsed_ms(self, later: _Event) -> float:
        if self.cuda:
            return self.ev.elapsed_time(later.ev)
        return (later.t - self.t) * 1e3


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"torch": torch.__version__}
    if os.environ.get("GPU_CHECK_DRYRUN"):  # the CUDA-free parts, on the CPU, scaled down
        restore_pipeline(results, dev="cpu", scale=4)
        print(json.dumps(results, indent=2))
        return 0
    if not torch.cuda.is_available():
        print("GPU check skipped: no CUDA device on this machine")
        results["skipped"] = "no CUDA device"
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))
        return 0
    results["device"] = torch.cuda.get_device_name()
    failed = False
    for name, fn in (
        ("pinned pool", pinned_pool),
        ("transfers", transfers),
        ("restore pipeline", restore_pipeline),
    ):
        t0 = time.perf_counter()
        try:
            fn(results)
            print(f"[ok] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:  # one failure must not hide the other checks
            failed = True
            results[f"{name}_error"] = "".join(traceback.format_exception(e))[-3000:]
            print(f"[FAILED] {name}: {e}", flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
