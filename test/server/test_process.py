"""ManagedProcess start-up: a port taken between drawing and binding is drawn again."""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sglang_hybrid.cpu.process import ManagedProcess, ServerError
from sglang_hybrid.cpu.server import free_port

# A one-file HTTP server that fails a taken port the way SGLang's does: it logs the failed
# bind and then hangs instead of exiting.
_SERVE = """
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
try:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
except OSError as e:
    print(f"ERROR: {e}", flush=True)
    time.sleep(3600)
server.serve_forever()
"""


class _TinyServer(ManagedProcess):
    name = "tiny server"

    def __init__(self, log_path: Path, draws: list[int]) -> None:
        self.notes: list[str] = []  # progress lines
        super().__init__(log_path, startup_timeout_s=30.0, on_progress=self.notes.append)
        self.draws = draws  # ports ``prepare`` hands out, in order, then free ones
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prepare(self) -> None:
        if self.port == 0:
            self.port = self.draws.pop(0) if self.draws else free_port()

    def release_ports(self) -> None:
        self.port = 0

    def argv(self) -> list[str]:
        return [sys.executable, "-c", _SERVE, str(self.port)]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False


def _held_port() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_start_that_lost_its_port_is_started_again_on_a_new_one(tmp_path: Path) -> None:
    with _held_port() as taken:
        held = taken.getsockname()[1]
        server = _TinyServer(tmp_path / "tiny.log", draws=[held])
        with server:
            assert server.port != held
            assert server.ready()
        assert any("port taken" in n for n in server.notes)
        assert not server.alive()


def test_a_start_that_keeps_losing_its_port_gives_up_with_the_log(tmp_path: Path) -> None:
    with _held_port() as taken:
        held = taken.getsockname()[1]
        server = _TinyServer(tmp_path / "tiny.log", draws=[held] * 3)
        with (
            pytest.raises(ServerError, match=r"could not bind a port(.|\n)*already in use"),
            server,
        ):
            pass
        assert server.draws == [] and not server.alive()


def test_a_start_that_fails_otherwise_is_not_retried(tmp_path: Path) -> None:
    server = _TinyServer(tmp_path / "tiny.log", draws=[])
    server.notes = []
    server.argv = lambda: [sys.executable, "-c", "raise SystemExit('bad flag')"]  # type: ignore[method-assign]
    with pytest.raises(ServerError, match="bad flag"):
        server.start()
    assert not any("port taken" in n for n in server.notes)
