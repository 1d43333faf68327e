"""The token-level template against the tiny tokenizer's real Jinja chat template."""

import json

import numpy as np
import pytest

from sglang_hybrid.cpu import tiny_tokenizer as tt
from sglang_hybrid.replay.generators.template import Message, ToolCall

TOOL = {
    "type": "function",
    "function": {"name": "search", "description": "Search", "parameters": {"type": "object"}},
}
CHAT = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Find the weather in Paris."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "tool", "content": '{"condition": "sunny"}'},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Done."},
    {"role": "user", "content": "And tomorrow?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Call again.",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": '{"city": "Paris", "day": 1}'}},
            {"function": {"name": "search", "arguments": '{"query": "x"}'}},
        ],
    },
    {"role": "tool", "content": '{"temperature": 18}'},
]


@pytest.fixture(scope="module")
def tok():
    return tt.build_tokenizer()


@pytest.fixture(scope="module")
def hf(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=tt.CHAT_TEMPLATE, eos_token=tt.IM_END
    )


def to_message(m, enc):
    calls = tuple(
        ToolCall(enc(json.dumps(c["function"]["name"])), enc(c["function"]["arguments"]))
        for c in m.get("tool_calls", [])
    )
    r = m.get("reasoning_content")
    return Message(m["role"], enc(m["content"]), enc(r) if r else None, calls)


def encoder(tok):
    return lambda s: np.asarray(tok.encode(s, add_special_tokens=False).ids, dtype=np.int32)


@pytest.mark.parametrize("cut", [2, 3, 5, 6, 7, len(CHAT)])
@pytest.mark.parametrize("with_tools", [True, False])
def test_render_decodes_to_the_jinja_template(template, tok, hf, cut, with_tools):
    enc = encoder(tok)
    msgs = CHAT[:cut]
    tools = [TOOL] if with_tools else None
    text = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    out = template.render(
        [to_message(m, enc) for m in msgs], [enc(json.dumps(TOOL))] if with_tools else []
    )
    assert tok.decode(out.ids.tolist(), skip_special_tokens=False) == text
    # Boundaries: structural after the system block, opener at the generation prompt.
    kinds = [b.kind for b in out.boundaries]
    assert kinds[0] == "structural" and kinds[-1] == "opener"
    opener = out.boundaries[-1].position
    assert tok.decode(out.ids[opener:].tolist(), skip_special_tokens=False) == (
        "<|im_start|>assistant\n"
    )
    for b in out.boundaries[:-1]:
        assert tok.decode(out.ids[: b.position].tolist(), skip_special_tokens=False).endswith(
            "<|im_end|>\n"
        )


def test_thinking_only_after_the_last_user(template, tok):
    enc = encoder(tok)
    ids = template.render([to_message(m, enc) for m in CHAT]).ids.tolist()
    think = template.think
    # Two assistant turns carry reasoning; only the one after the last user message keeps it.
    assert ids.count(think) == 1
    before_last_user = template.render([to_message(m, enc) for m in CHAT[:6]]).ids.tolist()
    assert before_last_user.count(think) == 2  # both after the only user message


def test_answer_is_echoed_token_for_token(template, tok):
    enc = encoder(tok)
    msgs = [to_message(m, enc) for m in CHAT[:7]]  # ends with a user message
    prompt = template.render(msgs).ids
    call = ToolCall(enc('"a"'), enc("{}"))
    answer = Message("assistant", enc("Tomorrow it rains."), enc("Read the result."), (call,))
    out = template.assistant_output(answer)
    assert out[-1] == template.im_end and template.think in out.tolist()
    nxt = template.render([*msgs, answer, Message("tool", enc("ok"))]).ids
    assert np.array_equal(nxt[: len(prompt) + len(out)], np.concatenate([prompt, out]))
    # A new user message strips that thinking: the echo breaks right after the opener.
    later = template.render([*msgs, answer, Message("user", enc("thanks"))]).ids
    assert np.array_equal(later[: len(prompt)], prompt)
    assert later[len(prompt)] != template.think
