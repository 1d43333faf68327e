"""SGLang's own Triton kernels on the CPU under Triton's interpreter: the checks, as a script.

Triton decides interpreted vs compiled when a kernel is decorated, and its own helpers are
decorated when ``triton`` is imported (which importing SGLang does), so these checks run in a
fresh process with ``TRITON_INTERPRET=1`` (``test_triton_interpret.py`` starts it):

    python test/cpu/triton_interpret_checks.py CHECK [CHECK ...] --json OUT

Each check prints what it measured and writes ``{check: {"ok", "seconds", ...}}`` to ``OUT``.
The stage-C checks are the GPU check's own code (``benchmark/gpu/stage_chunk.py``) with SGLang's
kernel interpreted instead of compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "python", ROOT / "benchmark" / "gpu"):
    sys.path.insert(0, str(p))

from sglang_hybrid.cpu.triton_interpret import enable_interpreter, interpreted  # noqa: E402

enable_interpreter()  # before anything imports triton

import torch  # noqa: E402
from common import Ctx  # noqa: E402

CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}
OWN_SHIMS = {"each_shim_is_needed"}  # checks that apply the shims themselves


def check(fn: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


@check
def each_shim_is_needed(ctx: Ctx) -> dict[str, Any]:
    """SGLang's kernel with all shims matches the torch reference; without any one of them it
    fails as that shim's reason says (``triton_interpret.SHIMS``). Each run uses a new shape,
    so no autotuner choice is cached from an earlier one."""
    import stage_chunk
    import torch_gdn

    from sglang_hybrid.cpu.triton_interpret import SHIMS

    def run(k: int, without: tuple[str, ...]) -> float:
        s = {"Hg": 1, "H": 1, "K": k, "V": k, "T": 64}
        x = stage_chunk.inputs(s, "cpu", seed=k)
        with interpreted(without=without):
            o, _, _ = stage_chunk.run_pass(
                _chunk_kernel(), x, 0, 64, torch.zeros(1, 1, k, k, dtype=torch.float32)
            )
        ref = torch_gdn.chunk_gated_delta_rule(
            *(x[n].float() for n in ("q", "k", "v", "g", "beta")),
            use_qk_l2norm_in_kernel=True,
        )[0]
        return (o.float() - ref).abs().max().item() / ref.abs().max().item()

    out: dict[str, Any] = {"all": run(16, ())}
    for i, shim in enumerate(SHIMS):
        try:
            out[shim.name] = f"ran, relative error {run(24 + 8 * i, (shim.name,)):.3g}"
        except Exception as e:
            out[shim.name] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    needed = all(
        out[s.name].startswith("failed") or float(out[s.name].rsplit(" ", 1)[1]) > 0.1
        for s in SHIMS
    )
    return {"ok": out["all"] <= 2e-2 and needed, "runs": out}


def _chunk_kernel() -> Any:
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _ok(ctx: Ctx) -> bool:
    return all(c["ok"] for c in ctx.result.get("checks", {}).values())


@check
def chunk_vs_transformers(ctx: Ctx) -> dict[str, Any]:
    """The kernel at the tiny model's GDN shapes against transformers' fp32 GDN (stage C)."""
    import stage_chunk

    stage_chunk.tiny_model_shapes(ctx, _chunk_kernel())
    return {"ok": _ok(ctx), **ctx.result}


@check
def h_is_the_split_state(ctx: Ctx) -> dict[str, Any]:
    """``h[:, i]`` (bf16) and SGLang's fp32 TRACK_STATE snapshot at chunk i against the final
    state of the same tokens cut at 64·i (stage C's check, at small heads)."""
    import stage_chunk

    fn = _chunk_kernel()
    s = {"Hg": 1, "H": 2, "K": 32, "V": 32, "T": 192}
    x = stage_chunk.inputs(s, "cpu", seed=3)
    H, V, K = s["H"], s["V"], s["K"]
    full = torch.zeros(1, H, V, K, dtype=torch.float32)
    _, _, h = stage_chunk.run_pass(fn, x, 0, s["T"], full)
    rows = []
    for i in (1, 2):
        split = torch.zeros(1, H, V, K, dtype=torch.float32)
        stage_chunk.run_pass(fn, x, 0, 64 * i, split)
        scale = split.abs().max().item()
        h_rel = (h[0, i].float() - split[0]).abs().max().item() / scale
        track = stage_chunk.tracked_state(x, i)
        t_abs = (track[0] - split[0]).abs().max().item()
        rows.append({"chunk": i, "h_rel": h_rel, "track_abs": t_abs})
    ok = all(r["h_rel"] <= 1e-2 and r["track_abs"] <= 1e-5 for r in rows)
    return {"ok": ok, "chunks": rows}


@check
def varlen_taps(ctx: Ctx) -> dict[str, Any]:
    """``gdn_taps``' plan, gathers and off-grid recompute on the kernel's ``h`` of two
    sequences packed with ``cu_seqlens`` (stage C's ``varlen_gather``, at small heads)."""
    import stage_chunk

    shape = {"Hg": 2, "H": 4, "K": 32, "V": 32, "T": 330}
    worst = stage_chunk.varlen_gather(ctx, _chunk_kernel(), shape)
    return {"ok": _ok(ctx), "worst_rel": worst}


@check
def mamba_conv(ctx: Ctx) -> dict[str, Any]:
    """SGLang's Triton causal conv (prefill ``causal_conv1d_fn``, decode
    ``causal_conv1d_update``) against torch's conv, and its conv state as the cache relies on:
    the ``W - 1`` pre-convolution inputs before a position, in order ``[dim, W - 1]``; a prefill
    cut at ``p`` and resumed from that state is the uncut prefill."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )

    g = torch.Generator().manual_seed(4)
    dim, width, T, p = 64, 4, 50, 23
    x = torch.randn(dim, T, generator=g)
    w = torch.randn(dim, width, generator=g) * 0.5
    b = torch.randn(dim, generator=g) * 0.1

    def reference(xs: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        full = torch.cat([prev, xs], dim=1)  # [dim, W - 1 + n]
        out = torch.nn.functional.conv1d(full[None], w[:, None, :], b, groups=dim)[0]
        return torch.nn.functional.silu(out)

    def prefill(xs: torch.Tensor, states: torch.Tensor, slot: int, has_init: bool) -> Any:
        n = xs.shape[1]
        return causal_conv1d_fn(
            xs.clone(),
            w,
            b,
            conv_states=states,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens_cpu=[n],
            cache_indices=torch.tensor([slot], dtype=torch.int32),
            has_initial_state=torch.tensor([has_init]),
            activation="silu",
        )

    zeros = torch.zeros(dim, width - 1)
    states = torch.zeros(4, dim, width - 1)
    out = prefill(x, states, 1, False)
    err_out = (out - reference(x, zeros)).abs().max().item()
    err_state = (states[1] - x[:, T - (width - 1) :]).abs().max().item()
    # Cut at p, resumed from the state the cut left (a snapshot's conv state).
    cut = torch.zeros(4, dim, width - 1)
    first = prefill(x[:, :p], cut, 2, False)
    second = prefill(x[:, p:], cut, 2, True)
    err_cut = (torch.cat([first, second], dim=1) - out).abs().max().item()
    # Decode: one token at a time after the prefill's state.
    dec = states.clone()
    y = torch.randn(dim, 3, generator=g)
    steps = []
    for j in range(3):
        o = causal_conv1d_update(
            y[:, j : j + 1][None].clone(),
            dec,
            w,
            b,
            activation="silu",
            conv_state_indices=torch.tensor([1], dtype=torch.int32),
        )
        steps.append(o[0])
    err_dec = (torch.cat(steps, dim=1) - reference(y, x[:, T - (width - 1) :])).abs().max().item()
    errs = {"out": err_out, "state": err_state, "cut": err_cut, "decode": err_dec}
    return {"ok": all(e <= 1e-4 for e in errs.values()), "max_abs": errs}


def _two_turns(chat: Any, rng: Any) -> Any:
    """A small exactness program: a prompt ending inside a block (its endpoint gets a tail),
    then the next turn resuming from it. Interpreted kernels take seconds a call, so it is
    short: about a dozen passes."""
    from programs import Req, Wave, toks

    prompt = toks(rng, 150)
    results = yield Wave([Req("tt-1", prompt, 70)])
    yield Wave([Req("tt-2", prompt + list(results["tt-1"].output_ids) + toks(rng, 20), 2)])


@check
def model_worker_gdn(ctx: Ctx) -> dict[str, Any]:
    """The GDN path of the model worker's CUDA build (bf16, SGLang's ``chunk_gated_delta_rule``
    through ``cpu/gdn_kernels``' adapter) through SGLang's Scheduler with the cache: a two-turn
    program whose second turn resumes from the first one's endpoint, every resumed state and
    prefix KV row proven against the model's own computation (stage B's ``run_config`` and
    judge, interpreted instead of compiled)."""
    import stage_scheduler
    from common import add_paths, tiny_model
    from transformers import AutoTokenizer

    add_paths()
    import programs
    from programs import Chat

    programs.PROGRAMS["two_turns"] = _two_turns
    model = tiny_model(ctx.tmp)
    chat = Chat(AutoTokenizer.from_pretrained(model))
    res = stage_scheduler.run_config(ctx, "hybrid+host", ["two_turns"], model, chat)
    stage_scheduler._judge(ctx, "hybrid+host", res)
    keep = ("gdn", "gdn_source", "requests", "reuse", "resumes_checked", "run_s", "verify_s")
    return {"ok": _ok(ctx), **{k: res.get(k) for k in keep}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.checks:
            ctx = Ctx(device="cpu", quick=True, tmp=Path(tmp))
            t0 = time.perf_counter()
            try:
                if name in OWN_SHIMS:
                    res = CHECKS[name](ctx)
                else:
                    with interpreted():
                        res = CHECKS[name](ctx)
            except Exception as e:  # reported, the next check still runs
                res = {"ok": False, "error": "".join(traceback.format_exception(e))[-3000:]}
            res["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {'ok' if res['ok'] else 'FAIL'} ({res['seconds']} s)", flush=True)
            out[name] = res
            args.json.write_text(json.dumps(out, default=str, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
