"""``InProcessScheduler`` arguments for the scheduler-level tests (``test/sglang``,
``test/reliability``): one backend, one page size and chunk, tiny pools by default."""

from __future__ import annotations

from typing import Any


def scheduler_args(
    backend: str = "hybrid",
    *,
    page: int = 1,
    chunk: int = 2048,
    opts: dict | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """``backend``: "hybrid" (``opts``: ``HybridOptions`` fields, host tier off unless given),
    "builtin" (SGLang's own cache) or "none" (``disable_radix_cache``, the uncached reference).
    ``total`` / ``running`` / ``mamba`` size the pools; other keywords go to the scheduler."""
    from sglang_hybrid.sglang.flags import HybridOptions

    args: dict[str, Any] = dict(
        page_size=page,
        chunked_prefill_size=chunk,
        max_total_tokens=kw.pop("total", 8192),
        max_running_requests=kw.pop("running", 4),
        max_mamba_cache_size=kw.pop("mamba", 24),
    )
    if backend == "hybrid":
        args["radix_cache_backend"] = "hybrid"
        args["server_args_attrs"] = {
            "_hybrid_options": HybridOptions(**{"host_cache_mib": 0, **(opts or {})})
        }
    elif backend == "none":
        args["disable_radix_cache"] = True
    elif backend != "builtin":
        raise ValueError(f"backend {backend!r}: hybrid, builtin or none")
    args.update(kw)
    return args
