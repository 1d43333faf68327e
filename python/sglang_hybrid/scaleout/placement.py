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
  A ``--dp-size`` worker behind the router's ``--dp-aware`` is one target per DP rank
  (``url@rank`` in ``/workers``): its answer lists every rank's (``dp_ranks``, each with its
  ``dp_rank``), and the request goes to the deepest rank.
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


def _target(url: str, rank: int | None) -> str:
    """The router's name for a worker, or for one DP rank of it (``--dp-aware``)."""
    return url if rank is None else f"{url}@{rank}"


class ResumeAwarePlacement:
    """A ``live.Route`` (see the module contract)."""

    def __init__(self, worker_urls: list[str], router_order: list[str]) -> None:
        self.worker_urls = list(worker_urls)
        # The router lists a plain worker by its URL and a --dp-aware worker's ranks as url@rank.
        self.ranks: dict[str, list[int | None]] = {}
        for u in worker_urls:
            ranks = sorted(int(t.rpartition("@")[2]) for t in router_order if t.startswith(u + "@"))
            self.ranks[u] = list(ranks) if ranks else [None]
        self.targets = [_target(u, r) for u in worker_urls for r in self.ranks[u]]
        missing = [t for t in self.targets if t not in router_order]
        if missing:
            raise ValueError(f"the router does not list {missing}")
        self.index = {t: router_order.index(t) for t in self.targets}
        self.lookups = 0
        self.placed_by_resume = 0  # requests sent where some worker could resume them

    async def _reusable(self, client: Any, url: str, req: LiveRequest) -> list[int]:
        """Tokens each of the worker's targets (``self.ranks[url]``, in order) could resume."""
        nothing = [0] * len(self.ranks[url])
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
                        return nothing
                    answer = await resp.json()
                return _depths(answer, self.ranks[url])
            except aiohttp.ServerDisconnectedError:
                continue
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                return nothing
        return nothing

    async def __call__(self, client: Any, req: LiveRequest) -> dict[str, str]:
        key = affinity_key(req)
        answers = await asyncio.gather(*(self._reusable(client, u, req) for u in self.worker_urls))
        depths = [d for per_worker in answers for d in per_worker]  # in self.targets' order
        self.lookups += len(answers)
        best = max(depths)
        if best > 0:
            self.placed_by_resume += 1
            target = self.targets[depths.index(best)]
        else:
            h = int(_digest(key.encode()), 16)
            target = self.targets[h % len(self.targets)]
        return {ROUTING_KEY_HEADER: key, TARGET_WORKER_HEADER: str(self.index[target])}


def _depths(answer: dict[str, Any], ranks: list[int | None]) -> list[int]:
    """``reusable_now`` per target of one worker: its own, or each DP rank's by ``dp_rank``."""

    def tokens(a: dict[str, Any]) -> int:
        return int(a.get("reusable_now", {}).get("tokens", 0))

    if ranks == [None]:
        return [tokens(answer)]
    by_rank = {int(a.get("dp_rank", -1)): tokens(a) for a in answer.get("dp_ranks", [answer])}
    return [by_rank.get(r, 0) for r in ranks if r is not None]
