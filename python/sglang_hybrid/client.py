"""A client of the boundary API (issue #16) for compaction harnesses, on httpx (issue #38).

    from sglang_hybrid.client import HybridClient

    with HybridClient("http://127.0.0.1:30000") as c:
        plan = c.boundaries(input_ids=ids, cut=4096)      # where a cut at 4096 keeps reuse
        plan.cut.verdict, plan.cut.retained_prefix_tokens  # "snapped", 4032
        c.checkpoint(input_ids=ids[:4032])                 # make sure a state exists at 4032

Prompts are given as ``input_ids``, ``text`` or chat ``messages`` (rendered by the server with its
chat template). One connection pool per client (keep-alive), a timeout per request
(``timeout_s``; ``connect_timeout_s`` to connect), and retries with exponential backoff when the
server cannot be reached (connection refused or timed out: the request was never sent, so
retrying cannot run it twice; a server restarting comes back within them). An answer other than
2xx raises :class:`ClientError` with the server's status and OpenAI-shaped error (``message``,
``type``, ``param``, ``code``, ``docs/compaction.md``, "Errors"); SGLang's other shapes
(``{"object": "error", ...}``, FastAPI's ``{"detail": ...}``) are read too. A server still
unreachable after the retries raises :class:`ServerUnavailable`.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import httpx


class ClientError(RuntimeError):
    """The server answered with an error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        where = f" ({param})" if param else ""
        super().__init__(f"HTTP {status}{where}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class ServerUnavailable(ClientError):
    """The server could not be reached (after the retries); ``status`` is 0."""


class Checkpoint(NamedTuple):
    position: int  # tokens [0, position) need no prefill for a prompt that repeats them
    kind: str  # endpoint / opener / structural / explicit / ladder / branch / tail / tap
    tier: str  # device / host
    full_state: bool
    durable: bool  # pinned in the host tier until released


class Cut(NamedTuple):
    position: int
    verdict: str  # aligned / snapped / partial-reuse / full-re-prefill
    retained_prefix_tokens: int
    delta: int
    reason: str


class Boundaries(NamedTuple):
    prompt_tokens: int
    reusable_tokens: int  # what the next request with this prefix reuses
    reusable_tier: str | None
    checkpoints: list[Checkpoint]
    cut: Cut | None


# Failures before the request reached the server: safe to retry whatever the method.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class HybridClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive, retries and backoff_s non-negative")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={"Content-Type": "application/json"},
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HybridClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the boundary API
    def boundaries(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        cut: int | None = None,
        snap_tolerance: int | None = None,
    ) -> Boundaries:
        body = _prompt(input_ids, text, messages)
        if cut is not None:
            body["cut"] = cut
        if snap_tolerance is not None:
            body["snap_tolerance"] = snap_tolerance
        got = self._call("POST", "/hybrid/boundaries", body)
        c = got.get("cut")
        return Boundaries(
            prompt_tokens=got["prompt_tokens"],
            reusable_tokens=got["reusable_now"]["tokens"],
            reusable_tier=got["reusable_now"]["tier"],
            checkpoints=[_checkpoint(x) for x in got["checkpoints"]],
            cut=None
            if c is None
            else Cut(
                c["position"], c["verdict"], c["retained_prefix_tokens"], c["delta"], c["reason"]
            ),
        )

    def checkpoint(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        durable: bool = False,
        ttl_s: float | None = None,
    ) -> tuple[Checkpoint, int]:
        """Make sure a state exists at the prefix's end (``durable``: and keep it in the host
        tier until :meth:`release` or ``ttl_s``); (that checkpoint, tokens computed)."""
        body = _prompt(input_ids, text, messages)
        if durable:
            body["durable"] = True
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        got = self._call("POST", "/hybrid/checkpoint", body)
        return _checkpoint(got["checkpoint"]), int(got["computed_tokens"])

    def release(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> Checkpoint:
        """A durable checkpoint goes back to ordinary retention."""
        got = self._call("DELETE", "/hybrid/checkpoint", _prompt(input_ids, text, messages))
        return _checkpoint(got["checkpoint"])

    def props(self) -> dict[str, Any]:
        return dict(self._call("GET", "/props"))

    def slots(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/slots"))

    # ------------------------------------------------------------ generation
    def generate(self, input_ids: list[int], max_new_tokens: int = 16) -> tuple[list[int], int]:
        """Greedy ``/generate``: (output ids, cached tokens the server reported)."""
        got = self._call(
            "POST",
            "/generate",
            {
                "input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            },
        )
        return list(got["output_ids"]), int(got["meta_info"].get("cached_tokens", 0))

    # ------------------------------------------------------------ transport
    def _call(self, method: str, path: str, body: Any = None) -> Any:
        attempt = 0
        while True:
            try:
                r = self._http.request(method, path, json=body)
                break
            except _UNSENT as e:
                if attempt >= self.retries:
                    raise ServerUnavailable(
                        0,
                        f"{self.base_url} unreachable after {attempt + 1} attempts: "
                        f"{type(e).__name__}: {e}",
                    ) from e
                time.sleep(self.backoff_s * 2**attempt)
                attempt += 1
            except httpx.TimeoutException as e:  # sent: the server may be running it
                raise ServerUnavailable(0, f"{method} {path} timed out: {e}") from e
        if r.is_success:
            return r.json()
        raise _error(r)


def _error(r: httpx.Response) -> ClientError:
    """The server's error in any of the shapes SGLang's routes answer with."""
    try:
        data = r.json()
    except ValueError:
        return ClientError(r.status_code, r.text.strip() or r.reason_phrase)
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):  # OpenAI's shape: ours and /generate's
        return ClientError(
            r.status_code,
            str(err.get("message") or r.reason_phrase),
            type=err.get("type"),
            param=err.get("param"),
            code=None if err.get("code") is None else str(err.get("code")),
        )
    if isinstance(data, dict):
        message = err or data.get("message") or data.get("detail") or r.reason_phrase
        return ClientError(r.status_code, str(message), type=data.get("type"))
    return ClientError(r.status_code, str(data))


def _prompt(
    input_ids: list[int] | None, text: str | None, messages: list[dict[str, Any]] | None
) -> dict[str, Any]:
    given = {
        k: v for k, v in (("input_ids", input_ids), ("text", text), ("messages", messages)) if v
    }
    if len(given) != 1:
        raise ValueError("give the prompt as exactly one of input_ids, text or messages")
    return given


def _checkpoint(x: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        x["position"], x["kind"], x["tier"], bool(x["full_state"]), bool(x.get("durable"))
    )
