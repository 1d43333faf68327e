"""Stage A2: the backend's HostTier on SGLang's pools at real per-rank shapes.

For Qwen3-Next-80B-A3B and Qwen3.5-27B at TP 1 and TP 4 head counts (KV heads replicated when
fewer than the ranks, as SGLang does), pages 1 and 64, SGLang's real Scheduler is built on the
device from a config-only model directory holding one rank's head counts (its pools:
``HybridReqToTokenPool`` with its ``MambaPool``, conv state bf16 and SSM state fp32;
``HybridLinearKVPool`` bf16; SGLang's token or paged allocator) with ``--radix-cache hybrid``,
a host tier, and the token worker (bookkeeping only: no model, no weights). One conversation is
served (a prompt of ``PROMPT`` tokens in chunks of 2048, two output tokens), its device copies
are evicted, and its next turn is served from the host through SGLang's load-back.
Every HostTier call is timed (the device synchronized before and after):

- ``write_lane``: the write-through of a released lane's device-only blocks;
- ``write_snapshot``: a published snapshot's image (and tail) to host;
- ``restore``: host-only blocks, tail and image back into device pages and the lane's slot.

Each is reported as ms per call, bytes, GB/s and the ratio to a contiguous pinned-memory copy of
the same size and direction timed in the same process (the ceiling).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from common import Ctx, add_paths, log

PROMPT = 4096


@dataclass(frozen=True)
class ModelShape:
    layers: int
    full_interval: int
    kv_heads: int
    head_dim: int
    k_heads: int  # linear-attention key heads
    v_heads: int  # linear-attention value heads
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    def full_ids(self) -> list[int]:
        return [i for i in range(self.layers) if (i + 1) % self.full_interval == 0]

    def linear_ids(self) -> list[int]:
        return [i for i in range(self.layers) if (i + 1) % self.full_interval != 0]


MODELS = {
    # config.json of Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, every 4th full attention
    # (16 q / 2 kv heads x 256); GDN 16 key / 32 value heads x 128, conv kernel 4.
    "Qwen3-Next-80B-A3B": ModelShape(48, 4, 2, 256, 16, 32, 128, 128),
    # Qwen3.5-27B: 64 layers, every 4th full attention (4 kv heads x 256); GDN 16 key / 48 value
    # heads x 128.
    "Qwen3.5-27B": ModelShape(64, 4, 4, 256, 16, 48, 128, 128),
}
QUICK = {"tiny (CPU smoke)": ModelShape(8, 4, 2, 64, 4, 8, 32, 32)}


def per_rank(shape: ModelShape, tp: int) -> dict[str, Any]:
    """What one rank's pools hold (SGLang's Mamba2StateShape.create does the GDN part)."""
    from sglang.srt.configs.mamba_utils import Mamba2StateShape

    state = Mamba2StateShape.create(
        tp_world_size=tp,
        intermediate_size=shape.v_dim * shape.v_heads,
        n_groups=shape.k_heads,
        num_heads=shape.v_heads,
        head_dim=shape.v_dim,
        state_size=shape.k_dim,
        conv_kernel=shape.conv_kernel,
    )
    kv_heads = max(1, shape.kv_heads // tp)
    conv = sum(int(torch.Size(c).numel()) for c in state.conv) * 2  # bf16
    ssm = int(torch.Size(state.temporal).numel()) * 4  # fp32
    n_lin, n_full = len(shape.linear_ids()), len(shape.full_ids())
    return {
        "state_shape": state,
        "kv_heads": kv_heads,
        "image_bytes": (conv + ssm) * n_lin,
        "block_bytes": 64 * n_full * 2 * kv_heads * shape.head_dim * 2,
        "conv_shape": [list(c) for c in state.conv],
        "ssm_shape": list(state.temporal),
    }


def model_dir(ctx: Ctx, model: str, shape: ModelShape, tp: int) -> Any:
    """A config-only model directory with one rank's head counts (no weights: the token worker
    computes nothing, and SGLang sizes its pools from the config)."""
    import json

    import transformers

    from sglang_hybrid.cpu import tiny_model, tiny_tokenizer

    arch = "qwen3_5" if model.startswith("Qwen3.5") else "qwen3_next"
    info = per_rank(shape, tp)
    out = ctx.tmp / f"config-{arch}-{shape.layers}l-tp{tp}"
    out.mkdir(parents=True, exist_ok=True)
    ids = tiny_tokenizer.write_tokenizer_files(out)
    kw = tiny_model.config_kwargs(arch, ids)
    kw.update(
        num_hidden_layers=shape.layers,
        layer_types=[
            "linear_attention" if i in shape.linear_ids() else "full_attention"
            for i in range(shape.layers)
        ],
        num_attention_heads=2 * info["kv_heads"],
        num_key_value_heads=info["kv_heads"],
        head_dim=shape.head_dim,
        linear_num_key_heads=max(1, shape.k_heads // tp),
        linear_num_value_heads=max(1, shape.v_heads // tp),
        linear_key_head_dim=shape.k_dim,
        linear_value_head_dim=shape.v_dim,
        linear_conv_kernel_dim=shape.conv_kernel,
        dtype="bfloat16",
    )
    cls = transformers.Qwen3_5TextConfig if arch == "qwen3_5" else transformers.Qwen3NextConfig
    cls(**kw).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["full_attention_interval"] = shape.full_interval
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, info


class Timer:
    """Wraps HostTier methods: wall ms per call (device synchronized around it) and bytes."""

    def __init__(self, host: Any, device: str) -> None:
        self.calls: dict[str, list[tuple[float, int]]] = {}
        self.device = device
        for name in ("write_lane", "write_snapshot", "restore"):
            setattr(host, name, self._wrap(name, getattr(host, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            _sync(self.device)
            ms = (time.perf_counter() - t0) * 1e3
            nbytes = int(getattr(out, "nbytes", out) or 0)  # restore: PendingRestore, or None
            if nbytes:
                self.calls.setdefault(name, []).append((ms, nbytes))
            return out

        return timed


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ceiling_gbs(nbytes: int, to_host: bool, device: str, repeat: int = 5) -> float:
    """A contiguous copy of ``nbytes`` between pinned host memory and the device."""
    pin = device == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(repeat + 1):
        _sync(device)
        t0 = time.perf_counter()
        if to_host:
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def one_case(ctx: Ctx, model: str, shape: ModelShape, tp: int, page: int) -> dict[str, Any]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.sglang.flags import HybridOptions

    prompt_len = 512 if ctx.quick else PROMPT
    chunk = 256 if ctx.quick else 2048
    t0 = time.perf_counter()
    path, info = model_dir(ctx, model, shape, tp)
    blocks = prompt_len // 64
    host_mib = max(64, (3 * blocks * info["block_bytes"] + 6 * info["image_bytes"]) >> 20)
    sched = InProcessScheduler(
        path,
        worker="tokens",
        device=ctx.device,
        dtype="bfloat16",
        page_size=page,
        chunked_prefill_size=chunk,
        max_prefill_tokens=max(chunk, 4096),
        max_total_tokens=4 * prompt_len + 2048,
        max_running_requests=2,
        max_mamba_cache_size=12,
        radix_cache_backend="hybrid",
        # Inline copies: this stage times the bytes each call moves (device synchronized around
        # it); stage H times the asynchronous protocol's scheduler time.
        server_args_attrs={
            "_hybrid_options": HybridOptions(host_cache_mib=host_mib, host_copy="inline")
        },
    )
    try:
        build_s = time.perf_counter() - t0
        cache = sched.tree_cache
        timer = Timer(cache.host_tier, ctx.device)
        rng = torch.Generator().manual_seed(tp * 100 + page)
        prompt = torch.randint(10, 2000, (prompt_len,), generator=rng).tolist()
        # 24 tokens out (to length): an endpoint is published only more than END_TOKENS (16)
        # past the prompt-tail tap at n - 1 (issue #37); a 2-token answer resumes at n - 1.
        sched.submit("a", prompt, 24, sampling_overrides={"ignore_eos": True})
        sched.run_until_idle()
        first = sched.results()["a"]
        cache.evict(EvictParams(num_tokens=1 << 30))  # every device copy backed on the host
        for snap in list(cache.index.snapshots.values()):
            if snap.image_on_host and snap.image_on_device and not snap.restore_pins:
                cache.index.drop_image_device(snap)
        turn2 = [
            *prompt,
            *first.output_ids,
            *torch.randint(10, 2000, (30,), generator=rng).tolist(),
        ]
        sched.submit("b", turn2, 2)
        sched.run_until_idle()
        second = sched.results()["b"]
        pool = sched.scheduler.req_to_token_pool.mamba_pool.mamba_cache
        dtypes = {
            "conv": str(pool.conv[0].dtype),
            "ssm": str(pool.temporal.dtype),
            "kv": str(cache.pools.kv_buffers[0].dtype),
        }
        out: dict[str, Any] = {
            "model": model,
            "tp": tp,
            "page": page,
            "kv_heads_per_rank": info["kv_heads"],
            "conv_shape": info["conv_shape"],
            "ssm_shape": info["ssm_shape"],
            "dtypes": dtypes,
            "image_mib": cache.image_bytes / 2**20,
            "block_mib": cache.block_bytes / 2**20,
            "host_tier_mib": host_mib,
            "build_s": build_s,
            "prompt": prompt_len,
            "resumed_at": second.cached_tokens,
            "endpoint": prompt_len + len(first.output_ids) - 1,
            "restored_bytes": cache.host_tier.restored_bytes,
            "calls": {},
        }
        for name, calls in timer.calls.items():
            to_host = name != "restore"
            ms = [c[0] for c in calls]
            nbytes = [c[1] for c in calls]
            biggest = max(range(len(calls)), key=lambda i: nbytes[i])
            ceil = ceiling_gbs(nbytes[biggest], to_host, ctx.device)
            gbs = nbytes[biggest] / (ms[biggest] / 1e3) / 1e9
            out["calls"][name] = {
                "n": len(calls),
                "ms_median": statistics.median(ms),
                "bytes_median": int(statistics.median(nbytes)),
                "largest_mib": nbytes[biggest] / 2**20,
                "largest_ms": ms[biggest],
                "largest_gbs": gbs,
                "ceiling_gbs": ceil,
                "ratio_to_ceiling": gbs / ceil if ceil else None,
            }
        return out
    finally:
        sched.close()
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def cases(quick: bool) -> list[tuple[str, ModelShape, int, int]]:
    models = QUICK if quick else MODELS
    tps = (4,) if quick else (1, 4)
    return [(m, s, tp, page) for m, s in models.items() for tp in tps for page in (1, 64)]


def run(ctx: Ctx) -> None:
    add_paths()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    rows = []
    ctx.result["cases"] = rows
    for model, shape, tp, page in cases(ctx.quick):
        label = f"{model} TP{tp} page {page}"
        log(f"  {label}")
        try:
            r = one_case(ctx, model, shape, tp, page)
        except Exception as e:  # the next shape still runs
            import traceback

            rows.append({"case": label, "error": "".join(traceback.format_exception(e))[-3000:]})
            ctx.check(f"{label}: ran", False, error=repr(e)[:300])
            ctx.flush()
            continue
        rows.append(r)
        calls = r["calls"]
        ctx.check(
            f"{label}: next turn restored from host at the endpoint",
            r["resumed_at"] == r["endpoint"] and r["restored_bytes"] > 0,
            resumed=r["resumed_at"],
            endpoint=r["endpoint"],
            restored_mib=round(r["restored_bytes"] / 2**20, 1),
        )
        ctx.check(
            f"{label}: write-through, snapshot write and restore all ran",
            all(k in calls for k in ("write_lane", "write_snapshot", "restore")),
            **{
                k: f"{v['largest_mib']:.0f} MiB {v['largest_ms']:.1f} ms "
                f"{v['largest_gbs']:.1f} GB/s ({v['ratio_to_ceiling']:.2f}x)"
                for k, v in calls.items()
            },
        )
        ctx.flush()


def dry(ctx: Ctx) -> None:
    """Per-rank sizes and the cases; imports every module the stage uses (no allocation)."""
    add_paths()
    from sglang_hybrid.cpu.loop import InProcessScheduler  # noqa: F401
    from sglang_hybrid.sglang.host_tier import HostTier  # noqa: F401

    sizes = {}
    for model, shape, tp, page in cases(False):
        if page != 1:
            continue
        info = per_rank(shape, tp)
        sizes[f"{model} TP{tp}"] = {
            "kv_heads": info["kv_heads"],
            "conv": info["conv_shape"],
            "ssm": info["ssm_shape"],
            "image_mib": round(info["image_bytes"] / 2**20, 2),
            "block_mib": round(info["block_bytes"] / 2**20, 3),
        }
        log(f"  {model} TP{tp}: {sizes[f'{model} TP{tp}']}")
    ctx.note("per_rank", sizes)
    ctx.check(
        "Qwen3-Next-80B-A3B TP1 image is ~74 MiB (the design note's figure)",
        abs(sizes["Qwen3-Next-80B-A3B TP1"]["image_mib"] - 73.7) < 1.0,
        image_mib=sizes["Qwen3-Next-80B-A3B TP1"]["image_mib"],
    )
    ctx.note("cases", [f"{m} TP{tp} page {p}" for m, _, tp, p in cases(ctx.quick)])
    # The config-only directories make SGLang size the pools it should: one rank's shapes.
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    for model, shape in MODELS.items():
        for tp in (1, 4):
            path, info = model_dir(ctx, model, shape, tp)
            sa = ServerArgs(
                model_path=str(path),
                device="cpu",
                dtype="bfloat16",
                load_format="dummy",
                skip_tokenizer_init=True,
                mamba_radix_cache_strategy="no_buffer",
                disable_overlap_schedule=True,
                max_mamba_cache_size=12,
                max_running_requests=2,
                max_total_tokens=4096,
            )
            publish(sa, role="scheduler")
            mc = ModelConfig.from_server_args(sa)
            params = mc.hf_config.mamba2_cache_params
            got = (
                mc.get_num_kv_heads(1),
                [list(c) for c in params.shape.conv],
                list(params.shape.temporal),
                len(params.layers),
                str(params.dtype.conv),
            )
            want = (
                info["kv_heads"],
                info["conv_shape"],
                info["ssm_shape"],
                len(shape.linear_ids()),
                "torch.bfloat16",
            )
            ctx.check(f"{model} TP{tp}: SGLang sizes one rank's pools", got == want, got=got)
