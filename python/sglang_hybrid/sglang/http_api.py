"""HTTP routes for compaction clients and operators (issue #16), added to SGLang's FastAPI app.

- ``POST /hybrid/boundaries``: the resume points on a prompt's path and where a cut lands
  (``boundaries.py`` answers in each scheduler through SGLang's control path);
- ``POST /hybrid/checkpoint``: make sure a state exists at a prefix's end (a one-token request
  whose endpoint is published wherever it falls), then report it; ``durable: true`` (optionally
  with ``ttl_s``) keeps it in the host tier until ``DELETE /hybrid/checkpoint`` or the TTL;
- ``GET /props`` and ``GET /slots``: llama.cpp's discovery endpoints, in its shape, with what
  applies (``docs/boundary-api.md`` lists the fields served and not served).

A prompt is given as ``input_ids``, ``text`` (tokenized as ``/generate`` tokenizes it) or chat
``messages`` (rendered with the served chat template, as ``/v1/chat/completions`` renders them).
Bad input answers 400 with the reason; a server not running ``--radix-cache hybrid`` answers 404
on the ``/hybrid`` routes. The routes are added once, in the launching process, right before
SGLang's ``launch_server`` starts the HTTP server (a BEFORE hook); ``--tokenizer-worker-num`` above
1 re-imports the app in worker processes without plugins, so the routes need one tokenizer worker.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request

from .boundaries import BOUNDARIES, DEFAULT_SNAP_TOLERANCE, PIN, SLOTS, UNPIN, _is_int

logger = logging.getLogger(__name__)

PIN_TRIES = 100  # a durable pin waits up to PIN_TRIES * PIN_RETRY_S for the host copy
PIN_RETRY_S = 0.05
TTL_TASKS = "_sglang_hybrid_ttl_tasks"  # on the tokenizer manager: TTL releases not run yet

ROUTES_ATTR = "_sglang_hybrid_routes"


class BadRequest(ValueError):
    """The client's mistake: answered 400 with this message."""


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``http_server.launch_server``: add the routes to SGLang's app (once)."""
    from sglang.srt.entrypoints import http_server

    install(http_server.app)


def install(app: Any) -> None:
    if getattr(app.state, ROUTES_ATTR, False):
        return
    setattr(app.state, ROUTES_ATTR, True)
    app.add_api_route("/hybrid/boundaries", boundaries_route, methods=["POST"])
    app.add_api_route("/hybrid/checkpoint", checkpoint_route, methods=["POST"])
    app.add_api_route("/hybrid/checkpoint", release_route, methods=["DELETE"])
    app.add_api_route("/props", props_route, methods=["GET"])
    app.add_api_route("/slots", slots_route, methods=["GET"])


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
        ids = await _prompt_ids(request, tm, body)
        query = _query(body, ids)
        return await _ask(tm, BOUNDARIES, query)

    return await _serve(request, answer)


async def checkpoint_route(request: Request) -> Any:
    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        durable = body.get("durable", False)
        ttl = body.get("ttl_s")
        if not isinstance(durable, bool):
            raise BadRequest("durable must be true or false")
        if ttl is not None and (not durable or not _is_number(ttl) or ttl <= 0):
            raise BadRequest("ttl_s must be a positive number of seconds, with durable: true")
        ids = await _prompt_ids(request, tm, body)
        query = _query(body, ids)
        if query.get("cut") is not None:
            raise BadRequest("/hybrid/checkpoint pins the prefix's end: drop cut")
        before = await _ask(tm, BOUNDARIES, query)
        have = [c for c in before["checkpoints"] if c["position"] == len(ids)]
        computed = 0
        if not have:
            computed = await _compute_endpoint(tm, ids, body)
            after = await _ask(tm, BOUNDARIES, query)
            have = [c for c in after["checkpoints"] if c["position"] == len(ids)]
            if not have:
                raise RuntimeError(
                    "the prefix was computed but no state was kept at its end (no snapshot slot "
                    "was free); try again"
                )
        point = have[0]
        if durable:
            # A pin with a TTL is released by this process's timer: not kept across a restart.
            point = await _make_durable(tm, {**query, "expires": ttl is not None})
            if ttl is not None:
                _release_later(tm, query, float(ttl))
        return {
            "checkpoint": point,
            "computed_tokens": computed,
            "prompt_tokens": len(ids),
            "ttl_s": ttl,
        }

    return await _serve(request, answer)


async def release_route(request: Request) -> Any:
    """``DELETE /hybrid/checkpoint``: a durable checkpoint goes back to normal retention."""

    async def answer(tm: Any, body: dict[str, Any]) -> dict[str, Any]:
        ids = await _prompt_ids(request, tm, body)
        return {"checkpoint": await _ask(tm, UNPIN, _query(body, ids))}

    return await _serve(request, answer)


async def _make_durable(tm: Any, query: dict[str, Any]) -> dict[str, Any]:
    """Pin the checkpoint at the prefix's end; its host copy may still be landing (the cache
    writes it through at release, off the scheduler thread), so "not ... yet" is retried."""
    import asyncio

    for _ in range(PIN_TRIES - 1):
        try:
            return await _ask(tm, PIN, query)
        except BadRequest as exc:
            if "yet" not in str(exc):
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
    from fastapi.responses import ORJSONResponse

    tm = _tokenizer_manager()
    sa = tm.server_args
    hybrid = _serves_hybrid(tm)
    n_ctx = int(getattr(tm, "context_len", 0) or 0)
    out: dict[str, Any] = {
        "model_path": sa.model_path,
        "model_alias": getattr(sa, "served_model_name", None) or sa.model_path,
        "n_ctx": n_ctx,
        "total_slots": int(getattr(sa, "max_running_requests", 0) or 0),
        "default_generation_settings": {"n_ctx": n_ctx},
        "chat_template": _chat_template(tm),
        "build_info": _build_info(),
        "modalities": {"vision": bool(getattr(tm.model_config, "is_multimodal", False))},
        # Not llama.cpp's: what the checkpoints are. Full-state: a checkpoint holds every layer's
        # state at its position (recurrent states and the KV before it), so a prompt reaching it
        # resumes there exactly; llama.cpp's hybrid checkpoints carry partial state only.
        "checkpoints": {
            "served": hybrid,
            "full_state": hybrid,
            "partial_state_only": False,
            "query": "/hybrid/boundaries" if hybrid else None,
            "pin": "/hybrid/checkpoint" if hybrid else None,
            "grid_tokens": 64,
        },
    }
    return ORJSONResponse(out)


async def slots_route(request: Request) -> Any:
    """llama.cpp's ``GET /slots``: here a slot is one of the sequences the server finished most
    recently (most recent first), with the checkpoints on its path; ``?id_slot=N`` selects one and
    ``?rid=...`` the one of a request id."""

    async def answer(tm: Any, body: dict[str, Any]) -> Any:
        q = request.query_params
        query: dict[str, Any] = {"limit": int(getattr(tm.server_args, "max_running_requests", 0))}
        if q.get("rid"):
            query["rid"] = q["rid"]
        slots = (await _ask(tm, SLOTS, query))["slots"]
        n_ctx = int(getattr(tm, "context_len", 0) or 0)
        for s in slots:
            s.update(n_ctx=n_ctx, is_processing=False, speculative=False)
        if q.get("id_slot") is not None:
            try:
                i = int(q["id_slot"])
            except ValueError as exc:
                raise BadRequest(f"id_slot must be an integer, got {q['id_slot']!r}") from exc
            if not 0 <= i < len(slots):
                raise LookupError(f"no slot {i}: the server holds {len(slots)} recent sequences")
            return slots[i]
        return slots

    return await _serve(request, answer, body_required=False)


# ---------------------------------------------------------------- plumbing
async def _serve(request: Any, answer: Any, *, body_required: bool = True) -> Any:
    from fastapi.responses import ORJSONResponse

    tm = _tokenizer_manager()
    if not _serves_hybrid(tm):
        return ORJSONResponse(
            status_code=404,
            content={"error": "this server does not run --radix-cache hybrid"},
        )
    try:
        body: dict[str, Any] = {}
        if body_required:
            try:
                body = await request.json()
            except ValueError as exc:
                raise BadRequest(f"the body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
        return ORJSONResponse(await answer(tm, body))
    except BadRequest as exc:
        return ORJSONResponse(status_code=400, content={"error": str(exc)})
    except LookupError as exc:
        return ORJSONResponse(status_code=404, content={"error": str(exc)})
    except Exception as exc:
        logger.exception("%s failed", request.url.path)
        return ORJSONResponse(status_code=500, content={"error": f"internal error: {exc}"})


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
    failed = [o.error for o in outs if not o.success]
    if failed:
        if any(e.startswith("internal error") for e in failed):
            raise RuntimeError(failed[0])
        raise BadRequest(failed[0])
    answers = [o.response[0] for o in outs if o.response]
    if not answers:
        raise RuntimeError(f"no scheduler answered {method}")
    if len(answers) == 1:
        return answers[0]
    # Data parallelism: each DP rank has its own cache; report the one that holds the most and
    # every rank's view (a router places the request, not this answer).
    best = max(answers, key=lambda a: a.get("reusable_now", {}).get("tokens", 0))
    return {**best, "dp_ranks": answers}


def _query(body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    q: dict[str, Any] = {"input_ids": ids}
    cut = body.get("cut")
    if cut is not None:
        if not _is_int(cut) or not 0 <= cut <= len(ids):
            raise BadRequest(f"cut must be a token position in [0, {len(ids)}], got {cut!r}")
        q["cut"] = cut
    tol = body.get("snap_tolerance", DEFAULT_SNAP_TOLERANCE)
    if not _is_int(tol) or tol < 0:
        raise BadRequest(f"snap_tolerance must be a non-negative integer, got {tol!r}")
    q["snap_tolerance"] = tol
    for name in ("extra_key", "cache_salt"):
        if body.get(name) is not None:
            if not isinstance(body[name], str):
                raise BadRequest(f"{name} must be a string")
            q[name] = body[name]
    return q


async def _prompt_ids(request: Any, tm: Any, body: dict[str, Any]) -> list[int]:
    given = [k for k in ("input_ids", "text", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("give the prompt as exactly one of input_ids, text or messages")
    if given[0] == "input_ids":
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if not _is_int(t) or not 0 <= t < 1 << 31:
                raise BadRequest(f"input_ids[{i}] is {t!r}, not a token id")
        return ids
    if tm.tokenizer is None:
        raise BadRequest(
            f"the server has no tokenizer (--skip-tokenizer-init): send input_ids, not {given[0]}"
        )
    if given[0] == "text":
        if not isinstance(body["text"], str) or not body["text"]:
            raise BadRequest("text must be a non-empty string")
        return list(tm.tokenizer.encode(body["text"]))
    return _render_messages(request, body)


def _render_messages(request: Any, body: dict[str, Any]) -> list[int]:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import TokenizeRequest

    if not isinstance(body["messages"], list) or not body["messages"]:
        raise BadRequest("messages must be a non-empty list of chat messages")
    fields: dict[str, Any] = {"messages": body["messages"]}
    for name in ("tools", "chat_template_kwargs", "add_generation_prompt"):
        if body.get(name) is not None:
            fields[name] = body[name]
    try:
        req = TokenizeRequest(**fields)
        serving = request.app.state.openai_serving_tokenize
        ids = serving._tokenize_chat_request(req)
    except (ValidationError, ValueError) as exc:
        raise BadRequest(f"messages could not be rendered: {exc}") from exc
    if not ids:
        raise BadRequest("the messages render to no tokens")
    return list(ids)


async def _compute_endpoint(tm: Any, ids: list[int], body: dict[str, Any]) -> int:
    """Run the prefix as a one-token request that asks for its endpoint wherever it falls."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from .hints import checkpoint_envelope

    obj = GenerateReqInput(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        kv_hints=checkpoint_envelope(),
        extra_key=body.get("extra_key"),
        cache_salt=body.get("cache_salt"),
    )
    last: Any = None
    async for chunk in tm.generate_request(obj, None):
        last = chunk
    meta = last.get("meta_info", {}) if isinstance(last, dict) else {}
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


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
