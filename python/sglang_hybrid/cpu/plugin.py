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
from typing import TYPE_CHECKING, Any

from .guard import guard_dispatcher

if TYPE_CHECKING:
    from .install import WorkerKind

ENV = "SGLANG_HYBRID_CPU_WORKER"
KINDS: tuple[WorkerKind, ...] = ("model", "tokens")


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    sa = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{sa}.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{sa}.from_cli_args", _from_cli_args, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        _refuse_what_the_worker_cannot_run,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
        guard_dispatcher,
        HookType.AFTER,
    )
    from .spec_register import register_algorithm

    register_algorithm()  # --speculative-algorithm CPU_MTP (inert unless chosen)
    kind = os.environ.get(ENV)
    if kind:
        _install(kind)


def _install(kind: str) -> None:
    from .install import install_cpu_worker

    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind!r}: expected one of {', '.join(KINDS)}")
    install_cpu_worker(kind)


def _refuse_what_the_worker_cannot_run(scheduler: Any, req: Any, *args: Any, **kw: Any) -> None:
    """Abort a request the CPU worker cannot compute, the way SGLang aborts invalid input.

    ``set_finish_with_abort`` before queueing makes SGLang answer the client with the message
    (HTTP 400) and never schedule the request; an exception in a forward pass instead would kill
    the scheduler and with it the server.
    """
    from .worker import CpuTpWorker

    worker = getattr(scheduler, "tp_worker", None)
    if not isinstance(worker, CpuTpWorker) or req.finished():
        return
    missing = worker.unsupported_request_features(req)
    if missing:
        req.set_finish_with_abort(
            f"the sglang_hybrid CPU worker does not support {', '.join(missing)}"
        )


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
