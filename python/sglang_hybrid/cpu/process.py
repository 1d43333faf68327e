"""A server run as a managed subprocess: its own process group, a log file, a readiness poll.

Contract (shared by ``CpuServer`` and the scale-out router, ``scaleout/router.py``):
- ``start()`` launches ``argv()`` with ``env()`` in a new process group, output to ``log_path``,
  then polls ``ready()`` until it answers True, reporting progress through ``on_progress`` every
  5 s. A process that exits, or is not ready within ``startup_timeout_s``, raises ``ServerError``
  with the tail of its log.
- A start that failed on a taken address (a port drawn free and bound later, taken by another
  process in between; seen in the log, since SGLang's HTTP server hangs rather than exits after
  a failed bind) is stopped and retried on newly drawn ports (``release_ports``), 3 starts in
  all.
- ``stop()`` SIGTERMs the group, waits ``grace_s``, then SIGKILLs what is left (SGLang spawns a
  scheduler and a detokenizer, the router its worker threads; killing the group leaves nothing
  behind). It is idempotent and is what ``__exit__`` calls, so a ``with`` block never leaks a
  process, on errors and on KeyboardInterrupt alike.
- ``get_json`` / ``post_json`` talk to ``url``; ``post_json`` returns the status and the decoded
  answer (text when it is not JSON) rather than raising on an HTTP error.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from typing_extensions import Self

_START_ATTEMPTS = 3


class ServerError(RuntimeError):
    """The server did not come up, or died."""


class Lifecycle(abc.ABC):
    """Something started and stopped as a whole: ``with`` starts it and always stops it."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None:
        """Idempotent; stops whatever part did start."""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ManagedProcess(Lifecycle):
    """One server process group (see the module contract)."""

    name = "server"

    def __init__(
        self,
        log_path: Path,
        startup_timeout_s: float = 600.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.on_progress = on_progress
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    @abc.abstractmethod
    def url(self) -> str: ...

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line (called once per start, after ``prepare``)."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True once the server serves (polled every 0.5 s during start-up)."""

    def prepare(self) -> None:
        """Called before ``argv``: choose ports and the like."""

    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")

    def start(self) -> None:
        # Ports are drawn free (ours in ``prepare``, SGLang's process-group port in the child)
        # and bound later, so another process can take one in between: a start that died of
        # a taken address is started again on newly drawn ports.
        for attempt in range(_START_ATTEMPTS):
            self.launch()
            try:
                self.wait_ready()
                return
            except ServerError:
                if attempt + 1 == _START_ATTEMPTS or not self._lost_a_port():
                    raise
                if self.on_progress is not None:
                    self.on_progress(f"the {self.name} found a port taken; starting it again")
                self.stop()
                self.release_ports()

    def release_ports(self) -> None:
        """Forget the ports ``prepare`` drew, so the next start draws new ones."""

    def _lost_a_port(self) -> bool:
        """Whether the start-up log shows a bind that failed on a taken address."""
        # SGLang's words: OSError's "Address already in use" (the HTTP port), PortArgs'
        # "Port is already in use", c10d's EADDRINUSE (the process-group port).
        tail = self.log_tail(200)
        return "EADDRINUSE" in tail or "already in use" in tail

    def launch(self) -> None:
        """Start the process without waiting for it (``wait_ready`` waits)."""
        if self.proc is not None:
            raise ServerError(f"the {self.name} is already started")
        self.prepare()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        t0 = time.monotonic()
        last_note = t0
        while True:
            if self.proc is None:
                raise ServerError(f"the {self.name} was not started")
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the {self.name} exited with {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._lost_a_port():
                # SGLang's HTTP server logs the failed bind and then hangs in its shutdown
                # instead of exiting: the log, not the exit, says the start failed.
                raise ServerError(
                    f"the {self.name} could not bind a port; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            if self.ready():
                return
            now = time.monotonic()
            if now - t0 > self.startup_timeout_s:
                raise ServerError(
                    f"the {self.name} was not ready after {self.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.on_progress is not None and now - last_note >= 5.0:
                last_note = now
                self.on_progress(
                    f"waiting for the {self.name} ({now - t0:.0f} s): {self.last_line()}"
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get_json(self, path: str, timeout_s: float = 60.0) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as r:
            return json.loads(r.read())

    def post_json(
        self,
        path: str,
        body: Any,
        timeout_s: float = 300.0,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """POST ``body`` (with extra ``headers``); the status and the decoded answer (text when
        it is not JSON)."""
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
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

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash would (no grace, no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop(grace_s=0.0)
