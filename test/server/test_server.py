"""SGLang's real server on the CPU with ``--radix-cache hybrid`` and the CPU model worker."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer
from sglang_hybrid.replay.chat_session import WORDS


def test_the_server_reports_our_backend(hybrid_server: CpuServer) -> None:
    info = hybrid_server.get_json("/get_server_info")
    assert info["radix_cache_backend"] == "hybrid"
    assert info["device"] == "cpu"
    # Launched as documented, with no overlap or mamba-strategy flag: the plugin chose both.
    argv = hybrid_server.config.argv()
    assert "--disable-overlap-schedule" not in argv and "--mamba-radix-cache-strategy" not in argv
    assert info["disable_overlap_schedule"] is False  # SGLang's overlap loop runs
    assert info["mamba_radix_cache_strategy"] == "no_buffer"


def test_the_same_prompt_twice_resumes_at_the_prompt_tail_tap(hybrid_server: CpuServer) -> None:
    ids = toks(1, 300)
    first, again = generate(hybrid_server, ids), generate(hybrid_server, ids)
    assert first["meta_info"]["cached_tokens"] == 0
    # n - 1 (issue #37); SGLang's own cache gets 0
    assert again["meta_info"]["cached_tokens"] == 299
    assert again["output_ids"] == first["output_ids"]


def chat(server: CpuServer, messages: list[dict], max_tokens: int = 6) -> dict:
    status, out = server.post_json(
        "/v1/chat/completions",
        {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
    )
    assert status == 200, out
    return out


def test_chat_turns_report_cached_tokens_with_the_history_re_rendered(
    hybrid_server: CpuServer,
) -> None:
    words = WORDS[:12]  # the demo's words
    rng = random.Random(7)
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    # A user turn of > 64 tokens: a shorter one clusters the opener with the system-block end and
    # only the earlier is tapped (spec §7.1 proximity rule).
    msgs = [{"role": "system", "content": text(120)}, {"role": "user", "content": text(90)}]
    first = chat(hybrid_server, msgs)
    n1 = first["usage"]["prompt_tokens"]
    # The assistant turn comes back with its reasoning; the template strips it from history.
    msgs += [
        {"role": "assistant", "content": text(10), "reasoning_content": text(20)},
        {"role": "user", "content": text(12)},
    ]
    second = chat(hybrid_server, msgs)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"\nturn 1: {n1} prompt tokens; turn 2 reused {cached}")
    # The exact generation-opener tap sits at the start of turn 1's assistant header.
    assert n1 - 8 <= cached < n1


WEIGHTS = "does not support weight updates"

# Each hostile or unsupported request, the status it must get and a piece of its answer: a
# refusal (400) names what was refused.
HOSTILE: list[tuple[str, dict, int, str | None]] = [
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True}, 400, "support logprobs"),
    (
        "/generate",
        {"input_ids": [99999], "sampling_params": {"max_new_tokens": 2}},
        400,
        "outside the model's vocabulary",
    ),
    (
        "/generate",
        {"input_ids": [5] * 20000, "sampling_params": {"max_new_tokens": 2}},
        400,
        "longer than the model's context length",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "a+"}},
        400,
        "constrained decoding",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_p": 0.5}},
        400,
        "support top_p",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "logprobs": True,
        },
        400,
        "support logprobs",
    ),
    ("/v1/embeddings", {"model": "m", "input": "hi"}, 400, "not appear to be an embedding model"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, 400, WEIGHTS),
    ("/get_weights_by_name", {"name": "lm_head.weight"}, 400, "Get parameter by name failed"),
    (
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
        },
        400,
        WEIGHTS,
    ),
    ("/begin_weight_update", {}, 400, WEIGHTS),
    ("/update_weights_from_ipc", {"zmq_handles": {}}, 400, WEIGHTS),
    # SGLang's HTTP layer does not read the failed reply's `success` here (docs/server.md): 200
    # with an empty body, and the server goes on.
    ("/release_memory_occupation", {}, 200, None),
    ("/resume_memory_occupation", {}, 200, None),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}, 400, "--enable-lora"),
    ("/start_expert_distribution_record", {}, 200, "Start recording"),
    (
        "/send_weights_to_remote_instance",
        {"master_address": "127.0.0.1", "ports": "1", "group_name": "g"},
        400,
        "sending weights to a remote instance",
    ),
]


def still_serves(server: CpuServer) -> None:
    assert server.alive()
    ids = toks(2, 70)
    assert generate(server, ids, 3)["output_ids"] == generate(server, ids, 3)["output_ids"]


@pytest.mark.parametrize(
    "path,body,status,says", HOSTILE, ids=[f"{p}#{i}" for i, (p, *_) in enumerate(HOSTILE)]
)
def test_no_endpoint_takes_the_server_down(
    hybrid_server: CpuServer, path: str, body: dict, status: int, says: str | None
) -> None:
    got, out = hybrid_server.post_json(path, body, timeout_s=60)
    print(f"\n{path}: {got} {str(out)[:160]}")
    assert got == status, out
    if says is not None:
        assert says in str(out), out
    still_serves(hybrid_server)


NEED = "a prompt needs at least one token"
EMPTY_PROMPTS: list[tuple[str, dict, str]] = [
    ("/generate", {"text": ""}, "text is empty: " + NEED),
    ("/generate", {"text": [""]}, "text[0] is empty: " + NEED),
    ("/generate", {"text": ["hi", ""]}, "text[1] is empty: " + NEED),
    ("/generate", {"text": []}, "text is empty: " + NEED),
    ("/generate", {"input_ids": [[5, 6], []]}, "input_ids[1] is empty: " + NEED),
    ("/generate", {"input_ids": [[]]}, "input_ids[0] is empty: " + NEED),
    ("/generate", {"input_ids": []}, "input_ids cannot be empty"),  # SGLang's own refusal
    ("/v1/completions", {"model": "m", "prompt": ["a", ""]}, "text[1] is empty: " + NEED),
    ("/v1/completions", {"model": "m", "prompt": ""}, "Prompt cannot be empty"),  # SGLang's
    ("/v1/completions", {"model": "m", "prompt": [[]]}, "Prompt cannot be empty"),  # SGLang's
    ("/v1/chat/completions", {"model": "m", "messages": []}, "Messages cannot be empty"),
]


@pytest.mark.parametrize(
    "path,body,says", EMPTY_PROMPTS, ids=[f"{p}:{json.dumps(b)}" for p, b, _ in EMPTY_PROMPTS]
)
def test_an_empty_prompt_is_refused_and_the_server_keeps_serving(
    hybrid_server: CpuServer, path: str, body: dict, says: str
) -> None:
    """Every zero-token prompt shape is answered 400 before it reaches the scheduler (one of
    them, batched with a good prompt, used to kill the scheduler and every process)."""
    if path == "/generate":
        body = {**body, "sampling_params": {"max_new_tokens": 2}}
    else:
        body = {**body, "max_tokens": 2}
    got, out = hybrid_server.post_json(path, body, timeout_s=60)
    assert got == 400 and says in str(out), (got, out)
    still_serves(hybrid_server)


def test_an_empty_streamed_prompt_ends_its_stream_with_the_refusal(
    hybrid_server: CpuServer,
) -> None:
    """A stream has answered 200 before the request is read; SGLang reports a refusal as the
    stream's error event with code 400, as for any invalid streamed request."""
    body = {"text": ["hi", ""], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    got, out = hybrid_server.post_json("/generate", body, timeout_s=60)
    events = [json.loads(line[6:]) for line in str(out).splitlines() if line[6:].startswith("{")]
    assert got == 200 and events == [
        {
            "error": {
                "message": "text[1] is empty: " + NEED + ".",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }
    ], out
    still_serves(hybrid_server)


def test_refusals_name_the_missing_feature(hybrid_server: CpuServer) -> None:
    status, out = hybrid_server.post_json(
        "/generate", {"input_ids": [5, 6, 7], "return_logprob": True}
    )
    assert status == 400 and "does not support logprobs" in str(out)
    status, out = hybrid_server.post_json("/update_weights_from_disk", {"model_path": "/x"})
    assert status == 400 and out["success"] is False and "weight updates" in out["message"]


def test_a_frontend_program_forks_over_a_cached_prefix(hybrid_server: CpuServer) -> None:
    """``sglang.function`` with ``fork`` through ``RuntimeEndpoint``: branches hit the prefix.

    The three branches are sent together (SGLang's frontend sends no commit request for the
    document first). The first one admitted prefills the shared document in chunks (one chunked
    request per pass); a branch that arrives while it is chunked is held, and resumes at the
    block below the divergence, which the first one taps for it. A branch that arrives only
    after the first one's last prefill pass began finds no state inside the document yet and
    computes it again: on a loaded 2-core machine one of them can (CI saw [0, 0, 384] once), so
    the first run asserts only that the document was not computed by all three. The second run
    over the same document (new questions) hits on every branch, whatever the timing. SGLang's
    own cache keeps no state inside the document and would reuse nothing here.
    """
    import sglang as sgl

    words = ["cache", "state", "block", "agent", "tool", "file", "test", "loop", "prefix"]
    rng = random.Random(11)
    doc = "Document: " + " ".join(rng.choice(words) for _ in range(260)) + "."

    @sgl.function
    def branches(s, doc: str, topic: str):
        s += doc
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Question {i} on {topic}: which word comes first?"
            f += sgl.gen("answer", max_tokens=3, temperature=0)
        return [f.get_meta_info("answer") for f in forks]

    backend = sgl.RuntimeEndpoint(hybrid_server.url)
    n_doc = len(hybrid_server.post_json("/tokenize", {"prompt": doc})[1]["tokens"])
    floor = (n_doc - 1) // 64 * 64
    first = [m["cached_tokens"] for m in branches.run(doc, "order", backend=backend).ret_value]
    second = [m["cached_tokens"] for m in branches.run(doc, "counts", backend=backend).ret_value]
    print(f"\ndocument of {n_doc} tokens; branches reused {first}, then {second}")
    assert sorted(first)[0] == 0 and sorted(first)[-1] >= floor
    assert all(c >= floor for c in second)


def test_live_replay_client_against_the_server(hybrid_server: CpuServer) -> None:
    import numpy as np

    from sglang_hybrid.replay.live import chat_request, from_trace, run_replay, summarize
    from sglang_hybrid.replay.trace import Trace, TraceRequest

    base = np.array(toks(21, 200), dtype=np.int32)
    trace = Trace(
        "live-test",
        [
            TraceRequest("a", base, 4, arrival_s=0.0),
            TraceRequest("b", np.concatenate([base, base[:10]]), 4, after=("a",), delay_s=0.1),
            TraceRequest("c", np.array(toks(22, 90), dtype=np.int32), 4, arrival_s=0.05),
        ],
        "test",
    )
    msgs = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "hi"}]
    reqs = [*from_trace(trace), chat_request("d", msgs, max_tokens=4, after=("c",))]
    seen: list[str] = []
    results = run_replay(
        hybrid_server.url, reqs, concurrency=2, on_result=lambda r: seen.append(r.rid)
    )
    by = {r.rid: r for r in results}
    assert [r.rid for r in results] == ["a", "b", "c", "d"] and sorted(seen) == ["a", "b", "c", "d"]
    assert all(r.error is None for r in results), [r.error for r in results]
    assert by["b"].cached_tokens >= 192  # a's prompt-tail tap
    assert by["b"].sent_at_s >= by["a"].sent_at_s + by["a"].latency_s  # closed loop honoured
    assert all(r.completion_tokens == 4 and 0 < r.ttft_s <= r.latency_s for r in results)
    assert summarize(results)["failed"] == 0


def test_the_live_cli_replays_the_demo_session(hybrid_server: CpuServer, tmp_path: Path) -> None:
    from sglang_hybrid.replay.cli import main

    out = tmp_path / "live.json"
    argv = ["live", "--url", hybrid_server.url, "--trace", "demo-session", "--max-tokens", "4"]
    assert main([*argv, "--concurrency", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    by = {r["rid"]: r for r in report["requests"]}
    assert len(by) == 9 and report["summary"]["failed"] == 0
    # A retry resends the same prompt: everything but the last token comes from the prompt tail.
    retry = by["main-4-retry"]
    assert retry["cached_tokens"] >= retry["prompt_tokens"] - 64
    # The subagent shares the system + tools preamble (~94% of its prompt) and diverges inside a
    # block, right after it: the structural tap there serves it.
    assert by["sub-1"]["cached_tokens"] >= 0.8 * by["sub-1"]["prompt_tokens"]
    assert all(r["completion_tokens"] == 4 for r in by.values())


def test_the_live_cli_names_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_hybrid.replay.cli import main

    argv = ["live", "--url", "http://127.0.0.1:9", "--trace", "shared-prefix"]
    assert main([*argv, "--gsp-num-groups", "1", "--gsp-prompts-per-group", "2"]) == 2
    assert "127.0.0.1:9" in capsys.readouterr().err
