"""Tap hints for OpenAI chat requests, computed where SGLang renders the chat template.

Two hooks on SGLang's ``OpenAIServingChat`` (main process): around ``_convert_to_internal_request``
a per-thread collector is opened (SGLang converts requests in a thread pool, so per-request state
must be thread-local); around ``_render_and_encode_chat_template`` the full prompt is rendered as
usual and, while a collector is open, the message boundaries are found by rendering each prefix
of the conversation (``chat_hints.message_boundaries``). The hints travel to the scheduler in the
request's ``kv_hints`` envelope, unless the caller already set one. A template that cannot render
a prefix costs the request its hints, never the request.

Client breakpoints (issue #16): a message carrying ``cache_control`` (``{"type": "ephemeral"}``,
on the message or on one of its content parts), as Anthropic- and OpenAI-compatible clients send
it, makes that message's end an explicit tap. SGLang's request models drop unknown fields, so an
async hook around ``handle_request`` (``/v1/chat/completions``) or ``handle_messages``
(``/v1/messages``) reads them from the raw JSON body (already parsed and cached by FastAPI) and
marks the request object; for ``/v1/messages`` the marked Anthropic messages are mapped onto the
chat messages SGLang converts them to (a message may become several) by converting each marked
prefix. Marks only ever add a tap; a body that cannot be read marks nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .chat_hints import hints_envelope, message_boundaries

logger = logging.getLogger(__name__)


MARKS_ATTR = "_sglang_hybrid_cache_control"  # on SGLang's request objects: marked messages


class _Collector(threading.local):
    active: bool = False
    rendering: bool = False
    hints: list | None = None
    explicit: frozenset[int] = frozenset()


_TLS = _Collector()  # per-thread state of an in-flight conversion (not shared across threads)


def _uses_hybrid(serving: Any) -> bool:
    from .flags import is_selected

    return is_selected(getattr(getattr(serving, "tokenizer_manager", None), "server_args", None))


def around_convert(orig: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    if not _uses_hybrid(serving):  # other caches pay nothing for the plugin being installed
        return orig(serving, request, *args, **kwargs)
    _TLS.active, _TLS.hints = True, None
    _TLS.explicit = frozenset(getattr(request, MARKS_ATTR, None) or ())
    try:
        adapted, req = orig(serving, request, *args, **kwargs)
    finally:
        _TLS.active = False
        _TLS.explicit = frozenset()
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

        _TLS.hints = message_boundaries(render, messages, list(out[0]), _TLS.explicit)
    except Exception as e:  # a hint can only add reuse: never fail the request for it
        logger.warning("chat tap hints skipped: %s", e)
        _TLS.hints = None
    finally:
        _TLS.rendering = False
    return out


# ---------------------------------------------------------------- cache_control breakpoints
def _marked(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("cache_control"), dict)


def cache_control_marks(messages: Any) -> list[int]:
    """Indices of the messages carrying ``cache_control``, on the message or on a content part."""
    out: list[int] = []
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        if _marked(m) or (isinstance(parts, list) and any(_marked(p) for p in parts)):
            out.append(i)
    return out


async def _raw_body(raw_request: Any) -> Any:
    try:
        return await raw_request.json()  # parsed once by FastAPI and cached
    except Exception:
        return None


def _mark(request: Any, marks: Any) -> None:
    # SGLang's pydantic request models keep no unknown field; the marks ride as a plain attribute.
    object.__setattr__(request, MARKS_ATTR, marks)


async def around_handle_request(
    orig: Any, serving: Any, request: Any, raw_request: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``OpenAIServingChat.handle_request`` (``/v1/chat/completions``)."""
    if _uses_hybrid(serving) and raw_request is not None:
        body = await _raw_body(raw_request)
        marks = cache_control_marks(body.get("messages") if isinstance(body, dict) else None)
        if marks:
            _mark(request, marks)
    return await orig(serving, request, raw_request, *args, **kwargs)


async def around_handle_messages(
    orig: Any, serving: Any, request: Any, raw_request: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``AnthropicServing.handle_messages`` (``/v1/messages``): the marked Anthropic
    messages, and whether a ``system`` block carries ``cache_control``."""
    chat = getattr(serving, "openai_serving_chat", None)
    if chat is not None and _uses_hybrid(chat) and raw_request is not None:
        body = await _raw_body(raw_request)
        if isinstance(body, dict):
            system = body.get("system")
            system_marked = isinstance(system, list) and any(_marked(b) for b in system)
            marks = cache_control_marks(body.get("messages"))
            if marks or system_marked:
                _mark(request, (system_marked, marks))
    return await orig(serving, request, raw_request, *args, **kwargs)


def around_anthropic_convert(orig: Any, serving: Any, request: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``AnthropicServing._convert_to_chat_completion_request``: carry the marks onto the
    chat request, at the chat message each marked Anthropic message ends with."""
    chat_request = orig(serving, request, *args, **kw)
    marked = getattr(request, MARKS_ATTR, None)
    if not marked:
        return chat_request
    try:
        system_marked, marks = marked
        out: set[int] = set()
        msgs = chat_request.messages
        if system_marked and msgs and getattr(msgs[0], "role", None) in ("system", "developer"):
            out.add(0)
        for i in marks:
            prefix = request.model_copy(update={"messages": request.messages[: i + 1]})
            out.add(len(orig(serving, prefix, *args, **kw).messages) - 1)
        _mark(chat_request, sorted(out))
    except Exception as e:  # a breakpoint can only add reuse: never fail the request for it
        logger.warning("cache_control breakpoints skipped: %s", e)
    return chat_request
