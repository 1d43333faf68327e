"""What a model worker captures inside a prefill pass, and what ``--hybrid-tap-mode`` makes of it.

A tap strictly inside a prefill pass is taken without ending the pass when the model worker can
leave the state there in a snapshot slot (``cpu/taps.py``'s protocol). Which positions it can,
on SGLang 0.5.23's GPU worker (docs/inpass-capture.md has the sources this rests on):

- SGLang's own prefill tracking (``track.py``: the fields ``extra_buffer`` fills, filled by this
  cache instead): one state per request per pass, at ``prefix + 64 k`` inside the pass, with the
  Triton GDN prefill (from its per-chunk states ``h``, bf16) and the FlashInfer one (from its
  packed checkpoints, in the kernel's state dtype: fp32 on SM90), eagerly and under breakable
  prefill CUDA graphs (the GDN layer runs outside the graph on metadata built from the live
  batch);
- ``gdn_taps.py`` beyond it: the other taps of the same pass from the same per-chunk states, and
  positions off that grid by a short recompute with SGLang's Triton kernel (from FlashInfer's
  fp32 checkpoints: the state differs from a pass ending there by fp32 rounding only);
- nothing under ``full`` prefill CUDA graphs (the captured body has no tracking unless SGLang's
  extra_buffer built it, and no hook runs at replay), with other GDN prefill kernels (CuTe DSL)
  or other linear-attention backends.

:func:`capture_of` reads that off a live worker (its backend, extend kernel, prefill graph
backend and state dtype); :func:`resolve_mode` turns ``--hybrid-tap-mode`` into the grid the cache
plans with and the line it logs. ``auto`` takes in-pass capture where the states are exact (what
a split would leave, in the pool's dtype) and the path was verified on the hardware it runs on
(``VERIFIED``); every other tap it cannot capture splits where the split pays
(``index/split_rule.py``). ``H200_DEFAULT`` is what a GPU deployment meets with SGLang's default
arguments on an H200; the replay's ``--tap-mode`` default follows it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

CHUNK = 64  # FLA's chunk in SGLang's GDN prefill kernels; SGLang's checkpoint grid at pages <= 64


class InPassCapture(NamedTuple):
    """What a model worker captures inside a prefill pass."""

    grid: int  # 0: nothing; 1: any position; g > 1: positions a multiple of g past the pass start
    path: str  # which mechanism ("cpu-worker", "sglang-tracking+gdn_taps", "none")
    kernel: str  # the GDN extend kernel ("triton", "flashinfer", ...; "-" off SGLang's worker)
    graph: str  # the prefill CUDA graph backend ("disabled", "breakable", "full"; "-")
    exact: bool  # the captured state equals what a pass ending there leaves, in the pool's dtype
    reason: str  # one line: why this grid

    @property
    def key(self) -> tuple[str, str]:
        return self.kernel, self.graph


# Paths on SGLang's GPU worker a GPU check has verified, with the record that did: the in-pass
# stage (benchmark/gpu/stage_inpass.py) compares each captured state with the state of a pass
# ending there, with SGLang's own kernel, eagerly and under breakable prefill graphs. None has
# run on a GPU yet. The Triton path is checked on the CPU under TRITON_INTERPRET=1
# (test/sglang/test_inpass_triton.py), but its states are the bf16 rounding of the exact ones,
# so ``auto`` would not pick it either way.
VERIFIED: dict[tuple[str, str], str] = {}

# What SGLang 0.5.23 resolves on an H200 (SM90) with its default arguments for Qwen3.5 /
# Qwen3-Next: the FlashInfer GDN prefill (``gdn_backend.flashinfer_gdn_prefill_default``: SM90,
# an fp32 state pool, chunked prefill <= 32768, 128-wide heads) under breakable prefill CUDA
# graphs (``cuda_graph_config.default_prefill_backend``: breakable on CUDA).
H200_DEFAULT = InPassCapture(
    1,
    "sglang-tracking+gdn_taps",
    "flashinfer",
    "breakable",
    True,
    "SGLang's prefill tracking with FlashInfer's fp32 checkpoints every 64 tokens of each "
    "request's extend, positions between them recomputed from there by SGLang's Triton kernel "
    "(fp32 rounding); the GDN layer runs outside the breakable prefill graph",
)

_KERNELS = {"TritonGDNKernel": "triton", "FlashInferGDNKernel": "flashinfer"}


def _none(kernel: str, graph: str, reason: str) -> InPassCapture:
    return InPassCapture(0, "none", kernel, graph, False, reason)


def graph_backend(runner: Any) -> str:
    """The prefill CUDA graph backend a model runner runs extends under."""
    graphs = getattr(runner, "prefill_cuda_graph_runner", None)
    if graphs is None or type(graphs).__name__ == "EagerRunner":
        return "disabled"
    return str(getattr(graphs, "prefill_backend_name", "unknown"))


def capture_of(worker: Any) -> InPassCapture:
    """What ``worker`` captures inside a pass (see the module contract)."""
    if getattr(worker, "state_taps", False):  # the CPU workers (``cpu/capture.py``)
        grid = int(getattr(worker, "state_tap_grid", 1))
        return InPassCapture(
            grid, "cpu-worker", "-", "-", True, "the CPU worker copies states in its model call"
        )
    runner = getattr(worker, "model_runner", None)
    backend = getattr(runner, "attn_backend", None)
    linear = getattr(backend, "linear_attn_backend", None)
    graph = graph_backend(runner)
    if linear is None or type(linear).__name__ != "GDNAttnBackend":
        return _none("-", graph, f"no GDN linear attention backend ({type(linear).__name__})")
    name = type(getattr(getattr(linear, "kernel_dispatcher", None), "extend_kernel", None))
    kernel = _KERNELS.get(name.__name__, name.__name__)
    if kernel not in ("triton", "flashinfer"):
        return _none(kernel, graph, f"the {kernel} GDN prefill offers no per-chunk states")
    if graph not in ("disabled", "breakable"):
        return _none(
            kernel,
            graph,
            f"{graph} prefill CUDA graphs replay the GDN layer inside the graph, where "
            f"neither SGLang's tracking (built only with extra_buffer) nor a hook runs",
        )
    if kernel == "triton":
        return InPassCapture(
            1,
            "sglang-tracking+gdn_taps",
            kernel,
            graph,
            False,
            "the Triton prefill's per-chunk states (bf16) and a short recompute off their grid",
        )
    pool = getattr(getattr(runner, "req_to_token_pool", None), "mamba_pool", None)
    dtype = getattr(getattr(getattr(pool, "mamba_cache", None), "temporal", None), "dtype", None)
    return H200_DEFAULT._replace(graph=graph, reason=f"{H200_DEFAULT.reason} (state {dtype})")


class TapModeChoice(NamedTuple):
    mode: str  # "split" or "zero-split"
    grid: int  # the cache's capture grid (0 with split)
    message: str  # what to log


def resolve_mode(asked: str, capture: InPassCapture) -> TapModeChoice:
    """``--hybrid-tap-mode`` against what the worker captures. ``zero-split`` on a worker that
    captures nothing raises ``ValueError`` (the caller names the flag)."""
    where = f"{capture.path}, GDN prefill {capture.kernel}, prefill graphs {capture.graph}"
    if asked == "split":
        return TapModeChoice("split", 0, f"split: asked for ({where})")
    if asked == "zero-split":
        if not capture.grid:
            raise ValueError(f"the model worker captures no state inside a pass: {capture.reason}")
        how = "" if capture.exact else "; states are bf16-rounded"
        return TapModeChoice(
            "zero-split", capture.grid, f"zero-split: asked for ({where}: {capture.reason}{how})"
        )
    if asked != "auto":
        raise ValueError(f"unknown tap mode {asked!r}")
    cpu = capture.path == "cpu-worker"
    if capture.grid and capture.exact and (cpu or capture.key in VERIFIED):
        check = "the CPU workers' tests" if cpu else VERIFIED[capture.key]
        return TapModeChoice(
            "zero-split", capture.grid, f"auto -> zero-split ({where}; verified by {check})"
        )
    if not capture.grid:
        why = capture.reason
    elif not capture.exact:
        why = f"{capture.reason}: not the exact state a split leaves"
    else:
        why = (
            f"{capture.reason}: not verified on a GPU yet "
            f"(benchmark/gpu/stage_inpass.py has not passed on this path)"
        )
    return TapModeChoice(
        "split", 0, f"auto -> split, splitting only where it pays ({where}; in-pass: {why})"
    )


def replay_default() -> TapModeChoice:
    """What ``auto`` resolves to on an H200 with SGLang's default arguments (the replay's
    ``--tap-mode`` default)."""
    return resolve_mode("auto", H200_DEFAULT)
