"""SGLang's whole server (``python -m sglang.launch_server``) on the CPU, as a managed subprocess.

Contract:
- ``ServerConfig`` says what to serve: the model directory, which prefix cache (``"hybrid"``,
  SGLang's ``"builtin"`` cache with the ``no_buffer`` mamba strategy, or ``"off"`` = radix cache
  disabled), the CPU worker kind, pool sizes, chunk size and extra flags. ``argv()`` is the exact
  command line, so anything run here can be repeated by hand.
- ``CpuServer(config, log_path)`` starts the server in its own process group (SGLang spawns a
  scheduler and a detokenizer; killing the group leaves nothing behind), waits until
  ``/health_generate`` answers (a real one-token generation went through the scheduler), and
  reports progress while waiting through ``on_progress``. A server that exits or does not come up
  in ``startup_timeout_s`` raises ``ServerError`` carrying the tail of its log.
- ``dp_size`` > 1 runs SGLang's data-parallel controller with that many scheduler processes, each
  with its own cache. SGLang's CPU path binds every rank to a NUMA node unless
  ``SGLANG_CPU_OMP_THREADS_BIND`` names cores per rank, and refuses more ranks than nodes; the
  server sets it from this process's CPU affinity (``omp_binding``: cores split evenly, shared
  round-robin when there are fewer cores than ranks) unless the caller's environment sets it.
- Starting, stopping and the log follow ``cpu/process.py``'s contract: ``with CpuServer(...)``
  never leaks a process; ``kill()`` is a crash (SIGKILL, no grace).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .process import ManagedProcess, ServerError

__all__ = ["CACHE_KINDS", "CpuServer", "ServerConfig", "ServerError", "free_port", "omp_binding"]

CacheKind = Literal["hybrid", "builtin", "off"]
CACHE_KINDS: tuple[str, ...] = ("hybrid", "builtin", "off")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class ServerConfig:
    model_path: Path
    cache: CacheKind = "hybrid"
    worker: Literal["model", "tokens"] = "model"
    port: int = 0  # 0: a free port is chosen at start
    max_total_tokens: int = 16384
    max_running_requests: int = 4
    max_mamba_cache_size: int = 32
    chunked_prefill_size: int = 256
    host_cache_mib: int = 64
    enable_cache_report: bool = True
    dp_size: int = 1
    extra: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache {self.cache!r}: expected one of {', '.join(CACHE_KINDS)}")
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--hybrid-cpu-worker",
            self.worker,
            # What SGLang needs to run on a CPU with a stand-in worker (docs/cpu-worker.md).
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--load-format",
            "dummy",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            # No CUDA graph flag: SGLang disables them for torch_native attention itself, and
            # --disable-cuda-graph is deprecated (issue #38: no deprecation warnings of ours).
            "--sleep-on-idle",
            "--random-seed",
            "0",
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--max-running-requests",
            str(self.max_running_requests),
            "--max-mamba-cache-size",
            str(self.max_mamba_cache_size),
            "--chunked-prefill-size",
            str(self.chunked_prefill_size),
        ]
        if self.cache == "hybrid":
            # Nothing about overlap scheduling or the mamba strategy: the plugin picks no_buffer
            # itself and overlap stays on, so this is the documented launch command.
            args += ["--radix-cache", "hybrid", "--hybrid-host-cache-mib", str(self.host_cache_mib)]
        else:
            # Spelled out for SGLang's own cache: on a CPU, auto would pick extra_buffer, which
            # SGLang supports on GPU platforms only, and no_buffer needs overlap scheduling off.
            args += ["--disable-overlap-schedule", "--mamba-radix-cache-strategy", "no_buffer"]
            if self.cache == "off":
                args += ["--disable-radix-cache"]
        if self.enable_cache_report:
            args.append("--enable-cache-report")
        if self.dp_size < 1:
            raise ValueError(f"dp_size {self.dp_size}: expected at least 1")
        if self.dp_size > 1:
            args += ["--dp-size", str(self.dp_size)]
        return args + list(self.extra)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The server's environment: ``base`` plus what SGLang needs on the CPU."""
        env = dict(base, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        if self.dp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_binding(self.dp_size)
        return env


def omp_binding(ranks: int, cores: list[int] | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` scheduler ranks: ``"0|1"``, ``"0-3|4-7"``.

    Each rank gets a contiguous share of ``cores`` (this process's affinity by default); with
    fewer cores than ranks, ranks share cores round-robin (the CPU worker is light; a real model
    would want one node per rank).
    """
    if ranks < 1:
        raise ValueError(f"ranks {ranks}: expected at least 1")
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if not cores:
        raise ValueError("no CPU cores to bind")
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    per = len(cores) // ranks
    groups = [cores[r * per : (r + 1) * per] for r in range(ranks)]
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cores: list[int]) -> str:
    if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


class CpuServer(ManagedProcess):
    """A running ``launch_server`` (see the module contract)."""

    def __init__(
        self,
        config: ServerConfig,
        log_path: Path,
        startup_timeout_s: float = 600.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(log_path, startup_timeout_s, on_progress)
        self.config = config
        self.name = f"{config.cache} server"
        self._drew_port = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def prepare(self) -> None:
        if self.config.port == 0:
            self.config.port = free_port()
            self._drew_port = True

    def release_ports(self) -> None:
        if self._drew_port:
            self.config.port, self._drew_port = 0, False

    def argv(self) -> list[str]:
        return self.config.argv()

    def env(self) -> dict[str, str]:
        return self.config.env(dict(os.environ))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False
