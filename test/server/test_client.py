"""``HybridClient`` (issue #38) against real local HTTP servers: retries while the server is not
up yet (connection refused), gives up with ``ServerUnavailable`` after its retries, times out a
request that never answers, and reads every error shape SGLang's routes answer with."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_hybrid.client import ClientError, HybridClient, ServerUnavailable
from sglang_hybrid.cpu.server import free_port

SHAPES = {
    "/openai": (400, {"error": {"message": "m1", "type": "t", "param": "cut", "code": "c"}}),
    "/legacy": (404, {"error": "m2"}),
    "/sglang-openai": (400, {"object": "error", "message": "m3", "type": "BadRequest"}),
    "/fastapi": (404, {"detail": "Not Found"}),
}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(3)
        status, body = SHAPES.get(self.path, (200, {"n_ctx": 8}))
        raw = json.dumps(body).encode() if self.path != "/text" else b"plain words"
        try:
            self.send_response(500 if self.path == "/text" else status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # /slow: the client gave up, as it should


@pytest.fixture
def late_server() -> Iterator[tuple[int, threading.Event]]:
    """A server on a fixed port that starts listening 0.8 s from now."""
    port, up = free_port(), threading.Event()
    box: list[ThreadingHTTPServer] = []

    def start() -> None:
        time.sleep(0.8)
        box.append(ThreadingHTTPServer(("127.0.0.1", port), _Handler))
        up.set()
        box[0].serve_forever()

    threading.Thread(target=start, daemon=True).start()
    yield port, up
    up.wait(10)
    box[0].shutdown()
    box[0].server_close()


def test_it_retries_until_the_server_is_up(late_server) -> None:
    port, up = late_server
    with HybridClient(f"http://127.0.0.1:{port}", retries=6, backoff_s=0.1) as c:
        assert c.props() == {"n_ctx": 8}
    assert up.is_set()


def test_it_gives_up_after_its_retries() -> None:
    # A port nothing listens on (not the late server: on a loaded machine two attempts may
    # outlast its 0.8 s and find it up). Bounded: two attempts and one backoff, not a hang.
    port = free_port()
    t0 = time.monotonic()
    c = HybridClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.05)
    with c, pytest.raises(ServerUnavailable, match="unreachable after 2 attempts") as info:
        c.props()
    assert info.value.status == 0 and time.monotonic() - t0 < 10


def test_errors_in_every_shape_and_a_timeout(late_server) -> None:
    port, up = late_server
    up.wait(10)
    with HybridClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as c:
        got = {}
        for path in [*SHAPES, "/text"]:
            with pytest.raises(ClientError) as info:
                c._call("GET", path)
            e = info.value
            got[path] = (e.status, e.message, e.param, e.code)
        assert got == {
            "/openai": (400, "m1", "cut", "c"),
            "/legacy": (404, "m2", None, None),
            "/sglang-openai": (400, "m3", None, None),
            "/fastapi": (404, "Not Found", None, None),
            "/text": (500, "plain words", None, None),
        }
        with pytest.raises(ServerUnavailable, match="timed out"):
            c._call("GET", "/slow")  # sent: not retried
