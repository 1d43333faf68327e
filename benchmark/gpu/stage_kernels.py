"""Stage K: ``sgl_kernel_ext``'s CUDA ops on the device, bit-exact against their torch references,
and timed (docs/kernel-ext.md).

On CUDA, at Qwen3-Next-80B-A3B TP 1 per-rank shapes (12 attention layers with 2 KV heads x 256,
36 GDN layers with 32 value heads x 128 x 128 and conv_dim 8192, kernel 4; bf16 KV, ``h`` and
conv, fp32 SSM pool):

- KV blocks <-> staging, page sizes 1 and 64 (16 too unless quick): kernel vs reference bytes
  both ways and the round trip; GB/s of the kernel alone, of kernel + one pinned D2H copy (and
  one H2D copy + scatter), of the torch reference path, and the contiguous pinned D2H / H2D
  ceiling of the same bytes measured in this process;
- state taps: ``h`` (bf16, one 8192-token pass) -> the fp32 SSM pool for 8 taps over all 36
  layers in one launch: bit-exact, microseconds per tap, against the modelled cost of a split
  pass (``split_pass_us``; default the cost model's fixed pass cost ``CostModel.chunk_s``);
- conv taps at the pass start, within kernel-1 of it, on the chunk grid and at the last
  position: bit-exact, microseconds per tap.

On the CPU (``quick``) the references run at tiny shapes (the kernels need a GPU).

The library: ``sgl-kernel-ext/sgl_kernel_ext/_kernels*.so`` as built here by ``make kernel-ext``
(it links only the CUDA runtime, so the binary built against torch 2.14.1 loads under the
device's torch too; carry it), else ``$SGL_KERNEL_EXT_LIB``, else a build on the device when it
has nvcc. Without any, the stage records that and times the references on the device.

Entry points: ``run(results, device, quick)`` (``results``: a dict filled with ``checks``
(``{name: {"ok": bool, ...}}``) and measurements), and ``run(ctx)`` / ``dry(ctx)`` for
``check_backend.py``'s stage registry. Standalone: ``python benchmark/gpu/stage_kernels.py
[--quick] [--device cpu|cuda] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
KEXT = ROOT / "sgl-kernel-ext"
if str(KEXT) not in sys.path:
    sys.path.insert(0, str(KEXT))
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, when run standalone
from common import Ctx, timed_ms  # noqa: E402

# Qwen3-Next-80B-A3B per rank at TP 1.
FULL = {
    "attn_layers": 12,
    "kv_heads": 2,
    "head_dim": 256,
    "blocks": 128,
    "kv_slots": 65536,
    "gdn_layers": 36,
    "H": 32,
    "V": 128,
    "K": 128,
    "tokens": 8192,
    "conv_dim": 8192,
    "W": 3,
    "taps": 8,
    "pool_slots": 24,
}
QUICK_CUDA = {**FULL, "attn_layers": 4, "blocks": 32, "kv_slots": 8192, "gdn_layers": 4}
TINY = {
    "attn_layers": 2,
    "kv_heads": 2,
    "head_dim": 8,
    "blocks": 4,
    "kv_slots": 512,
    "gdn_layers": 2,
    "H": 2,
    "V": 4,
    "K": 8,
    "tokens": 256,
    "conv_dim": 16,
    "W": 3,
    "taps": 3,
    "pool_slots": 10,
}


def _time_us(fn: Callable[[], Any], device: str, repeat: int = 10) -> float:
    """Median microseconds of ``fn`` (CUDA events on the device, wall clock on the CPU)."""
    return timed_ms(fn, device, repeat=repeat, warmup=2, events=True) * 1e3


def _split_pass_us(given: float | None) -> float:
    if given is not None:
        return given
    try:
        from sglang_hybrid.index.cost import CostModel

        return CostModel().chunk_s * 1e6
    except Exception:  # the modelled default: 2 ms per extra prefill pass
        return 2000.0


def _library(rec: Ctx, kx: Any, device: str, carry: Path | None = None) -> bool:
    """Load (or on the device, build) the CUDA library; record how it went."""
    from sgl_kernel_ext import _lib, _registry, toolkit

    st = kx.extension_status()
    carried = sorted(carry.glob("**/_kernels*.so")) if carry and carry.is_dir() else []
    if not st["available"] and carried:  # a library carried in with check_backend's carry
        os.environ["SGL_KERNEL_EXT_LIB"] = str(carried[0])
        _lib.load()
        _registry.register()
        st = kx.extension_status()
    if not st["available"] and device == "cuda":
        tk = toolkit.find_toolkit(KEXT / "build")
        if isinstance(tk, str):
            rec.result["device_build"] = f"not attempted: {tk}"
        else:
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, str(KEXT / "build.py"), "--no-install"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            rec.result["device_build"] = {
                "rc": r.returncode,
                "seconds": round(time.perf_counter() - t0, 1),
                "tail": (r.stdout + r.stderr)[-1500:],
            }
            _lib.load()
            _registry.register()
        st = kx.extension_status()
    rec.result["extension"] = st
    if device == "cuda":
        rec.check(
            "the CUDA library loaded and its torch operators registered",
            st["available"] and st["torch_ops_registered"],
            reason=st["reason"],
        )
    return bool(st["available"]) and device == "cuda"


# ------------------------------------------------------------------------------ KV blocks
def _paged(n_blocks: int, page: int, slots: int, g: torch.Generator) -> torch.Tensor:
    order = torch.randperm(slots // page, generator=g)
    per = 64 // page
    pages = order[: n_blocks * per].reshape(n_blocks, per)
    return (pages[:, :, None] * page + torch.arange(page)).reshape(n_blocks, 64)


def _kv(
    rec: Ctx, kx: Any, s: dict[str, int], device: str, cuda_ops: bool, pages: list[int]
) -> None:
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    n = s["attn_layers"]
    kv = [
        torch.randn(s["kv_slots"], s["kv_heads"], s["head_dim"], device=device).to(dt)
        for _ in range(2 * n)
    ]
    lay = kx.bundle_layout(kv)
    nb = s["blocks"]
    payload = nb * lay.block_bytes
    out: dict[str, Any] = {"block_bytes": lay.block_bytes, "blocks": nb, "payload": payload}
    pin = device == "cuda"
    host = torch.empty(nb, lay.slab_bytes, dtype=torch.uint8, pin_memory=pin)
    if device == "cuda":  # the contiguous ceiling for the same bytes, this process
        flat = torch.empty(payload, dtype=torch.uint8, device=device)
        hflat = host.reshape(-1)[:payload]
        d2h = _time_us(lambda: hflat.copy_(flat, non_blocking=True), device)
        h2d = _time_us(lambda: flat.copy_(hflat, non_blocking=True), device)
        out["ceiling_d2h_gbs"] = payload / d2h / 1e3
        out["ceiling_h2d_gbs"] = payload / h2d / 1e3
        del flat
    for page in pages:
        row: dict[str, Any] = {}
        slots = _paged(nb, page, s["kv_slots"], g)
        ref = torch.zeros(nb, lay.slab_bytes, dtype=torch.uint8, device=device)
        kx.kv_blocks_to_staging(kv, slots, ref, impl="reference")
        row["reference_gather_us"] = _time_us(
            lambda sl=slots, r=ref: kx.kv_blocks_to_staging(kv, sl, r, impl="reference"),
            device,
            repeat=5,
        )
        if cuda_ops:
            st = torch.zeros_like(ref)
            kx.kv_blocks_to_staging(kv, slots, st, impl="cuda")
            rec.check(f"kv page {page}: blocks -> staging bit-exact", torch.equal(st, ref))
            fresh = [torch.zeros_like(t) for t in kv]
            fresh_ref = [torch.zeros_like(t) for t in kv]
            kx.staging_to_kv_blocks(st, fresh, slots, impl="cuda")
            kx.staging_to_kv_blocks(ref, fresh_ref, slots, impl="reference")
            rec.check(
                f"kv page {page}: staging -> blocks bit-exact",
                all(torch.equal(a, b) for a, b in zip(fresh, fresh_ref)),
            )
            again = torch.zeros_like(st)
            kx.kv_blocks_to_staging(fresh, slots, again, impl="cuda")
            rec.check(
                f"kv page {page}: round trip bit-exact",
                torch.equal(again[:, : lay.block_bytes], st[:, : lay.block_bytes]),
            )
            del fresh, fresh_ref, again
            k_us = _time_us(lambda sl=slots, t=st: kx.kv_blocks_to_staging(kv, sl, t), device)
            s_us = _time_us(lambda sl=slots, t=st: kx.staging_to_kv_blocks(t, kv, sl), device)

            def to_host(sl: torch.Tensor = slots, t: torch.Tensor = st) -> None:
                kx.kv_blocks_to_staging(kv, sl, t)
                host.copy_(t, non_blocking=True)

            def from_host(sl: torch.Tensor = slots, t: torch.Tensor = st) -> None:
                t.copy_(host, non_blocking=True)
                kx.staging_to_kv_blocks(t, kv, sl)

            d2h_us, h2d_us = _time_us(to_host, device), _time_us(from_host, device)
            row.update(
                kernel_gather_us=k_us,
                kernel_scatter_us=s_us,
                kernel_gather_gbs=payload / k_us / 1e3,
                kernel_scatter_gbs=payload / s_us / 1e3,
                d2h_us=d2h_us,
                h2d_us=h2d_us,
                d2h_gbs=payload / d2h_us / 1e3,
                h2d_gbs=payload / h2d_us / 1e3,
            )
            if "ceiling_d2h_gbs" in out:
                row["d2h_ratio"] = row["d2h_gbs"] / out["ceiling_d2h_gbs"]
                row["h2d_ratio"] = row["h2d_gbs"] / out["ceiling_h2d_gbs"]
            del st
        else:
            back = [torch.zeros_like(t) for t in kv]
            kx.staging_to_kv_blocks(ref, back, slots, impl="reference")
            again = torch.zeros_like(ref)
            kx.kv_blocks_to_staging(back, slots, again, impl="reference")
            rec.check(f"kv page {page}: reference round trip bit-exact", torch.equal(again, ref))
        row["reference_gather_gbs"] = payload / row["reference_gather_us"] / 1e3
        out[f"page{page}"] = row
        print(
            f"    kv page {page}: "
            + ", ".join(f"{k}={v:.3g}" for k, v in row.items() if k.endswith(("gbs", "ratio"))),
            flush=True,
        )
    rec.result["kv"] = out
    rec.flush()


# ------------------------------------------------------------------------------ taps
def _tap_positions(s: dict[str, int]) -> list[int]:
    t = s["tokens"]
    grid = list(range(0, t, 64))
    step = max(1, len(grid) // s["taps"])
    return grid[::step][: s["taps"]]


def _state_taps(
    rec: Ctx, kx: Any, s: dict[str, int], device: str, cuda_ops: bool, split_us: float
) -> None:
    L, H, V, K, T = s["gdn_layers"], s["H"], s["V"], s["K"], s["tokens"]
    nt = T // 64
    hdt = torch.bfloat16 if device == "cuda" else torch.float32
    h = torch.randn(L, 1, nt, H, V, K, device=device).to(hdt)
    pool = torch.zeros(L, s["pool_slots"], H, V, K, device=device)
    chunks = kx.state_tap_chunks([T], [0] * s["taps"], _tap_positions(s))
    taps = [(c, i + 1) for i, c in enumerate(chunks)]
    ref = pool.clone()
    kx.gather_state_taps(h, ref, taps, impl="reference")
    want = h[:, 0, chunks[0]].to(pool.dtype)
    ok_ref = torch.equal(ref[:, 1], want)
    out: dict[str, Any] = {"layers": L, "taps": len(taps), "split_pass_us": split_us}
    out["reference_us"] = _time_us(
        lambda: kx.gather_state_taps(h, ref, taps, impl="reference"), device, 5
    )
    if cuda_ops:
        got = pool.clone()
        kx.gather_state_taps(h, got, taps, impl="cuda")
        rec.check(
            "state taps (bf16 h -> fp32 pool, all layers, one launch) bit-exact",
            torch.equal(got, ref) and ok_ref,
        )
        same = torch.zeros(L, s["pool_slots"], H, V, K, device=device, dtype=hdt)
        same_ref = same.clone()
        kx.gather_state_taps(h, same, taps, impl="cuda")
        kx.gather_state_taps(h, same_ref, taps, impl="reference")
        rec.check("state taps (same dtype) bit-exact", torch.equal(same, same_ref))
        us = _time_us(lambda: kx.gather_state_taps(h, got, taps), device)
        out.update(
            kernel_us=us,
            us_per_tap=us / len(taps),
            us_per_tap_layer=us / len(taps) / L,
            gbs=len(taps) * L * H * V * K * (h.element_size() + 4) / us / 1e3,
            tap_vs_split_pass=us / len(taps) / split_us,
        )
        rec.check(
            "a state tap costs less than the modelled fixed cost of a split pass "
            "(CostModel.chunk_s, or --split-pass-us)",
            out["us_per_tap"] < split_us,
            us_per_tap=out["us_per_tap"],
            split_us=split_us,
        )
    else:
        rec.check("state taps reference matches h[:, chunk]", ok_ref)
    out["reference_us_per_tap"] = out["reference_us"] / len(taps)
    rec.result["state_taps"] = out
    rec.flush()


def _conv_taps(rec: Ctx, kx: Any, s: dict[str, int], device: str, cuda_ops: bool) -> None:
    L, T, D, W = s["gdn_layers"], s["tokens"], s["conv_dim"], s["W"]
    dt = torch.bfloat16
    x = torch.randn(L, T, D, device=device).to(dt)
    pool = torch.randn(L, s["pool_slots"], D, W, device=device).to(dt)
    positions = sorted({0, 1, W - 1, W, *_tap_positions(s)[1:], T})[: s["pool_slots"] - 1]
    taps = kx.conv_taps_for(
        [T],
        [0] * len(positions),
        positions,
        [0] * len(positions),
        list(range(1, len(positions) + 1)),
    )
    incoming = pool[:, :1].clone()  # the request's state before the pass, saved
    ref = pool.clone()
    kx.gather_conv_taps(x, ref, taps, incoming, impl="reference")
    out: dict[str, Any] = {"layers": L, "taps": len(taps), "positions": positions}
    out["reference_us"] = _time_us(
        lambda: kx.gather_conv_taps(x, ref, taps, incoming, impl="reference"), device, 5
    )
    if cuda_ops:
        got = pool.clone()
        kx.gather_conv_taps(x, got, taps, incoming, impl="cuda")
        rec.check(
            "conv taps (start, within kernel-1, grid, last) bit-exact",
            torch.equal(got, ref),
            positions=positions,
        )
        live = pool.clone()
        live_ref = pool.clone()
        kx.gather_conv_taps(x, live, taps, live[:, :1], impl="cuda")  # the pool itself
        kx.gather_conv_taps(x, live_ref, taps, live_ref[:, :1].clone(), impl="reference")
        rec.check("conv taps reading the live pool slot bit-exact", torch.equal(live, live_ref))
        us = _time_us(lambda: kx.gather_conv_taps(x, got, taps, incoming), device)
        out.update(kernel_us=us, us_per_tap=us / len(taps))
    else:
        first = ref[:, 1]  # position 0: the incoming state as it is
        rec.check(
            "conv taps reference: a tap at the pass start is the incoming state",
            torch.equal(first, incoming[:, 0]),
        )
    rec.result["conv_taps"] = out
    rec.flush()


# ------------------------------------------------------------------------------ entry points
def run(
    results: Any,
    device: str | None = None,
    quick: bool | None = None,
    split_pass_us: float | None = None,
) -> dict[str, Any]:
    """Fill ``results`` (a dict; or check_backend.py's ``Ctx``, whose ``result``, ``device`` and
    ``quick`` are used) with checks and measurements; returns the dict."""
    if isinstance(results, dict):  # standalone: a context of our own around the dict
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        rec = Ctx(device, bool(quick), Path("."), result=results)
    else:  # check_backend.py's Ctx
        rec = results
    results, device, quick = rec.result, rec.device, rec.quick
    import sgl_kernel_ext as kx

    carry = rec.carry
    cuda_ops = _library(rec, kx, device, Path(carry) if carry else None)
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
        s = QUICK_CUDA if quick else FULL
    else:
        s = TINY
    results["shapes"] = s
    split_us = _split_pass_us(split_pass_us)
    t0 = time.perf_counter()
    _kv(rec, kx, s, device, cuda_ops, [1, 64] if quick else [1, 16, 64])
    _state_taps(rec, kx, s, device, cuda_ops, split_us)
    _conv_taps(rec, kx, s, device, cuda_ops)
    results["seconds_measuring"] = time.perf_counter() - t0
    return results


def dry(ctx: Any) -> None:
    """check_backend.py's dry run: the package imports; what the library did."""
    import sgl_kernel_ext as kx

    ctx.result["extension"] = kx.extension_status()
    ctx.result["api"] = sorted(kx.__all__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--split-pass-us", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run({}, args.device, args.quick, args.split_pass_us)
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    bad = [k for k, v in res.get("checks", {}).items() if not v["ok"]]
    print("FAIL: " + "; ".join(bad) if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
