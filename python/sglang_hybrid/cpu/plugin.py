"""SGLang plugin entry point for the CPU workers: ``--hybrid-cpu-worker {model,tokens}``.

Opt-in only: without the flag (or the environment variable it sets) nothing is replaced. With it,
SGLang's ``TpModelWorker`` becomes one of our CPU workers in every process SGLang spawns: the flag
is parsed in the launching process, which exports ``SGLANG_HYBRID_CPU_WORKER`` (children inherit
the environment) and installs the worker; each child's ``register`` (SGLang loads plugins in every
process) installs it before the scheduler builds its worker. The rest of a CPU server's flags
(device, attention backend, dtype, sizes) stay explicit on the command line: see
``docs/cpu-worker.md``.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SGLANG_HYBRID_CPU_WORKER"
KINDS = ("model", "tokens")


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    sa = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{sa}.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{sa}.from_cli_args", _from_cli_args, HookType.AFTER)
    kind = os.environ.get(ENV)
    if kind:
        _install(kind)


def _install(kind: str) -> None:
    from .install import install_cpu_worker

    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind!r}: expected one of {', '.join(KINDS)}")
    install_cpu_worker(kind)  # type: ignore[arg-type]


def _add_cli_args(result: Any, parser: Any) -> None:
    parser.add_argument(
        "--hybrid-cpu-worker",
        choices=KINDS,
        default=None,
        help="sglang-hybrid: run on the CPU with a stand-in for SGLang's model worker: 'model' "
        "runs a tiny transformers model in float32 with SGLang's pools as its state, 'tokens' "
        "computes nothing and returns deterministic tokens. For tests and demos without a GPU.",
    )


def _from_cli_args(server_args: Any, cls: Any, args: Any) -> None:
    kind = getattr(args, "hybrid_cpu_worker", None)
    if kind:
        os.environ[ENV] = kind  # spawned scheduler / detokenizer processes inherit it
        _install(kind)
