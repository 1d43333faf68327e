"""Stage C: per-chunk states of SGLang's Triton ``chunk_gated_delta_rule`` (zero-split taps).

One extend of ``T`` tokens through SGLang's kernel already computes ``h``: the recurrent state
at the start of every 64-token chunk (``[B, NT, H, V, K]``, in the inputs' dtype, bf16). If
``h[:, i]`` is the state a pass ending at ``64·i`` would leave, a tap on the chunk grid costs a
gather instead of a split pass. At Qwen3-Next-80B-A3B per-rank shapes (TP 1: 16 key / 32 value
heads, TP 4: 4 / 8; K = V = 128; ``T`` = 8192, a chunked-prefill pass) this stage measures:

- ``h[:, i]`` against the final (fp32) state of the same tokens cut at ``64·i`` (max abs and
  relative error: bf16 rounding is the expected difference);
- the kernel's fp32 ``TRACK_STATE`` snapshot at chunk i (``chunk_gated_delta_rule_fwd_h`` with
  ``track_state``, composed from SGLang's own ``l2norm_fwd``, ``chunk_local_cumsum`` and
  ``chunk_gated_delta_rule_fwd_intra`` as its ``chunk_gated_delta_rule_fwd`` does) against the
  same split state;
- how far one pass and a pass split at ``64·i`` disagree on the final state (what a resumed run
  differs by when the reference is not cut the same way);
- the time of the whole pass, of the split pair, and of gathering ``k`` chunk states out of
  ``h`` into fp32 snapshot buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from common import Ctx, log

CHUNK = 64


def shapes(quick: bool) -> dict[str, dict[str, int]]:
    if quick:
        return {"tiny": {"Hg": 1, "H": 2, "K": 32, "V": 32, "T": 256}}
    return {
        "Qwen3-Next-80B-A3B TP1": {"Hg": 16, "H": 32, "K": 128, "V": 128, "T": 8192},
        "Qwen3-Next-80B-A3B TP4": {"Hg": 4, "H": 8, "K": 128, "V": 128, "T": 8192},
    }


def kernel(ctx: Ctx) -> tuple[Any, str]:
    if ctx.cuda:
        from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

        return chunk_gated_delta_rule, "sglang.kernels.ops.attention.fla.chunk"
    import torch_gdn

    return torch_gdn.chunk_gated_delta_rule, "torch stand-in (CPU smoke)"


def inputs(s: dict[str, int], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    T, Hg, H, K, V = s["T"], s["Hg"], s["H"], s["K"], s["V"]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q": rnd(1, T, Hg, K).to(dt).to(device),
        "k": rnd(1, T, Hg, K).to(dt).to(device),
        "v": (0.5 * rnd(1, T, H, V)).to(dt).to(device),
        # log decay as SGLang's gating produces it: -exp(A_log) * softplus(a + dt_bias) < 0
        "g": (-torch.nn.functional.softplus(rnd(1, T, H)) * 0.3).to(device),
        "beta": torch.sigmoid(rnd(1, T, H)).to(dt).to(device),
    }


def run_pass(fn: Any, x: dict[str, torch.Tensor], a: int, b: int, state: torch.Tensor) -> Any:
    """``fn`` over tokens [a, b) from ``state`` ([1, H, V, K] fp32, updated in place)."""
    idx = torch.zeros(1, dtype=torch.int32, device=state.device)
    return fn(
        x["q"][:, a:b],
        x["k"][:, a:b],
        x["v"][:, a:b],
        x["g"][:, a:b],
        x["beta"][:, a:b],
        initial_state=state,
        initial_state_indices=idx,
        use_qk_l2norm_in_kernel=True,
    )


def tracked_state(x: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    """SGLang's fp32 TRACK_STATE snapshot at the start of ``chunk``, from SGLang's own steps."""
    from sglang.kernels.ops.attention.fla.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from sglang.kernels.ops.attention.fla.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd

    k = l2norm_fwd(x["k"])  # the state needs no query
    g = chunk_local_cumsum(x["g"], chunk_size=CHUNK)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(
        k=k, v=x["v"], g=g, beta=x["beta"], cu_seqlens=None, chunk_indices=None
    )
    H, V, K = x["v"].shape[2], x["v"].shape[3], x["k"].shape[3]
    state = torch.zeros(1, H, V, K, dtype=torch.float32, device=k.device)
    track = torch.zeros(1, H, V, K, dtype=torch.float32, device=k.device)
    chunk_gated_delta_rule_fwd_h(
        k=k,
        w=w,
        u=u,
        g=g,
        initial_state=state,
        initial_state_indices=torch.zeros(1, dtype=torch.int32, device=k.device),
        inplace_update=True,
        track_state=track,
        track_chunk_idx=torch.tensor([chunk], dtype=torch.int32, device=k.device),
    )
    return track


def _ms(fn: Any, device: str, repeat: int = 10) -> float:
    if device != "cuda":
        import time

        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1e3
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def one_shape(ctx: Ctx, name: str, s: dict[str, int], fn: Any) -> dict[str, Any]:
    dev = ctx.device
    x = inputs(s, dev)
    T, H, V, K = s["T"], s["H"], s["V"], s["K"]
    nt = -(-T // CHUNK)
    full_state = torch.zeros(1, H, V, K, dtype=torch.float32, device=dev)
    _, _, h = run_pass(fn, x, 0, T, full_state)
    chunks = sorted({1, 2, nt // 8, nt // 2, nt - 1} - {0})
    rows = []
    for i in chunks:
        split = torch.zeros(1, H, V, K, dtype=torch.float32, device=dev)
        run_pass(fn, x, 0, CHUNK * i, split)
        scale = split.abs().max().item()
        err = (h[0, i].float() - split[0]).abs().max().item()
        row = {
            "chunk": i,
            "tokens": CHUNK * i,
            "state_max_abs": scale,
            "h_max_abs_err": err,
            "h_max_rel_err": err / scale if scale else None,
        }
        if ctx.cuda:
            t = tracked_state(x, i)
            terr = (t[0] - split[0]).abs().max().item()
            row["track_state_max_abs_err"] = terr
            row["track_state_bitwise"] = bool(torch.equal(t[0], split[0]))
        cont = split.clone()
        run_pass(fn, x, CHUNK * i, T, cont)
        row["final_one_pass_vs_split_max_abs"] = (cont - full_state).abs().max().item()
        rows.append(row)
    # Costs: the pass, the pass split in two, gathering k chunk states into fp32 buffers.
    mid = CHUNK * (nt // 2)

    def one() -> None:
        run_pass(fn, x, 0, T, torch.zeros(1, H, V, K, dtype=torch.float32, device=dev))

    def two() -> None:
        st = torch.zeros(1, H, V, K, dtype=torch.float32, device=dev)
        run_pass(fn, x, 0, mid, st)
        run_pass(fn, x, mid, T, st)

    gathers = {}
    for k in (1, 8, 32):
        k = min(k, nt)
        idx = torch.linspace(0, nt - 1, k).round().long().to(dev)
        out = torch.empty(k, H, V, K, dtype=torch.float32, device=dev)

        def gather(idx: torch.Tensor = idx, out: torch.Tensor = out) -> None:
            out.copy_(h[0].index_select(0, idx))

        gathers[k] = _ms(gather, dev, repeat=20)
    return {
        "shape": s,
        "chunks": rows,
        "pass_ms": _ms(one, dev, repeat=5),
        "split_pass_ms": _ms(two, dev, repeat=5),
        "gather_ms": gathers,
        "h_mib": h.numel() * h.element_size() / 2**20,
        "state_mib": H * V * K * 4 / 2**20,
    }


def tiny_model_shapes(ctx: Ctx, fn: Any) -> None:
    """The kernel at the tiny model's GDN shapes (stage B's), against transformers' torch GDN
    in fp32 on the same inputs: K = 32 and V = 48 are not the production 128."""
    import torch_gdn

    s = {"Hg": 8, "H": 8, "K": 32, "V": 48, "T": 130}
    x = inputs(s, ctx.device, seed=1)
    state = torch.zeros(1, s["H"], s["V"], s["K"], dtype=torch.float32, device=ctx.device)
    o, _, _ = run_pass(fn, x, 0, s["T"], state)
    ro, rstate = torch_gdn._REFERENCE(
        x["q"].float(),
        x["k"].float(),
        x["v"].float(),
        g=x["g"],
        beta=x["beta"].float(),
        initial_state=None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o_err = (o.float() - ro).abs().max().item() / max(ro.abs().max().item(), 1e-12)
    s_err = (state[0].transpose(-1, -2) - rstate[0]).abs().max().item() / max(
        rstate.abs().max().item(), 1e-12
    )
    ctx.check(
        "the kernel at the tiny model's shapes (K=32, V=48) computes transformers' GDN "
        "(relative error <= 2e-2, bf16 inputs)",
        o_err <= 2e-2 and s_err <= 2e-2,
        output_rel=o_err,
        state_rel=s_err,
    )


def varlen_gather(ctx: Ctx, fn: Any) -> None:
    """The backend's zero-split gather (``sglang_hybrid.sglang.gdn_taps``: the plan's chunk
    numbering over a packed batch, ``capture_layer``) on the kernel's ``h`` for two sequences
    packed with ``cu_seqlens``, against each sequence's own pass cut at the tap."""
    from types import SimpleNamespace

    from sglang_hybrid.cpu.taps import TAPS_ATTR
    from sglang_hybrid.sglang import gdn_taps

    s = {"Hg": 4, "H": 8, "K": 128, "V": 128, "T": 330}
    lens, taps = (200, 130), ((64, 100, 128), (64, 90))  # 100, 90: the off-grid recompute
    x = inputs(s, ctx.device, seed=2)
    H, V, K, dev = s["H"], s["V"], s["K"], ctx.device
    pool = torch.zeros(8, H, V, K, dtype=torch.float32, device=dev)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.long, device=dev)
    _, _, h = fn(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=pool,
        initial_state_indices=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    dst = iter(range(2, 8))
    reqs = [SimpleNamespace(**{TAPS_ATTR: [(o, next(dst)) for o in offsets]}) for offsets in taps]
    rows = [getattr(r, TAPS_ATTR) for r in reqs]
    plan = gdn_taps.plan_pass(reqs, rows, [0, 0], list(lens), 4, dev)
    assert plan is not None
    conv = torch.zeros(8, 16, 3, device=dev)
    mixed_qkv = torch.randn(sum(lens), 16, device=dev)
    gdn_taps.capture_layer(plan, conv, pool, mixed_qkv[plan.conv_rows], h)

    class Kernel:  # TritonGDNKernel.extend's call of the same function
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc):
            return fn(
                q,
                k,
                v,
                g,
                beta,
                initial_state=ssm_states,
                initial_state_indices=cache_indices,
                cu_seqlens=query_start_loc,
                use_qk_l2norm_in_kernel=True,
            )

    call = {
        "q": x["q"],
        "k": x["k"],
        "v": x["v"],
        "g": x["g"],
        "beta": x["beta"],
        "cache_indices": torch.tensor([0, 1], dtype=torch.int32, device=dev),
        "query_start_loc": cu,
    }
    gdn_taps.advance(plan, Kernel(), pool, call)
    worst = 0.0
    start = 0
    for n, req in zip(lens, reqs, strict=True):
        for o, slot in getattr(req, TAPS_ATTR):
            one = {k: v[:, start : start + n] for k, v in x.items()}
            split = torch.zeros(1, H, V, K, dtype=torch.float32, device=dev)
            run_pass(fn, one, 0, o, split)
            err = (pool[slot] - split[0]).abs().max().item() / max(split.abs().max().item(), 1e-12)
            worst = max(worst, err)
        start += n
    ctx.check(
        "gdn_taps' plan, gathers and off-grid recompute on the kernel's h of two packed "
        "sequences equal each sequence's pass cut at the tap (bf16 rounding, rel <= 1e-2)",
        worst <= 1e-2,
        worst_rel=worst,
    )


def run(ctx: Ctx) -> None:
    fn, source = kernel(ctx)
    ctx.note("kernel", source)
    tiny_model_shapes(ctx, fn)
    ctx.flush()
    if ctx.cuda:  # the CPU stand-in takes equal-length sequences only
        varlen_gather(ctx, fn)
        ctx.flush()
    results = {}
    ctx.result["shapes"] = results
    for name, s in shapes(ctx.quick).items():
        log(f"  {name}: {s}")
        r = one_shape(ctx, name, s, fn)
        results[name] = r
        worst_rel = max(row["h_max_rel_err"] or 0.0 for row in r["chunks"])
        ctx.check(
            f"{name}: h[:, i] is the state of a pass split at 64·i (bf16 rounding, rel <= 1e-2)",
            worst_rel <= 1e-2,
            worst_rel=worst_rel,
            worst_abs=max(row["h_max_abs_err"] for row in r["chunks"]),
        )
        if ctx.cuda:
            worst = max(row["track_state_max_abs_err"] for row in r["chunks"])
            ctx.check(
                f"{name}: fp32 TRACK_STATE at chunk i equals the split state (|Δ| <= 1e-5)",
                worst <= 1e-5,
                worst_abs=worst,
                bitwise=all(row["track_state_bitwise"] for row in r["chunks"]),
            )
        log(
            f"    pass {r['pass_ms']:.3f} ms, split pass {r['split_pass_ms']:.3f} ms, gather "
            + ", ".join(f"{k}: {v:.3f} ms" for k, v in r["gather_ms"].items())
        )
        ctx.flush()


def dry(ctx: Ctx) -> None:
    """Imports of every kernel entry point used; the shapes and memory it would take."""
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule  # noqa: F401
    from sglang.kernels.ops.attention.fla.chunk_delta_h import (  # noqa: F401
        chunk_gated_delta_rule_fwd_h,
    )
    from sglang.kernels.ops.attention.fla.chunk_fwd import (  # noqa: F401
        chunk_gated_delta_rule_fwd_intra,
    )
    from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum  # noqa: F401
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd  # noqa: F401

    plan = {}
    for name, s in shapes(False).items():
        nt = -(-s["T"] // CHUNK)
        plan[name] = {
            **s,
            "h_mib": nt * s["H"] * s["V"] * s["K"] * 2 / 2**20,
            "chunks_compared": sorted({1, 2, nt // 8, nt // 2, nt - 1}),
        }
        log(f"  {name}: {plan[name]}")
    ctx.note("plan", plan)
    ctx.check("SGLang's GDN kernel entry points import", True)
