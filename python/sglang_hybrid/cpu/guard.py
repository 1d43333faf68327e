"""Keep SGLang's scheduler alive when a control request fails on the CPU.

SGLang's scheduler handles control requests (weight updates, LoRA, memory release, profiling,
...) inline in its event loop; an exception there kills the scheduler and the whole server. On a
CPU server they fail two ways: the CPU worker refuses the feature (``CpuWorkerUnsupported``), or
SGLang's own handler assumes CUDA (``torch.cuda.synchronize`` in memory release, for one).
``guard_dispatcher`` (an AFTER hook on ``Scheduler.init_request_dispatcher``, applied only in a
process where a CPU worker is installed) makes the scheduler's request dispatcher turn such an
exception into a failed reply of the type the caller waits for: the request's ``...ReqOutput``
twin with ``success=False`` and the message, or with every required field empty when the type
has no ``success``; the traceback goes to the log. Generation requests are not guarded: an
exception there is a bug that must surface, not a refusal.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import CpuWorkerUnsupported

logger = logging.getLogger(__name__)

_UNGUARDED = frozenset({"TokenizedGenerateReqInput", "BatchTokenizedGenerateReqInput"})


def guard_dispatcher(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.utils import TypeBasedDispatcher

    from .worker import CpuTpWorker

    if CpuTpWorker._selected is None:  # no CPU worker in this process
        return
    dispatcher = scheduler._request_dispatcher
    if type(dispatcher) is TypeBasedDispatcher:
        dispatcher.__class__ = _guarded_class(TypeBasedDispatcher)


def _guarded_class(base: type) -> type:
    class GuardedDispatcher(base):
        def __call__(self, obj: Any) -> Any:
            if type(obj).__name__ in _UNGUARDED:
                return super().__call__(obj)
            try:
                return super().__call__(obj)
            except CpuWorkerUnsupported as e:
                logger.error("%s refused: %s", type(obj).__name__, e)
                return failed_reply(obj, str(e))
            except Exception as e:
                logger.exception("%s failed on the CPU server", type(obj).__name__)
                return failed_reply(obj, f"{type(obj).__name__} failed on the CPU server: {e}")

    return GuardedDispatcher


def failed_reply(request: Any, message: str) -> Any:
    """The reply type matching ``request`` filled as a failure, or None when there is none."""
    import msgspec
    from sglang.srt.managers import io_struct

    name = type(request).__name__
    if name.endswith("ReqInput"):
        twin = name[: -len("Input")] + "Output"
    elif name.endswith("Req"):
        twin = name + "Output"
    else:
        return None
    cls = getattr(io_struct, twin, None)
    if cls is None:
        return None
    values: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        if f.name == "success":
            values["success"] = False
        elif f.name == "message":
            values["message"] = message
        elif f.required:
            values[f.name] = None
    if hasattr(request, "rid") and "rid" in {f.name for f in msgspec.structs.fields(cls)}:
        values["rid"] = request.rid
    try:
        return cls(**values)
    except (TypeError, msgspec.ValidationError):
        logger.error("cannot build a %s reply for the refused %s", cls.__name__, name)
        return None
