"""The boundary API over HTTP (issue #16): SGLang's real server on the CPU, our routes on its app,
answered by the scheduler's cache through SGLang's control path."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer
from sglang_hybrid.replay.chat_session import WORDS


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS[:12]) for _ in range(n))


def _get(server: CpuServer, path: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(f"{server.url}{path}", timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _request(server: CpuServer, method: str, path: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _kinds(reply: dict) -> dict[int, str]:
    return {c["position"]: c["kind"] for c in reply["checkpoints"]}


def test_boundaries_of_a_served_prompt(hybrid_server: CpuServer) -> None:
    a = toks(101, 400)
    out = generate(hybrid_server, a, max_new=80)  # the endpoint lands a block past the tail tap
    seq = a + out["output_ids"]
    status, got = hybrid_server.post_json(
        "/hybrid/boundaries", {"input_ids": seq + toks(102, 20), "cut": 420}
    )
    assert status == 200, got
    points = _kinds(got)
    assert points[len(seq) - 1] == "endpoint", got
    assert got["reusable_now"]["tokens"] == len(seq) - 1
    assert got["cut"]["verdict"] in ("aligned", "snapped") and got["cut"]["reason"]
    # What it reported is what the next request gets.
    p = got["cut"]["retained_prefix_tokens"]
    nxt = generate(hybrid_server, seq[:p] + toks(103, 10), max_new=2)
    assert nxt["meta_info"]["cached_tokens"] == p


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("not json", 400, "not valid JSON"),
        ({}, 400, "exactly one of input_ids, text or messages"),
        ({"input_ids": [1, 2], "text": "a"}, 400, "exactly one of"),
        ({"input_ids": [1, -2]}, 400, "input_ids[1] is -2, outside the model's vocabulary"),
        ({"input_ids": [1, 2], "cut": 3}, 400, "a cut is a token position in [0, 2]"),
        ({"input_ids": [1, 2], "snap_tolerance": "x"}, 400, "snap_tolerance"),
        ({"messages": "hi"}, 400, "messages: Input should be a valid list"),
        ({"messages": [{"role": "nobody", "content": 3}]}, 400, "could not be rendered"),
    ],
)
def test_bad_boundary_queries_name_the_problem(
    hybrid_server: CpuServer, body: object, status: int, message: str
) -> None:
    if isinstance(body, str):
        req = urllib.request.Request(
            f"{hybrid_server.url}/hybrid/boundaries",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=60)
            raise AssertionError("a body that is not JSON was accepted")
        except urllib.error.HTTPError as e:
            got_status, got = e.code, json.loads(e.read())
    else:
        got_status, got = hybrid_server.post_json("/hybrid/boundaries", body)
    assert got_status == status and message in got["error"]["message"], got
    generate(hybrid_server, toks(104, 50), max_new=2)  # still serving


def test_text_and_messages_are_tokenized_as_the_server_does(hybrid_server: CpuServer) -> None:
    text = _text(5, 80)
    status, by_text = hybrid_server.post_json("/hybrid/boundaries", {"text": text})
    assert status == 200 and by_text["prompt_tokens"] > 0, by_text
    msgs = [{"role": "system", "content": _text(6, 120)}, {"role": "user", "content": _text(7, 90)}]
    status, chat = hybrid_server.post_json(
        "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, chat
    status, got = hybrid_server.post_json("/hybrid/boundaries", {"messages": msgs})
    assert status == 200, got
    # The rendering the chat request prefilled is the rendering queried: its taps are on it.
    assert got["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert got["checkpoints"], got


def test_cache_control_on_a_message_is_an_explicit_checkpoint(hybrid_server: CpuServer) -> None:
    msgs = [
        {"role": "system", "content": _text(11, 150)},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": _text(12, 200), "cache_control": {"type": "ephemeral"}}
            ],
        },
        {"role": "assistant", "content": _text(13, 30)},
        {"role": "user", "content": _text(14, 120)},
    ]
    status, out = hybrid_server.post_json(
        "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 3, "temperature": 0}
    )
    assert status == 200, out
    status, got = hybrid_server.post_json("/hybrid/boundaries", {"messages": msgs})
    assert status == 200, got
    assert "explicit" in _kinds(got).values(), got
    # The same conversation without the marker: no explicit checkpoint of its own.
    plain = [dict(m) for m in msgs]
    plain[1] = {"role": "user", "content": _text(15, 200)}
    hybrid_server.post_json(
        "/v1/chat/completions", {"model": "m", "messages": plain, "max_tokens": 3}
    )
    status, got = hybrid_server.post_json("/hybrid/boundaries", {"messages": plain})
    assert status == 200 and "explicit" not in _kinds(got).values(), got


def test_cache_control_on_anthropic_messages(hybrid_server: CpuServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 3,
        "system": [{"type": "text", "text": _text(21, 150)}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": _text(22, 220), "cache_control": {"type": "ephemeral"}}
                ],
            },
            {"role": "assistant", "content": _text(23, 20)},
            {"role": "user", "content": _text(24, 100)},
        ],
    }
    status, out = hybrid_server.post_json("/v1/messages", body)
    assert status == 200, out
    as_chat = [{"role": "system", "content": body["system"][0]["text"]}]
    for m in body["messages"]:
        content = m["content"]
        text = content if isinstance(content, str) else content[0]["text"]
        as_chat.append({"role": m["role"], "content": text})
    status, got = hybrid_server.post_json("/hybrid/boundaries", {"messages": as_chat})
    assert status == 200, got
    assert "explicit" in _kinds(got).values(), got


def test_a_checkpoint_is_pinned_at_the_prefix_end(hybrid_server: CpuServer) -> None:
    prefix = toks(31, 300)
    status, got = hybrid_server.post_json("/hybrid/checkpoint", {"input_ids": prefix})
    assert status == 200, got
    assert got["checkpoint"]["position"] == 300 and got["checkpoint"]["full_state"]
    assert got["computed_tokens"] > 0
    status, again = hybrid_server.post_json("/hybrid/checkpoint", {"input_ids": prefix})
    assert status == 200 and again["computed_tokens"] == 0, again
    nxt = generate(hybrid_server, prefix + toks(32, 10), max_new=2)
    assert nxt["meta_info"]["cached_tokens"] == 300
    status, durable = hybrid_server.post_json(
        "/hybrid/checkpoint", {"input_ids": prefix, "durable": True, "ttl_s": 600}
    )
    assert status == 200 and durable["checkpoint"]["durable"], durable
    status, bad = hybrid_server.post_json("/hybrid/checkpoint", {"input_ids": prefix, "ttl_s": 5})
    assert status == 400 and bad["error"]["param"] == "ttl_s", bad
    status, released = _request(
        hybrid_server, "DELETE", "/hybrid/checkpoint", {"input_ids": prefix}
    )
    assert status == 200 and not released["checkpoint"]["durable"], released


def test_llama_cpp_discovery(hybrid_server: CpuServer) -> None:
    status, props = _get(hybrid_server, "/props")
    assert status == 200 and props["n_ctx"] > 0 and props["total_slots"] > 0, props
    assert props["checkpoints"]["full_state"] and not props["checkpoints"]["partial_state_only"]
    generate(hybrid_server, toks(41, 200), max_new=3)
    status, slots = _get(hybrid_server, "/slots")
    assert status == 200 and isinstance(slots, list) and slots, slots
    assert {"id", "n_ctx", "is_processing", "checkpoints"} <= set(slots[0])
    status, first = _get(hybrid_server, "/slots?id_slot=0")
    assert status == 200 and first["id"] == 0
    assert _get(hybrid_server, "/slots?id_slot=9999")[0] == 404
    assert _get(hybrid_server, "/slots?id_slot=x")[0] == 400
    info = hybrid_server.get_json("/get_server_info")
    assert info["hybrid_cache"]["checkpoints"] == "full-state"
