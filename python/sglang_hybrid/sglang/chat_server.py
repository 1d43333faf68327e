"""Tap hints for OpenAI chat requests, computed where SGLang renders the chat template.

Two hooks on SGLang's ``OpenAIServingChat`` (main process): around ``_convert_to_internal_request``
a per-thread collector is opened (SGLang converts requests in a thread pool, so per-request state
must be thread-local); around ``_render_and_encode_chat_template`` the full prompt is rendered as
usual and, while a collector is open, the message boundaries are found by rendering each prefix
of the conversation (``chat_hints.message_boundaries``). The hints travel to the scheduler in the
request's ``kv_hints`` envelope, unless the caller already set one. A template that cannot render
a prefix costs the request its hints, never the request.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .chat_hints import hints_envelope, message_boundaries

logger = logging.getLogger(__name__)


class _Collector(threading.local):
    active: bool = False
    rendering: bool = False
    hints: list | None = None


_TLS = _Collector()  # per-thread state of an in-flight conversion (not shared across threads)


def _uses_hybrid(serving: Any) -> bool:
    from .flags import BACKEND

    sa = getattr(getattr(serving, "tokenizer_manager", None), "server_args", None)
    return getattr(sa, "radix_cache_backend", None) == BACKEND


def around_convert(orig: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    if not _uses_hybrid(serving):  # other caches pay nothing for the plugin being installed
        return orig(serving, request, *args, **kwargs)
    _TLS.active, _TLS.hints = True, None
    try:
        adapted, req = orig(serving, request, *args, **kwargs)
    finally:
        _TLS.active = False
    hints, _TLS.hints = _TLS.hints, None
    if hints and getattr(adapted, "kv_hints", None) is None:
        adapted.kv_hints = hints_envelope(hints)
    return adapted, req


def around_render(orig: Any, serving: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
    out = orig(serving, messages, *args, **kwargs)
    if not _TLS.active or _TLS.rendering or not kwargs.get("add_generation_prompt", True):
        return out
    _TLS.rendering = True
    try:

        def render(msgs: Any, gen: bool) -> list[int]:
            kw = {**kwargs, "add_generation_prompt": gen, "use_cache": False}
            return list(orig(serving, list(msgs), *args, **kw)[0])

        _TLS.hints = message_boundaries(render, messages, list(out[0]))
    except Exception as e:  # a hint can only add reuse: never fail the request for it
        logger.warning("chat tap hints skipped: %s", e)
        _TLS.hints = None
    finally:
        _TLS.rendering = False
    return out
