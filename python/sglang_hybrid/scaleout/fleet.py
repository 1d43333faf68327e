"""N CPU servers behind one router, started together and stopped together.

Contract:
- ``Fleet(configs, policy, out_dir)`` starts one ``CpuServer`` per ``ServerConfig`` (all
  launched at once, then waited for: start-up is mostly import time, so N servers come up in
  little more than one's time), then a ``RouterProcess`` over their URLs. ``url`` is the router's.
  ``--enable-metrics`` is added to every server, so ``counters()`` can read each one's prompt and
  cached tokens from SGLang's own ``/metrics``.
- ``use_policy(policy, extra)`` restarts the router alone with another policy and extra router
  flags (the servers stay; the router's own prefix tree starts empty);
  ``flush()`` empties every live server's prefix cache; ``kill_worker(i)`` crashes one server.
- ``stop()`` (and ``__exit__``) stops the router and every server, whatever failed before.
- A server with ``dp_size`` > 1 is a router target per DP rank (give the router ``dp_aware``);
  ``counters()`` then lists each rank, from the cache's own per-rank series (SGLang's prompt and
  cached token counters are per server, not per rank).
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sglang_hybrid.cpu.process import Lifecycle
from sglang_hybrid.cpu.server import CpuServer, ServerConfig
from sglang_hybrid.replay.live import flush_cache

from .router import RouterConfig, RouterProcess

# (prompt, cached): WorkerCounters' fields, in order.
_COUNTERS = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total")


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """A server's cumulative prompt and cached tokens, as SGLang's ``/metrics`` counts them."""

    prompt_tokens: int
    cached_tokens: int

    def __sub__(self, other: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            self.prompt_tokens - other.prompt_tokens, self.cached_tokens - other.cached_tokens
        )


def _samples(url: str) -> Iterator[Any]:
    """Every sample of the server's ``/metrics``, parsed by ``prometheus_client`` (the library
    SGLang exports them with)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples


def read_counters(url: str) -> WorkerCounters:
    """Sum SGLang's ``sglang:prompt_tokens_total`` / ``cached_tokens_total`` over their labels."""
    totals = dict.fromkeys(_COUNTERS, 0.0)
    for sample in _samples(url):
        if sample.name in totals:
            totals[sample.name] += sample.value
    return WorkerCounters(*(int(totals[name]) for name in _COUNTERS))


_RANK_SERIES = "sglang_hybrid:prompt_tokens_total"  # labels: dp_rank, source (metrics.py)


def read_rank_counters(url: str, dp_size: int) -> list[WorkerCounters]:
    """Each DP rank's prompt and reused tokens (``reused_device`` + ``reused_host``), rank order."""
    prompt, cached = [0.0] * dp_size, [0.0] * dp_size
    for sample in _samples(url):
        if sample.name != _RANK_SERIES:
            continue
        rank = int(sample.labels.get("dp_rank", 0))
        if not 0 <= rank < dp_size:
            raise ValueError(f"{url}: a counter of DP rank {rank}, expected {dp_size} ranks")
        prompt[rank] += sample.value
        if sample.labels.get("source") != "computed":
            cached[rank] += sample.value
    return [WorkerCounters(int(p), int(c)) for p, c in zip(prompt, cached, strict=True)]


class Fleet(Lifecycle):
    """Servers and their router (see the module contract)."""

    def __init__(
        self,
        configs: Sequence[ServerConfig],
        policy: str,
        out_dir: Path,
        *,
        router: RouterConfig | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        if not configs:
            raise ValueError("a fleet needs at least one server")
        self.out_dir = out_dir
        self.on_progress = on_progress
        self.servers = [
            CpuServer(
                replace(c, extra=[*c.extra, "--enable-metrics"]),
                out_dir / f"worker{i}.log",
                on_progress=on_progress,
            )
            for i, c in enumerate(configs)
        ]
        self._router_template = router or RouterConfig(worker_urls=[])
        self.policy = policy
        self.router: RouterProcess | None = None
        self._router_starts = 0

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("the fleet's router is not running")
        return self.router.url

    def start(self) -> None:
        for s in self.servers:
            s.launch()
        for s in self.servers:
            s.wait_ready()
        self.use_policy(self.policy)

    def use_policy(self, policy: str, extra: Sequence[str] = ()) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        self.policy = policy
        cfg = replace(
            self._router_template,
            worker_urls=[s.url for s in self.servers],
            policy=policy,
            port=0,
            extra=[*self._router_template.extra, *extra],
        )
        self._router_starts += 1
        log = self.out_dir / f"router{self._router_starts}-{policy}.log"
        self.router = RouterProcess(cfg, log, on_progress=self.on_progress)
        self.router.start()

    def flush(self) -> None:
        for s in self.servers:
            if s.alive():
                flush_cache(s.url)

    def counters(self) -> list[WorkerCounters | None]:
        """Each server's counters, or each DP rank's; None for a server that is down."""
        out: list[WorkerCounters | None] = []
        for s in self.servers:
            dp = s.config.dp_size
            if not s.alive():
                out.extend([None] * dp)
            elif dp > 1:
                out.extend(read_rank_counters(s.url, dp))
            else:
                out.append(read_counters(s.url))
        return out

    def kill_worker(self, i: int) -> None:
        self.servers[i].kill()

    def stop(self) -> None:
        if self.router is not None:
            with contextlib.suppress(Exception):
                self.router.stop()
            self.router = None
        for s in self.servers:
            s.stop()
