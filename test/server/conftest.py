"""One real ``python -m sglang.launch_server --radix-cache hybrid`` on the CPU for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_hybrid.cpu.server import CpuServer, ServerConfig


@pytest.fixture(scope="session")
def hybrid_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    cfg = ServerConfig(
        tiny_models["qwen3_next"], cache="hybrid", chunked_prefill_size=128, host_cache_mib=64
    )
    log = tmp_path_factory.mktemp("server") / "hybrid.log"
    with CpuServer(cfg, log, on_progress=print) as server:
        yield server
