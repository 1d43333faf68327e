"""Every client mistake on the plugin's routes is a 4xx in OpenAI's error shape naming the field,
and the server keeps serving (issue #38): SGLang's real server on the CPU.

The mistakes the issue found (500s for out-of-vocabulary ids and over-long prompts, unknown
fields and ``true`` accepted, an unbounded TTL, 400 vs 404 for a missing slot, 200 for releasing
a pin twice) and the malformed-body family (empty, truncated, not UTF-8, not an object, wrong
types, huge numbers, NaN) go to every route.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer

VOCAB = 2048  # the tiny model's (cpu/tiny_model.py)
BODY_ROUTES = [
    ("POST", "/hybrid/boundaries"),
    ("POST", "/hybrid/checkpoint"),
    (
        "DELETE",
        "/hybrid/checkpoint",
    ),
]

MALFORMED: list[tuple[str, bytes, str | None]] = [
    ("empty", b"", None),
    ("truncated", b'{"input_ids": [1, 2', None),
    ("not utf-8", b'{"text": "\xff\xfe"}', None),
    ("latin-1 bytes", b"\xe9\xe9\xe9", None),
    ("an array", b"[1, 2, 3]", None),
    ("a string", b'"input_ids"', None),
    ("null", b"null", None),
    ("NaN", b'{"input_ids": [1], "cut": NaN}', None),
    ("ids as a string", b'{"input_ids": "1 2 3"}', "input_ids"),
    ("ids of floats", b'{"input_ids": [1.0, 2.0]}', "input_ids[0]"),
    ("an id of true", b'{"input_ids": [1, true]}', "input_ids[1]"),
    ("ids nested", b'{"input_ids": [[1, 2]]}', "input_ids[0]"),
    ("no ids", b'{"input_ids": []}', "input_ids"),
    ("empty text", b'{"text": ""}', "text"),
    ("a huge id", b'{"input_ids": [1, 123456789012345678901234567890]}', "input_ids[1]"),
    ("an id of 1e400", b'{"input_ids": [1e400]}', "input_ids[0]"),
    ("a 5000-digit id", b'{"input_ids": [' + b"7" * 5000 + b"]}", None),
    ("a negative id", b'{"input_ids": [5, -1]}', "input_ids[1]"),
    ("two prompts", b'{"input_ids": [1], "text": "a"}', None),
    ("no prompt", b"{}", None),
    ("an unknown field", b'{"input_ids": [1, 2], "cutt": 5}', "cutt"),
    ("a salt of 3", b'{"input_ids": [1, 2], "cache_salt": 3}', "cache_salt"),
    ("tools with ids", b'{"input_ids": [1, 2], "tools": []}', "tools"),
    ("messages as text", b'{"messages": "hi"}', "messages"),
]


def _call(
    server: CpuServer, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict, dict[str, str]]:
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}, dict(r.getheaders())
    finally:
        conn.close()


def _post(server: CpuServer, method: str, path: str, obj: object) -> tuple[int, dict]:
    status, got, _ = _call(server, method, path, json.dumps(obj).encode())
    return status, got


def assert_error(status: int, got: dict, want_status: int, param: str | None = "*") -> dict:
    """The OpenAI shape, a 4xx, no traceback; ``param`` checked unless "*"."""
    assert status == want_status, (status, got)
    assert set(got) == {"error"}, got
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"] and 'File "' not in err["message"], err
    assert isinstance(err["code"], str) and err["code"], err
    want_type = "not_found_error" if want_status == 404 else "invalid_request_error"
    assert err["type"] == want_type, err
    if param != "*":
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def context_len(hybrid_server: CpuServer) -> int:
    status, props, _ = _call(hybrid_server, "GET", "/props")
    assert status == 200, props
    return int(props["n_ctx"])


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize(("name", "raw", "param"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_are_refused_in_one_shape(
    hybrid_server: CpuServer, method: str, path: str, name: str, raw: bytes, param: str | None
) -> None:
    status, got, _ = _call(hybrid_server, method, path, raw)
    err = assert_error(status, got, 400, param if param is not None else "*")
    if param is None:
        assert err["code"] in ("invalid_json", "invalid_value"), err


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
def test_prompts_get_the_checks_of_generate(
    hybrid_server: CpuServer, context_len: int, method: str, path: str
) -> None:
    # /generate refuses both with 400; so does every route of ours (issue #38: 500 before).
    status, got = _post(hybrid_server, method, path, {"input_ids": [5, 6, VOCAB]})
    err = assert_error(status, got, 400, "input_ids[2]")
    assert err["code"] == "out_of_vocabulary" and f"[0, {VOCAB})" in err["message"], err
    status, got = _post(hybrid_server, method, path, {"input_ids": toks(1, context_len + 10)})
    err = assert_error(status, got, 400, "input_ids")
    assert err["code"] == "context_length_exceeded", err
    for reference in (
        {"input_ids": [5, 6, VOCAB]},
        {"input_ids": toks(1, context_len + 10)},
    ):
        status, gen = hybrid_server.post_json(
            "/generate", {**reference, "sampling_params": {"max_new_tokens": 1}}
        )
        assert status == 400, gen  # the same verdict /generate gives


def test_the_issues_mistakes(hybrid_server: CpuServer) -> None:
    ids = toks(2, 150)
    s, got = _post(hybrid_server, "POST", "/hybrid/boundaries", {"input_ids": ids, "cutt": 5})
    assert_error(s, got, 400, "cutt")
    s, got = _post(hybrid_server, "POST", "/hybrid/boundaries", {"input_ids": ids, "cut": True})
    assert_error(s, got, 400, "cut")
    s, got = _post(hybrid_server, "POST", "/hybrid/boundaries", {"input_ids": ids, "cut": 151})
    assert_error(s, got, 400, "cut")
    s, got = _post(
        hybrid_server, "POST", "/hybrid/boundaries", {"input_ids": ids, "snap_tolerance": -1}
    )
    assert_error(s, got, 400, "snap_tolerance")
    body = {"input_ids": ids, "durable": True, "ttl_s": 1e308}
    s, got = _post(hybrid_server, "POST", "/hybrid/checkpoint", body)
    assert_error(s, got, 400, "ttl_s")
    s, got = _post(hybrid_server, "POST", "/hybrid/checkpoint", {"input_ids": ids, "durable": 1})
    assert_error(s, got, 400, "durable")
    s, got = _post(hybrid_server, "POST", "/hybrid/checkpoint", {"input_ids": ids, "ttl_s": 5})
    assert_error(s, got, 400, "ttl_s")
    # Nothing pinned at a prompt the server never saw, and a pin released twice: 404.
    s, got = _post(hybrid_server, "DELETE", "/hybrid/checkpoint", {"input_ids": toks(3, 100)})
    assert assert_error(s, got, 404)["code"] == "no_checkpoint"
    s, got = _post(hybrid_server, "POST", "/hybrid/checkpoint", {"input_ids": ids, "durable": True})
    assert s == 200 and got["checkpoint"]["durable"], got
    s, got = _post(hybrid_server, "DELETE", "/hybrid/checkpoint", {"input_ids": ids})
    assert s == 200 and not got["checkpoint"]["durable"], got
    s, got = _post(hybrid_server, "DELETE", "/hybrid/checkpoint", {"input_ids": ids})
    assert assert_error(s, got, 404)["code"] == "not_durable"


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("?id_slot=99", 404, "id_slot"),
        ("?rid=nope", 404, "rid"),
        ("?id_slot=x", 400, "id_slot"),
        ("?id_slot=-1", 400, "id_slot"),
        ("?id_slot=1e3", 400, "id_slot"),
        ("?id_slot=99999999999999999999", 400, "id_slot"),
        ("?id_slot=0&rid=a", 400, None),
        ("?bogus=1", 400, "bogus"),
    ],
)
def test_slot_queries(hybrid_server: CpuServer, query: str, status: int, param: str | None) -> None:
    generate(hybrid_server, toks(4, 80), max_new=2)  # at least one recent sequence
    s, got, _ = _call(hybrid_server, "GET", "/slots" + query)
    assert_error(s, got, status, param)


def test_other_methods_and_queries(hybrid_server: CpuServer) -> None:
    for method, path in (("GET", "/hybrid/boundaries"), ("PUT", "/hybrid/checkpoint")):
        s, got, headers = _call(hybrid_server, method, path)
        err = assert_error(s, got, 405)
        assert err["code"] == "method_not_allowed" and headers.get("allow"), (err, headers)
    s, got, _ = _call(hybrid_server, "GET", "/props?verbose=1")
    assert_error(s, got, 400, "verbose")
    s, got, _ = _call(hybrid_server, "POST", "/hybrid/boundaries?x=1", b'{"input_ids": [1, 2]}')
    assert_error(s, got, 400, "x")


def test_still_serving_after_every_mistake(hybrid_server: CpuServer) -> None:
    out = generate(hybrid_server, toks(5, 120), max_new=3)
    assert len(out["output_ids"]) == 3
    s, got = _post(hybrid_server, "POST", "/hybrid/boundaries", {"input_ids": toks(5, 120)})
    assert s == 200 and got["prompt_tokens"] == 120, got
