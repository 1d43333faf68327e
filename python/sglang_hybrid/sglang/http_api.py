"""HTTP routes for compaction clients and operators (issue #16), added to SGLang's FastAPI app.

- ``POST /hybrid/boundaries``: the resume points on a prompt's path and where a cut lands
  (``boundaries.py`` answers in each scheduler through SGLang's control path);
- ``POST /hybrid/checkpoint``: make sure a state exists at a prefix's end (a one-token request
  whose endpoint is published wherever it falls), then report it; ``durable: true`` (optionally
  with ``ttl_s``) keeps it in the host tier until ``DELETE /hybrid/checkpoint`` or the TTL;
- ``GET /props`` and ``GET /slots``: llama.cpp's discovery endpoints, in its shape, with what
  applies (``docs/compaction.md`` lists the fields served and not served).

A prompt is given as ``input_ids``, ``text`` (tokenized as ``/generate`` tokenizes it) or chat
``messages`` (rendered with the served chat template, as ``/v1/chat/completions`` renders them).
Requests are validated by the models of ``api_models.py`` (unknown fields refused, strict types,
bounded numbers, the vocabulary and context checks of ``/generate``); every answer other than
200 has OpenAI's error shape (``api_errors.py``): 400 for a client's mistake naming the field,
404 when there is nothing there (no slot, no checkpoint, no durable pin to release, or the
``/hybrid`` routes on a server not running ``--radix-cache hybrid``), 405 for another method on
one of these paths, 409 / 503 when the cache's state refuses a pin now, 500 (never echoing the
exception) for a bug. The routes are added once, in the launching process, right before SGLang's
``launch_server`` starts the HTTP server (a BEFORE hook); ``--tokenizer-worker-num`` above 1
re-imports the app in worker processes without plugins, so the routes need one tokenizer worker.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from .api_errors import ApiError, bad_request, error_response, internal_error, json_response
from .api_models import (
    BoundariesRequest,
    CheckpointRequest,
    EmptyQuery,
    PromptRequest,
    ReleaseRequest,
    SlotsQuery,
    check_cut,
    check_prompt,
    parse,
    read_json,
)
from .boundaries import BOUNDARIES, PIN, SLOTS, UNPIN

logger = logging.getLogger(__name__)

PIN_TRIES = 100  # a durable pin waits up to PIN_TRIES * PIN_RETRY_S for the host copy
PIN_RETRY_S = 0.05
TTL_TASKS = "_sglang_hybrid_ttl_tasks"  # on the tokenizer manager: TTL releases not run yet

ROUTES_ATTR = "_sglang_hybrid_routes"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

Answer = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``http_server.launch_server``: add the routes to SGLang's app (once)."""
    from sglang.srt.entrypoints import http_server

    install(http_server.app)


def install(app: Any) -> None:
    if getattr(app.state, ROUTES_ATTR, False):
        return
    setattr(app.state, ROUTES_ATTR, True)
    routes: dict[str, dict[str, Callable[[Request], Awaitable[Any]]]] = {
        "/hybrid/boundaries": {"POST": boundaries_route},
        "/hybrid/checkpoint": {"POST": checkpoint_route, "DELETE": release_route},
        "/props": {"GET": props_route},
        "/slots": {"GET": slots_route},
    }
    for path, by_method in routes.items():
        for method, endpoint in by_method.items():
            app.add_api_route(path, endpoint, methods=[method])
        # Any other method answers 405 in our shape (FastAPI's own would be {"detail": ...}).
        others = [m for m in METHODS if m not in by_method]
        app.add_api_route(path, _method_not_allowed(sorted(by_method)), methods=others)


def _method_not_allowed(allowed: list[str]) -> Callable[[Request], Awaitable[Any]]:
    async def refuse(request: Request) -> Any:
        err = ApiError(
            405,
            f"{request.method} {request.url.path}: this route answers {' and '.join(allowed)}",
            code="method_not_allowed",
        )
        return error_response(err, headers={"Allow": ", ".join(allowed)})

    return refuse


def after_build_server_info(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``build_server_info`` (``/server_info``, ``/get_server_info``): what the cache
    offers a client, under ``hybrid_cache``."""
    from .flags import BACKEND

    if not isinstance(result, dict) or getattr(server_args, "radix_cache_backend", None) != BACKEND:
        return
    result["hybrid_cache"] = {
        "checkpoints": "full-state",
        "block_tokens": 64,
        "routes": ["/hybrid/boundaries", "/hybrid/checkpoint", "/props", "/slots"],
        "chat_breakpoints": "cache_control on a message (/v1/chat/completions, /v1/messages)",
    }


# ---------------------------------------------------------------- routes
async def boundaries_route(request: Request) -> Any:
    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(BoundariesRequest, body)
        ids = await _prompt_ids(request, tm, req)
        check_cut(req, len(ids))
        return await _ask(tm, BOUNDARIES, _query(req, ids))

    return await _serve(request, answer)


async def checkpoint_route(request: Request) -> Any:
    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(CheckpointRequest, body)
        ids = await _prompt_ids(request, tm, req)
        query = _query(req, ids)
        before = await _ask(tm, BOUNDARIES, query)
        have = [c for c in before["checkpoints"] if c["position"] == len(ids)]
        computed = 0
        if not have:
            computed = await _compute_endpoint(tm, ids, req)
            after = await _ask(tm, BOUNDARIES, query)
            have = [c for c in after["checkpoints"] if c["position"] == len(ids)]
            if not have:
                raise ApiError(
                    503,
                    "the prefix was computed but no state was kept at its end (no snapshot "
                    "slot was free); try again",
                    code="no_snapshot_slot",
                )
        point = have[0]
        if req.durable:
            # A pin with a TTL is released by this process's timer: not kept across a restart.
            point = await _make_durable(tm, {**query, "expires": req.ttl_s is not None})
            if req.ttl_s is not None:
                _release_later(tm, query, req.ttl_s)
        return {
            "checkpoint": point,
            "computed_tokens": computed,
            "prompt_tokens": len(ids),
            "ttl_s": req.ttl_s,
        }

    return await _serve(request, answer)


async def release_route(request: Request) -> Any:
    """``DELETE /hybrid/checkpoint``: a durable checkpoint goes back to normal retention (404
    when the prompt's end holds no checkpoint, or one that is not durable)."""

    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(ReleaseRequest, body)
        ids = await _prompt_ids(request, tm, req)
        return {"checkpoint": await _ask(tm, UNPIN, _query(req, ids))}

    return await _serve(request, answer)


async def _make_durable(tm: Any, query: dict[str, Any]) -> dict[str, Any]:
    """Pin the checkpoint at the prefix's end; its host copy may still be landing (the cache
    writes it through at release, off the scheduler thread), so ``not_ready`` is retried."""
    import asyncio

    for _ in range(PIN_TRIES - 1):
        try:
            return await _ask(tm, PIN, query)
        except ApiError as exc:
            if exc.code != "not_ready":
                raise
        await asyncio.sleep(PIN_RETRY_S)
    return await _ask(tm, PIN, query)


def _release_later(tm: Any, query: dict[str, Any], ttl_s: float) -> None:
    """Release the pin after ``ttl_s``: a control request like any other, so every TP rank
    releases it at the same point of its request stream (no rank reads a clock to decide)."""
    import asyncio

    async def release() -> None:
        await asyncio.sleep(ttl_s)
        try:
            await _ask(tm, UNPIN, query)
        except Exception as exc:  # the checkpoint may have been released or flushed since
            logger.info("durable checkpoint TTL release: %s", exc)

    # asyncio keeps only a weak reference to a task: hold it until it ran.
    pending: set[Any] = tm.__dict__.setdefault(TTL_TASKS, set())
    task = asyncio.get_running_loop().create_task(release())
    pending.add(task)
    task.add_done_callback(pending.discard)


async def props_route(request: Request) -> Any:
    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        sa = tm.server_args
        hybrid = _serves_hybrid(tm)
        n_ctx = int(getattr(tm, "context_len", 0) or 0)
        return {
            "model_path": sa.model_path,
            "model_alias": getattr(sa, "served_model_name", None) or sa.model_path,
            "n_ctx": n_ctx,
            "total_slots": int(getattr(sa, "max_running_requests", 0) or 0),
            "default_generation_settings": {"n_ctx": n_ctx},
            "chat_template": _chat_template(tm),
            "build_info": _build_info(),
            "modalities": {"vision": bool(getattr(tm.model_config, "is_multimodal", False))},
            # Not llama.cpp's: what the checkpoints are. Full-state: a checkpoint holds every
            # layer's state at its position (recurrent states and the KV before it), so a prompt
            # reaching it resumes there exactly; llama.cpp's hybrid checkpoints carry partial
            # state only.
            "checkpoints": {
                "served": hybrid,
                "full_state": hybrid,
                "partial_state_only": False,
                "query": "/hybrid/boundaries" if hybrid else None,
                "pin": "/hybrid/checkpoint" if hybrid else None,
                "grid_tokens": 64,
            },
        }

    return await _serve(request, answer, body=False, hybrid_only=False)


async def slots_route(request: Request) -> Any:
    """llama.cpp's ``GET /slots``: here a slot is one of the sequences the server finished most
    recently (most recent first), with the checkpoints on its path; ``?id_slot=N`` selects one
    (404 when there is no such slot) and ``?rid=...`` the one of a request id (404 when unknown).
    """

    async def answer(tm: Any, body: dict[str, Any]) -> Any:
        q = parse(SlotsQuery, dict(request.query_params))
        query: dict[str, Any] = {"limit": int(getattr(tm.server_args, "max_running_requests", 0))}
        if q.rid is not None:
            query["rid"] = q.rid
        slots = (await _ask(tm, SLOTS, query))["slots"]
        n_ctx = int(getattr(tm, "context_len", 0) or 0)
        for s in slots:
            s.update(n_ctx=n_ctx, is_processing=False, speculative=False)
        if q.id_slot is not None:
            i = int(q.id_slot)
            if i >= len(slots):
                raise ApiError(
                    404,
                    f"no slot {i}: the server holds {len(slots)} recent sequences "
                    f"(id_slot 0 to {len(slots) - 1})",
                    code="no_such_slot",
                    param="id_slot",
                )
            return slots[i]
        return slots

    return await _serve(request, answer, body=False, query=False)


# ---------------------------------------------------------------- plumbing
async def _serve(
    request: Request,
    answer: Answer,
    *,
    body: bool = True,
    query: bool = True,
    hybrid_only: bool = True,
) -> Any:
    """Run ``answer`` and shape what it returns or raises (see the module docstring).
    ``query``: the route takes no query parameters (any is refused as an unknown field)."""
    try:
        tm = _tokenizer_manager()
        if hybrid_only and not _serves_hybrid(tm):
            raise ApiError(
                404,
                f"{request.url.path}: this server does not run --radix-cache hybrid",
                code="hybrid_cache_off",
            )
        if query:
            parse(EmptyQuery, dict(request.query_params))
        data = read_json(await request.body()) if body else {}
        return json_response(await answer(tm, data))
    except ApiError as exc:
        return error_response(exc)
    except Exception:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(internal_error())


def _tokenizer_manager() -> Any:
    from sglang.srt.entrypoints import http_server

    return http_server.get_global_state().tokenizer_manager


def _serves_hybrid(tm: Any) -> bool:
    from .flags import is_selected

    return is_selected(tm.server_args) and not tm.server_args.disable_radix_cache


async def _ask(tm: Any, method: str, body: dict[str, Any]) -> dict[str, Any]:
    """One control request to every scheduler; the answer of the DP rank holding the most."""
    from sglang.srt.managers.io_struct import DumperControlReqInput

    outs = await tm.dumper_control(DumperControlReqInput(method=method, body=body))
    failed = [o for o in outs if not o.success]
    if failed:
        o = failed[0]
        detail = (o.response[0] if o.response else {}).get("error")
        if not isinstance(detail, dict):  # "internal error: ...", logged by the scheduler
            logger.error("%s failed in the scheduler: %s", method, o.error)
            raise internal_error()
        raise ApiError(
            int(detail.get("status", 400)),
            o.error,
            code=str(detail.get("code", "invalid_request")),
            param=detail.get("param"),
        )
    answers = [o.response[0] for o in outs if o.response]
    if not answers:
        raise RuntimeError(f"no scheduler answered {method}")
    if len(answers) == 1:
        return answers[0]
    # Data parallelism: each DP rank has its own cache; report the one that holds the most and
    # every rank's view (a router places the request, not this answer).
    best = max(answers, key=lambda a: a.get("reusable_now", {}).get("tokens", 0))
    return {**best, "dp_ranks": answers}


def _query(req: PromptRequest, ids: list[int]) -> dict[str, Any]:
    q: dict[str, Any] = {"input_ids": ids, **req.namespace()}
    if isinstance(req, BoundariesRequest):
        q["snap_tolerance"] = req.snap_tolerance
        if req.cut is not None:
            q["cut"] = req.cut
    return q


async def _prompt_ids(request: Request, tm: Any, req: PromptRequest) -> list[int]:
    """The prompt's token ids, checked as ``/generate`` checks them (``check_prompt``)."""
    field = req.prompt_field
    if req.input_ids is not None:
        ids = list(req.input_ids)
    elif tm.tokenizer is None:
        raise bad_request(
            f"the server has no tokenizer (--skip-tokenizer-init): send input_ids, not {field}",
            code="no_tokenizer",
            param=field,
        )
    elif req.text is not None:
        ids = list(tm.tokenizer.encode(req.text))
    else:
        ids = _render_messages(request, req)
    check_prompt(
        ids,
        field,
        vocab_size=int(getattr(tm.model_config, "vocab_size", 0) or 0),
        context_len=int(getattr(tm, "context_len", 0) or 0),
    )
    return ids


def _render_messages(request: Request, req: PromptRequest) -> list[int]:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import TokenizeRequest

    fields: dict[str, Any] = {"messages": req.messages}
    for name in ("tools", "chat_template_kwargs", "add_generation_prompt"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    try:
        tokenize = TokenizeRequest(**fields)
        serving = request.app.state.openai_serving_tokenize
        ids = serving._tokenize_chat_request(tokenize)
    except (ValidationError, ValueError, TypeError, KeyError) as exc:
        raise bad_request(
            f"messages could not be rendered with the served chat template: {_first_line(exc)}",
            code="invalid_messages",
            param="messages",
        ) from None
    return list(ids)


def _first_line(exc: BaseException) -> str:
    """An exception's message without a traceback or pydantic's URL lines."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        errs = exc.errors(include_url=False)
        return "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:3]
        )
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


async def _compute_endpoint(tm: Any, ids: list[int], req: PromptRequest) -> int:
    """Run the prefix as a one-token request that asks for its endpoint wherever it falls."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from .hints import checkpoint_envelope

    obj = GenerateReqInput(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        kv_hints=checkpoint_envelope(),
        extra_key=req.extra_key,
        cache_salt=req.cache_salt,
    )
    last: Any = None
    try:
        async for chunk in tm.generate_request(obj, None):
            last = chunk
    except ValueError as exc:  # SGLang's own validation of a generation request
        raise bad_request(_first_line(exc), code="invalid_prompt", param=req.prompt_field) from None
    meta = last.get("meta_info", {}) if isinstance(last, dict) else {}
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        # The server refused the prefix (the CPU worker's admission, say): the client's request.
        raise ApiError(
            int(finish.get("status_code") or 400),
            f"the server refused to compute the prefix: {finish.get('message', 'aborted')}",
            code="prompt_refused",
            param=req.prompt_field,
        )
    return int(meta.get("prompt_tokens", len(ids))) - int(meta.get("cached_tokens", 0))


def _chat_template(tm: Any) -> str | None:
    tok = getattr(tm, "tokenizer", None)
    template = getattr(tok, "chat_template", None)
    return template if isinstance(template, str) else None


def _build_info() -> str:
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return f"sglang {version('sglang')} + sglang-hybrid {version('sglang-hybrid')}"
