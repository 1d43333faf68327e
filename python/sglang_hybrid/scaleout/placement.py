"""Where a request goes: the affinity key, and a placement by the resume points workers report.

- ``affinity_key(req)``: what a client can route a conversation by without seeing any cache — its
  session id when it has one, else a digest of the prompt's first ``KEY_TOKENS`` token ids (for
  token-id traffic without sessions, such as Mooncake's: requests that share a first block, a
  system prompt or a document, share a key), else of its first chat message. Sent as the router's
  ``X-SMG-Routing-Key``. The digest is blake2b, so the key is the same in every process and run.
- ``ResumeAwarePlacement``: before each request, asks every worker's ``/hybrid/boundaries``
  (read-only: no hit, LRU or GDSF change; docs/compaction.md) how many of its prompt tokens it
  could resume from now, and sends the request to the deepest, through the router's
  ``consistent_hashing`` policy and its ``X-SMG-Target-Worker`` header (a worker's index in the
  router's ``/workers`` list, the only policy in sglang-router 0.3.2 that honours it). Ties —
  mostly a new conversation that no worker holds — go to the worker the affinity key hashes to,
  so it degrades to key affinity. A worker that does not answer counts as holding nothing.
  The lookups run inside the request's timed span (``replay(route=...)``): its TTFT pays for them.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from typing import Any

from sglang_hybrid.replay.live import LiveRequest

from .router import ROUTING_KEY_HEADER

KEY_TOKENS = 512  # one Mooncake block; several 64-token blocks of a system prompt
TARGET_WORKER_HEADER = "X-SMG-Target-Worker"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def affinity_key(req: LiveRequest) -> str:
    if req.session:
        return req.session
    ids = req.body.get("input_ids")
    if ids:
        return "p" + _digest(array("q", ids[:KEY_TOKENS]).tobytes())
    messages = req.body.get("messages") or [{}]
    return "m" + _digest(str(messages[0].get("content", "")).encode())


def keyed(reqs: list[LiveRequest]) -> list[LiveRequest]:
    """``reqs`` with each request's ``X-SMG-Routing-Key`` set to its affinity key."""
    for r in reqs:
        r.headers[ROUTING_KEY_HEADER] = affinity_key(r)
    return reqs


class ResumeAwarePlacement:
    """A ``live.Route`` (see the module contract)."""

    def __init__(self, worker_urls: list[str], router_order: list[str]) -> None:
        missing = [u for u in worker_urls if u not in router_order]
        if missing:
            raise ValueError(f"the router does not list {missing}")
        self.worker_urls = list(worker_urls)
        self.index = {u: router_order.index(u) for u in worker_urls}
        self.lookups = 0
        self.placed_by_resume = 0  # requests sent where some worker could resume them

    async def _reusable(self, client: Any, url: str, req: LiveRequest) -> int:
        # The prompt and its namespace: a tenant's cache_salt keeps it out of others' prefixes.
        fields = ("input_ids", "messages", "extra_key", "cache_salt")
        prompt = {k: req.body[k] for k in fields if k in req.body}
        import aiohttp

        # Two tries: a pooled keep-alive connection the server has just closed fails at once
        # ("Server disconnected"); a fresh one does not. Then the worker counts as holding nothing.
        for _ in range(2):
            try:
                async with client.post(f"{url}/hybrid/boundaries", json=prompt) as resp:
                    if resp.status != 200:
                        return 0
                    answer = await resp.json()
                return int(answer.get("reusable_now", {}).get("tokens", 0))
            except aiohttp.ServerDisconnectedError:
                continue
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                return 0
        return 0

    async def __call__(self, client: Any, req: LiveRequest) -> dict[str, str]:
        key = affinity_key(req)
        depths = await asyncio.gather(*(self._reusable(client, u, req) for u in self.worker_urls))
        self.lookups += len(depths)
        best = max(depths)
        if best > 0:
            self.placed_by_resume += 1
            url = self.worker_urls[depths.index(best)]
        else:
            h = int(_digest(key.encode()), 16)
            url = self.worker_urls[h % len(self.worker_urls)]
        return {ROUTING_KEY_HEADER: key, TARGET_WORKER_HEADER: str(self.index[url])}
