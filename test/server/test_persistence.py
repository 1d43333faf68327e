"""``--hybrid-cache-file`` on SGLang's real server (spec §5.5): stop, restart, resume from host.

One module: a server with a host tier and the file serves turn 1 of a conversation and two turns
of a chat, pins two durable checkpoints (one with a TTL) and is stopped the way an operator stops
it (SIGTERM to the process group); a second server on the same file answers turn 2 from the
restored host tier, holds the pin without a TTL again and serves the chat's turn 1 again from the
saved states; a third one, whose model config differs (the same weights in another directory
with one more config key), must load nothing, say why, and serve turn 2 uncached, the reference
for the second server's output.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer, ServerConfig
from sglang_hybrid.replay.chat_session import WORDS
from sglang_hybrid.store.cache_file import read_cache_file, verify_slabs


class Runs(NamedTuple):
    file: Path
    logs: dict[str, str]
    turn2: dict[str, dict]  # server name -> /generate answer
    saved_after_first: bool
    pins: dict[str, bool | None]  # "kept" / "timed" -> durable after the restart (None: gone)
    chat: dict[str, dict]  # "first" (uncached turn 1), "again" (turn 1 after the restart)
    system_end: int  # where the chat's system prompt ends (its structural checkpoint)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS[:12]) for _ in range(n))


def _chat(server: CpuServer, messages: list[dict]) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, out = server.post_json("/v1/chat/completions", body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("persist")
    cache_file = root / "host.cache"
    model = tiny_models["qwen3_next"]
    other = root / "model-copy"
    shutil.copytree(model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["sglang_hybrid_test_note"] = "same weights, another config digest"
    (other / "config.json").write_text(json.dumps(cfg))

    def config(path: Path) -> ServerConfig:
        return ServerConfig(
            path,
            cache="hybrid",
            chunked_prefill_size=128,
            host_cache_mib=64,
            extra=["--hybrid-cache-file", str(cache_file)],
        )

    turn1 = toks(11, 300)
    logs: dict[str, str] = {}
    turn2: dict[str, dict] = {}
    pinned = {"kept": toks(13, 200), "timed": toks(14, 150)}
    # A chat whose second turn supersedes the first turn's states (issue #38: a restart kept
    # none of them, so turn 1 again was computed from scratch).
    chat1 = [
        {"role": "system", "content": _words(15, 300)},
        {"role": "user", "content": _words(16, 60)},
    ]
    chat: dict[str, dict] = {}
    first = CpuServer(config(model), root / "first.log", on_progress=print)
    with first:
        out1 = generate(first, turn1)
        assert out1["meta_info"]["cached_tokens"] == 0
        chat["first"] = _chat(first, chat1)
        reply = chat["first"]["choices"][0]["message"]["content"]
        chat2 = [*chat1, {"role": "assistant", "content": reply}]
        _chat(first, [*chat2, {"role": "user", "content": _words(17, 50)}])
        status, got = first.post_json("/hybrid/boundaries", {"messages": chat1})
        assert status == 200, got
        kinds = {c["kind"]: c["position"] for c in got["checkpoints"]}
        assert "structural" in kinds, got
        system_end = kinds["structural"]
        for name, ids in pinned.items():
            body = {"input_ids": ids, "durable": True}
            if name == "timed":
                body["ttl_s"] = 600
            status, got = first.post_json("/hybrid/checkpoint", body)
            assert status == 200 and got["checkpoint"]["durable"], got
    logs["first"] = first.log_path.read_text(errors="replace")
    saved = cache_file.exists()
    ids2 = turn1 + out1["output_ids"] + toks(12, 70)
    pins: dict[str, bool | None] = {}
    for name, path in (("restored", model), ("mismatched", other)):
        server = CpuServer(config(path), root / f"{name}.log", on_progress=print)
        with server:
            if name == "restored":
                chat["again"] = _chat(server, chat1)
                for pin, ids in pinned.items():
                    status, got = server.post_json("/hybrid/boundaries", {"input_ids": ids})
                    assert status == 200, got
                    at = [c for c in got["checkpoints"] if c["position"] == len(ids)]
                    pins[pin] = at[0]["durable"] if at else None
            turn2[name] = generate(server, ids2)
        logs[name] = server.log_path.read_text(errors="replace")
    yield Runs(cache_file, logs, turn2, saved, pins, chat, system_end)


def test_an_orderly_stop_saves_the_host_tier(runs: Runs) -> None:
    assert runs.saved_after_first, runs.logs["first"][-3000:]
    assert "saving host tier to" in runs.logs["first"]
    assert "host tier saved to" in runs.logs["first"]
    cf = read_cache_file(runs.file)  # (the last server's save; each stop replaces the file)
    assert cf.records.snapshots and verify_slabs(cf) == []


def test_a_restart_resumes_the_conversation_from_the_host(runs: Runs) -> None:
    log = runs.logs["restored"]
    assert "host tier restored from" in log, log[-3000:]
    meta = runs.turn2["restored"]["meta_info"]
    # turn 1's endpoint (300 prompt + 8 output tokens, minus the last) came back from the host
    assert meta["cached_tokens"] >= 256, meta
    details = meta.get("cached_tokens_details") or {}
    assert details.get("host", 0) > 0 and set(details) == {"device", "host"}, meta


def test_a_durable_pin_without_a_ttl_is_kept_across_the_restart(runs: Runs) -> None:
    """The pin a client left without a TTL is held again; the one with a TTL (a timer of the
    stopped server) comes back as an ordinary checkpoint."""
    assert runs.pins == {"kept": True, "timed": False}, runs.pins
    assert "(1 durable)" in runs.logs["restored"]


def test_the_restored_output_equals_the_uncached_one(runs: Runs) -> None:
    uncached = runs.turn2["mismatched"]
    assert uncached["meta_info"]["cached_tokens"] == 0
    assert runs.turn2["restored"]["output_ids"] == uncached["output_ids"]


def test_a_mismatched_fingerprint_loads_nothing_and_says_why(runs: Runs) -> None:
    log = runs.logs["mismatched"]
    assert "host tier not restored from" in log, log[-3000:]
    assert "the fingerprint differs" in log and "model_config" in log
    assert "host tier restored from" not in log


def test_a_restart_resumes_the_chats_first_turn(runs: Runs) -> None:
    """Turn 1 of a chat whose turn 2 superseded turn 1's states (and whose states may have lived
    on the device only) resumes after the restart, at least from the system prompt's state, with
    the output of the uncached first run (issue #38)."""
    first, again = runs.chat["first"], runs.chat["again"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= runs.system_end > 0, (cached, runs.system_end)
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
