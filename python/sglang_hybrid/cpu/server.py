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
- ``stop()`` sends SIGTERM to the group, waits, then SIGKILLs what is left; it is idempotent and
  is what ``__exit__`` calls, so ``with CpuServer(...)`` never leaks a process, on errors and on
  KeyboardInterrupt alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

CacheKind = Literal["hybrid", "builtin", "off"]
CACHE_KINDS: tuple[str, ...] = ("hybrid", "builtin", "off")


class ServerError(RuntimeError):
    """The server did not come up, or died."""


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
            "--disable-cuda-graph",
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
        return args + list(self.extra)


class CpuServer:
    """A running ``launch_server`` (see the module contract)."""

    def __init__(
        self,
        config: ServerConfig,
        log_path: Path,
        startup_timeout_s: float = 600.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.on_progress = on_progress
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def __enter__(self) -> CpuServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.proc is not None:
            raise ServerError("already started")
        if self.config.port == 0:
            self.config.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            self.config.argv(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        last_note = t0
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the {self.config.cache} server exited with {self.proc.returncode} during "
                    f"start-up; log {self.log_path}:\n{self.log_tail()}"
                )
            if self._ready():
                return
            now = time.monotonic()
            if now - t0 > self.startup_timeout_s:
                raise ServerError(
                    f"the {self.config.cache} server was not ready after "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.on_progress is not None and now - last_note >= 5.0:
                last_note = now
                self.on_progress(f"waiting for the server ({now - t0:.0f} s): {self.last_line()}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as r:
            return json.loads(r.read())

    def post_json(self, path: str, body: Any, timeout_s: float = 300.0) -> tuple[int, Any]:
        """POST ``body``; the status and the decoded answer (text when it is not JSON)."""
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def last_line(self) -> str:
        tail = self.log_tail(1).strip()
        return tail[:120] if tail else "(nothing logged yet)"

    def stop(self, grace_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        if proc is not None:
            # The group may outlive its leader (scheduler, detokenizer): SIGKILL whatever is left.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
