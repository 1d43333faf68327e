"""SGLang's router (``sglang-router``) in front of running servers, as a managed subprocess.

Contract:
- ``RouterConfig`` names the workers (their base URLs), the policy (``POLICIES``: the router's
  command-line ones plus ``consistent_hashing`` / ``prefix_hash``, see ``launch_router``),
  ``dp_aware`` (the router addresses each DP rank of a ``--dp-size`` worker itself), the health
  check interval and the retry count. ``argv()`` is the exact command line.
- ``RouterProcess(config, log_path)`` follows ``cpu/process.py``: its own process group, ready
  once ``/workers`` lists every worker URL as healthy (the router registers workers in the
  background after it answers ``/health``, and answers 503 until then), ``stop()`` / ``kill()``.
- ``ROUTING_KEY_HEADER`` is the header ``consistent_hashing`` (and ``manual``) route by.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_hybrid.cpu.process import ManagedProcess
from sglang_hybrid.cpu.server import free_port

from .launch_router import EXTRA_POLICIES

POLICIES: tuple[str, ...] = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "manual",
    *EXTRA_POLICIES,
)
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


@dataclass(slots=True)
class RouterConfig:
    worker_urls: list[str]
    policy: str = "cache_aware"
    port: int = 0  # 0: a free port is chosen at start
    dp_aware: bool = False
    health_check_interval_s: int = 60  # the router's default
    retries: int = 5  # the router's default (--retry-max-retries)
    extra: list[str] = field(default_factory=list)

    def argv(self, prometheus_port: int) -> list[str]:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if not self.worker_urls:
            raise ValueError("a router needs at least one worker URL")
        args = [
            sys.executable,
            "-m",
            "sglang_hybrid.scaleout.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            self.policy,
            # Its metrics server binds 0.0.0.0:29000 by default: two routers would collide.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus_port),
            "--health-check-interval-secs",
            str(self.health_check_interval_s),
            "--retry-max-retries",
            str(self.retries),
            "--log-level",
            "warn",
            # It registers the workers in the background, polling them every 30 s by default.
            "--worker-startup-check-interval",
            "1",
        ]
        if self.dp_aware:
            args.append("--dp-aware")
        return args + list(self.extra)


class RouterProcess(ManagedProcess):
    """A running router (see the module contract)."""

    name = "router"

    def __init__(
        self,
        config: RouterConfig,
        log_path: Path,
        startup_timeout_s: float = 120.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(log_path, startup_timeout_s, on_progress)
        self.config = config
        self._prometheus_port = 0
        self._drew_port = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def prepare(self) -> None:
        if self.config.port == 0:
            self.config.port = free_port()
            self._drew_port = True
        self._prometheus_port = free_port()

    def release_ports(self) -> None:
        if self._drew_port:
            self.config.port, self._drew_port = 0, False

    def argv(self) -> list[str]:
        return self.config.argv(self._prometheus_port)

    def workers(self) -> list[dict[str, Any]]:
        """The router's ``/workers`` list (url, is_healthy, load, ...)."""
        return list(self.get_json("/workers", timeout_s=5).get("workers", []))

    def ready(self) -> bool:
        try:
            workers = self.workers()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return False
        healthy = {w.get("url", "").split("@")[0] for w in workers if w.get("is_healthy")}
        return all(u.rstrip("/") in healthy for u in self.config.worker_urls)
