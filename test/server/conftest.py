"""One real ``python -m sglang.launch_server --radix-cache hybrid`` on the CPU for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import serve_hybrid

from sglang_hybrid.cpu.server import CpuServer


@pytest.fixture(scope="session")
def hybrid_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    yield from serve_hybrid(tiny_models, tmp_path_factory, "hybrid")
