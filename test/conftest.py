"""Shared pytest setup: the package on the path, offline Hugging Face, tiny models, schedulers.

SGLang builds its process groups once per process, so at most one ``InProcessScheduler`` is alive
at a time; ``make_scheduler`` closes the previous one before building the next and closes the
last one at the end of the test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))
# Everything here is generated locally; a download attempt must fail rather than hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Where SGLang's pools live in the scheduler and pool tests: "cpu" (default), or "cuda" when the
# GPU check (benchmark/gpu/check_backend.py) runs the same tests on a GPU.
TEST_DEVICE = os.environ.get("SGLANG_HYBRID_TEST_DEVICE", "cpu")


def pytest_addoption(parser):
    parser.addoption(
        "--index-ops",
        type=int,
        default=20_000,
        help="operations in the seeded random index test (make stress-index runs more)",
    )
    parser.addoption(
        "--reliability-ops",
        type=int,
        default=12_000,
        help="operations of the scheduler reliability suite, over all configs (make stress: 1e6)",
    )
    parser.addoption(
        "--reliability-seed",
        type=int,
        default=0,
        help="base seed of the reliability suite (a failure prints the seed to rerun with)",
    )


@pytest.fixture(scope="session")
def sglang_plugin() -> None:
    """The plugin registered and SGLang's hooks applied, once per session (``register`` is
    idempotent); the scheduler suites depend on it through a one-line autouse fixture."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both tiny architectures, written once into a session temp dir."""
    from sglang_hybrid.cpu.tiny_model import ARCHS, write_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: write_tiny_model(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen35_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen3_5"]


@pytest.fixture(scope="session")
def qwen3_next_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen3_next"]


def load_script(relpath: str) -> Any:
    """A script of the repository that is not a package module (``benchmark/``, ``examples/``),
    imported from its path under the repository root."""
    import importlib.util

    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def script() -> Callable[[str], Any]:
    """``script("benchmark/replay/summary.py")``: that script as a module (``load_script``)."""
    return load_script


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., Any]]:
    """``make_scheduler(model_dir, **kwargs)``: a fresh InProcessScheduler (one alive at a time)."""
    from sglang_hybrid.cpu.loop import InProcessScheduler

    live: list[InProcessScheduler] = []

    def build(model_dir: Path, **kwargs: Any) -> InProcessScheduler:
        while live:
            live.pop().close()
        if TEST_DEVICE != "cpu":
            kwargs.setdefault("device", TEST_DEVICE)
        sched = InProcessScheduler(model_dir, **kwargs)
        live.append(sched)
        return sched

    yield build
    while live:
        live.pop().close()
