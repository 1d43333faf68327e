"""Live replay: send a trace or chat sessions to a running SGLang-compatible server over HTTP.

Contract:
- ``LiveRequest`` is one HTTP request: ``/generate`` with input ids (``from_trace``: a trace's
  prompts, ``max_new_tokens`` = its output length, greedy, EOS ignored) or OpenAI chat
  completions with messages (``chat_request``: the server renders its template). Its release is
  absolute (``arrival_s`` after the start, times ``time_scale``) or closed-loop (``delay_s`` after
  every rid in ``after`` finished), as in ``trace.TraceRequest``. ``headers`` go with it (a
  router's routing key, ``scaleout/bench.py``); ``replay(route=...)`` adds headers chosen at send
  time, the lookup counted in the request's TTFT.
- ``replay(url, requests, concurrency=...)`` sends every request, streaming, with at most
  ``concurrency`` in flight, and returns one ``LiveResult`` per request in input order: prompt,
  cached and completion tokens as the server reports them (``meta_info`` for ``/generate``, with
  the cached tokens a shared L3 supplied, ``cached_tokens_details.hybrid_l3_tokens``;
  ``usage`` with ``prompt_tokens_details.cached_tokens`` for chat, which needs the server's
  ``--enable-cache-report``), the output text (and ids for ``/generate``), TTFT (time from
  sending to the first streamed chunk carrying output) and end-to-end latency.
- A request the server rejects or that fails in transport gets ``error`` set and never stops the
  replay; dependants are still sent (their prompts are fixed). An unreachable server raises
  ``LiveError`` before anything is sent. ``on_result`` is called as each request finishes.
- Steady state (``replay live --flush``, ``--warmup-unrelated N`` / ``--prefill-pool``):
  ``flush_cache(url)`` empties the server's prefix cache (SGLang's ``/flush_cache``, which
  refuses while requests run: asked again until the server is idle, up to ``wait_s``);
  ``server_pools(url)`` reads the KV tokens and state slots the server was
  started with (``/server_info``), which ``--prefill-pool`` sizes its unrelated warm-up from.

Why the streams are read here and not through the ``openai`` client: most of the traffic is
SGLang's native ``/generate`` (token ids in, ``meta_info`` with ``cached_tokens`` and
``output_ids`` out), which is no OpenAI API, so its ``data:`` lines need this reader anyway. Chat
through ``openai`` would add a second HTTP stack (httpx) beside aiohttp with its own retries,
timeouts and connection pool, so the two kinds would no longer be timed by the same client;
``route`` hooks get the aiohttp session; and SGLang's extensions (``ignore_eos``, ``rid``,
``reasoning_content``) would travel as untyped extras. The reader is ten lines (``_stream_lines``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ReplayError
from .results import percentile
from .trace import Trace


class LiveError(ReplayError):
    """The server cannot be replayed against (unreachable, not SGLang-compatible)."""


# Headers chosen per request at send time (the aiohttp session, the request): a client-side
# placement in front of a router (``scaleout/placement.py``).
Route = Callable[[Any, "LiveRequest"], Awaitable[dict[str, str]]]


@dataclass(slots=True)
class LiveRequest:
    rid: str
    kind: Literal["generate", "chat"]
    body: dict[str, Any]  # the JSON body; streaming options are added when sent
    arrival_s: float | None = None
    after: tuple[str, ...] = ()
    delay_s: float = 0.0
    tag: str = ""
    session: str | None = None
    turn: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers (routing keys)


@dataclass(slots=True)
class LiveResult:
    rid: str
    tag: str
    session: str | None
    turn: int | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    l3_tokens: int = 0  # of cached_tokens, fetched from a shared L3 first (``--hybrid-l3``)
    output: str = ""
    output_ids: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    sent_at_s: float = float("nan")  # since the replay started
    error: str | None = None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def from_trace(trace: Trace, model: str | None = None) -> list[LiveRequest]:
    """``/generate`` requests for a token-id trace (greedy, exactly ``output_len`` tokens)."""
    out = []
    for r in trace.requests:
        body: dict[str, Any] = {
            "rid": r.rid,
            "input_ids": [int(t) for t in r.input_ids],
            "sampling_params": {
                "max_new_tokens": int(r.output_len),
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        if model is not None:
            body["model"] = model
        out.append(
            LiveRequest(
                r.rid,
                "generate",
                body,
                r.arrival_s,
                tuple(r.after),
                r.delay_s,
                r.tag,
                r.session,
                r.turn,
            )
        )
    return out


def chat_request(
    rid: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    tools: list[dict[str, Any]] | None = None,
    after: Sequence[str] = (),
    arrival_s: float | None = None,
    delay_s: float = 0.0,
    tag: str = "",
    session: str | None = None,
    turn: int | None = None,
    model: str = "default",
) -> LiveRequest:
    """An OpenAI chat completion request, greedy, that generates exactly ``max_tokens``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        # OpenAI's current name: SGLang warns that ``max_tokens`` is deprecated for chat.
        "max_completion_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # SGLang extension: the tiny model's EOS must not cut turns short
        "rid": rid,
    }
    if tools:
        body["tools"] = tools
    if arrival_s is None and not after:
        arrival_s = 0.0
    return LiveRequest(rid, "chat", body, arrival_s, tuple(after), delay_s, tag, session, turn)


def _get(url: str, timeout_s: float = 60.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()
    except (urllib.error.URLError, OSError) as e:
        raise LiveError(f"cannot reach {url}: {e}") from None


def flush_cache(url: str, wait_s: float = 60.0) -> None:
    """Empty the server's prefix cache (``/flush_cache``); ``LiveError`` if it still refuses
    after ``wait_s``.

    SGLang refuses (400) while any request runs or waits, and requests the client did not send
    may be running: a router that just started probes its workers with ``/health_generate``, a
    real generation. So a refusal is asked again until the server is idle or ``wait_s`` passes.
    """
    deadline = time.monotonic() + wait_s
    while True:
        status, body = _get(f"{url.rstrip('/')}/flush_cache")
        if status == 200:
            return
        if status != 400 or time.monotonic() >= deadline:
            raise LiveError(f"{url}/flush_cache answered {status}: {body.decode(errors='replace')}")
        time.sleep(0.2)


def server_pools(url: str) -> tuple[int, int]:
    """(KV tokens, state slots) of the server's pools, from ``/server_info``."""
    for path in ("/server_info", "/get_server_info"):
        status, body = _get(f"{url.rstrip('/')}{path}")
        if status == 200:
            info = json.loads(body)
            kv, slots = info.get("max_total_tokens"), info.get("max_mamba_cache_size")
            if kv and slots:
                return int(kv), int(slots)
            raise LiveError(f"{url}{path} names no max_total_tokens / max_mamba_cache_size")
    raise LiveError(f"{url} answers neither /server_info nor /get_server_info")


async def _check_server(client: Any, url: str) -> None:
    import aiohttp

    try:
        async with client.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                raise LiveError(f"{url}/health answered {r.status}: is the server up?")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise LiveError(f"cannot reach {url}: {e}") from None


async def _stream_lines(resp: Any) -> Any:
    """The ``data:`` payloads of a server-sent-events response, decoded, until [DONE]."""
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


async def _send(
    client: Any, url: str, req: LiveRequest, t0: float, route: Route | None = None
) -> LiveResult:
    import aiohttp

    res = LiveResult(req.rid, req.tag, req.session, req.turn)
    body = dict(req.body)
    body["stream"] = True
    if req.kind == "chat":
        path = "/v1/chat/completions"
        body["stream_options"] = {"include_usage": True}
    else:
        path = "/generate"
    start = time.perf_counter()
    res.sent_at_s = start - t0
    headers = dict(req.headers)
    try:
        if route is not None:  # inside the timed span: TTFT includes the placement lookup
            headers.update(await route(client, req))
        async with client.post(f"{url}{path}", json=body, headers=headers or None) as resp:
            if resp.status != 200:
                text = await resp.text()
                res.error = f"HTTP {resp.status}: {_message(text)}"
                return res
            async for chunk in _stream_lines(resp):
                if "error" in chunk:
                    res.error = _message(json.dumps(chunk))
                    break
                if req.kind == "chat":
                    _take_chat_chunk(res, chunk, start)
                else:
                    _take_generate_chunk(res, chunk, start)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - start
    return res


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err)[:300]


def _take_generate_chunk(res: LiveResult, chunk: dict[str, Any], start: float) -> None:
    meta = chunk.get("meta_info", {})
    done = int(meta.get("completion_tokens", 0))
    if done > 0 and res.ttft_s != res.ttft_s:  # NaN: first output
        res.ttft_s = time.perf_counter() - start
    res.prompt_tokens = int(meta.get("prompt_tokens", res.prompt_tokens))
    res.cached_tokens = int(meta.get("cached_tokens", res.cached_tokens))
    details = meta.get("cached_tokens_details") or {}
    res.l3_tokens = int(details.get("hybrid_l3_tokens", res.l3_tokens))
    res.completion_tokens = done
    res.output = chunk.get("text", res.output)
    if "output_ids" in chunk:
        res.output_ids = list(chunk["output_ids"])
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        res.error = f"aborted: {reason.get('message', '')}"


def _take_chat_chunk(res: LiveResult, chunk: dict[str, Any], start: float) -> None:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        if delta.get("tool_calls"):
            piece += json.dumps(delta["tool_calls"])
        if piece and res.ttft_s != res.ttft_s:
            res.ttft_s = time.perf_counter() - start
        res.output += piece
    usage = chunk.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
        res.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens", 0) or 0)


async def replay(
    url: str,
    requests: Sequence[LiveRequest],
    *,
    concurrency: int = 8,
    time_scale: float = 1.0,
    timeout_s: float = 900.0,
    on_result: Callable[[LiveResult], None] | None = None,
    route: Route | None = None,
) -> list[LiveResult]:
    """Send ``requests`` (see the module contract); results in input order."""
    import aiohttp

    if concurrency < 1:
        raise LiveError("concurrency must be at least 1")
    rids = [r.rid for r in requests]
    if len(set(rids)) != len(rids):
        raise LiveError("duplicate rids in the replay")
    index = {r.rid: i for i, r in enumerate(requests)}
    for r in requests:
        missing = [a for a in r.after if a not in index or index[a] >= index[r.rid]]
        if missing:
            raise LiveError(f"request {r.rid!r} waits for {missing}, which do not come earlier")
        if r.arrival_s is None and not r.after:
            raise LiveError(f"request {r.rid!r} has neither an arrival time nor dependencies")
    url = url.rstrip("/")
    done = {r.rid: asyncio.Event() for r in requests}
    results: dict[str, LiveResult] = {}
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        await _check_server(client, url)
        t0 = time.perf_counter()

        async def one(req: LiveRequest) -> None:
            try:
                if req.arrival_s is not None:
                    await asyncio.sleep(
                        max(0.0, t0 + req.arrival_s * time_scale - time.perf_counter())
                    )
                for dep in req.after:
                    await done[dep].wait()
                if req.delay_s:
                    await asyncio.sleep(req.delay_s * time_scale)
                async with gate:
                    res = await _send(client, url, req, t0, route)
                results[req.rid] = res
                if on_result is not None:
                    on_result(res)
            finally:
                done[req.rid].set()

        await asyncio.gather(*(one(r) for r in requests))
    return [results[r.rid] for r in requests]


def run_replay(url: str, requests: Sequence[LiveRequest], **kwargs: Any) -> list[LiveResult]:
    """``replay`` from synchronous code."""
    return asyncio.run(replay(url, requests, **kwargs))


def summarize(results: Sequence[LiveResult]) -> dict[str, Any]:
    """Totals over the requests that succeeded, and the count of those that did not."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s == r.ttft_s)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "l3_tokens": sum(r.l3_tokens for r in ok),
        "reuse": cached / prompt if prompt else 0.0,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        # One percentile definition for modelled and live figures (nearest rank, ``results``).
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_total_s": sum(ttfts),
    }
