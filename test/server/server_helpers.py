"""Request helpers shared by the server tests, and the hybrid server their fixtures start."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_hybrid.cpu.process import ManagedProcess
from sglang_hybrid.cpu.server import CpuServer, ServerConfig


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def generate(
    server: ManagedProcess, ids: list[int], max_new: int = 8, headers: dict | None = None
) -> dict:
    """Greedy ``/generate`` on token ids (a server or a router); the reply (asserting HTTP 200)."""
    status, out = server.post_json(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}},
        headers=headers,
    )
    assert status == 200, out
    return out


def serve_hybrid(
    models: dict[str, Path],
    tmp: pytest.TempPathFactory,
    name: str,
    *extra: str,
    host_cache_mib: int = 64,
) -> Iterator[CpuServer]:
    """The tiny Qwen3-Next behind ``--radix-cache hybrid`` (chunk 128, a 64 MiB host tier unless
    given), with ``extra`` flags; its log in a temp dir as ``name``.log. For fixtures:
    ``yield from``."""
    cfg = ServerConfig(
        models["qwen3_next"],
        cache="hybrid",
        chunked_prefill_size=128,
        host_cache_mib=host_cache_mib,
        extra=list(extra),
    )
    with CpuServer(cfg, tmp.mktemp("server") / f"{name}.log", on_progress=print) as server:
        yield server
