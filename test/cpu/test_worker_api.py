"""The CPU workers answer every TpModelWorker method SGLang may call, or refuse it clearly."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from sglang_hybrid.cpu.errors import CpuWorkerUnsupported
from sglang_hybrid.cpu.worker import CpuTpWorker


def _public_methods_of_sglang_tp_worker() -> set[str]:
    """Public members of SGLang's BaseTpWorker + TpModelWorker, read from the installed source.

    Read with ast, not getattr: once the CPU worker is installed the module attribute
    ``TpModelWorker`` is our replacement.
    """
    spec = importlib.util.find_spec("sglang.srt.managers.tp_worker")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("BaseTpWorker", "TpModelWorker"):
            for item in node.body:
                is_def = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_def and not item.name.startswith("_"):
                    names.add(item.name)
    assert "forward_batch_generation" in names and "get_worker_info" in names
    return names


def test_every_tp_worker_method_is_defined_explicitly():
    defined = {name for klass in CpuTpWorker.__mro__[:-1] for name in vars(klass)}
    missing = _public_methods_of_sglang_tp_worker() - defined
    assert not missing, f"CpuTpWorker lacks {sorted(missing)}"


@pytest.fixture
def token_worker(make_scheduler, qwen35_dir: Path):
    return make_scheduler(qwen35_dir, worker="tokens", random_seed=None).worker


def test_unknown_methods_are_refused_by_name(token_worker):
    with pytest.raises(NotImplementedError, match=r"TpModelWorker\.frobnicate"):
        token_worker.frobnicate()
    # Still an AttributeError, so feature probes see "absent" instead of crashing.
    assert not hasattr(token_worker, "frobnicate")
    assert getattr(token_worker, "frobnicate", "absent") == "absent"
    with pytest.raises(AttributeError):
        token_worker.__frobnicate__  # noqa: B018


@pytest.mark.parametrize(
    ("method", "feature"),
    [
        ("load_lora_adapter", "LoRA"),
        ("unload_lora_adapter", "LoRA"),
        ("init_weights_update_group", "weight updates"),
        ("get_weights_by_name", "weights by name"),
        ("forward_batch_embedding", "embedding"),
        ("forward_batch_split_prefill", "split prefill"),
        ("register_hisparse_coordinator", "HiSparse"),
    ],
)
def test_known_unsupported_features_name_themselves(token_worker, method: str, feature: str):
    with pytest.raises(CpuWorkerUnsupported, match=feature):
        getattr(token_worker, method)(None)


def test_supported_queries_answer(token_worker):
    assert token_worker.get_decode_cuda_graph_bs() == []
    assert token_worker.get_pad_input_ids_func() is None
    assert token_worker.is_dllm() is False
    assert token_worker.graph_memory_usage == {}
    req_pool, allocator = token_worker.get_memory_pool()
    assert req_pool is token_worker.model_runner.req_to_token_pool
    assert allocator is token_worker.model_runner.token_to_kv_pool_allocator
    info = token_worker.get_worker_info()
    assert info[0] == 4096 and info[2] == 8  # cpu_server_args pool sizes
    # ServerArgs left the seed unset: the worker still has a usable integer seed.
    assert isinstance(token_worker.random_seed, int)
    assert info[6] == token_worker.random_seed
