"""A small client of the boundary API (issue #16) for compaction harnesses: no dependency beyond
the standard library.

    from sglang_hybrid.client import HybridClient

    c = HybridClient("http://127.0.0.1:30000")
    plan = c.boundaries(input_ids=ids, cut=4096)      # where a cut at 4096 keeps reuse
    plan.cut.verdict, plan.cut.retained_prefix_tokens  # "snapped", 4032
    c.checkpoint(input_ids=ids[:4032])                 # make sure a state exists at 4032

Prompts are given as ``input_ids``, ``text`` or chat ``messages`` (rendered by the server with its
chat template). A refusal raises :class:`ClientError` with the server's status and reason.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, NamedTuple


class ClientError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


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


class HybridClient:
    def __init__(self, base_url: str, *, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

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
        return self._call("GET", "/props")

    def slots(self) -> list[dict[str, Any]]:
        return self._call("GET", "/slots")

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

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw).get("error") or raw.decode(errors="replace")
            except (ValueError, AttributeError):
                message = raw.decode(errors="replace")
            raise ClientError(e.code, str(message)) from None


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
