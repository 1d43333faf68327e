"""The tiny models' chat template at token level, with the boundaries a template knows.

Contract:
- ``TemplateTokens.build()`` encodes the template's fixed strings with the tiny tokenizer
  (``sglang_hybrid.cpu.tiny_tokenizer``); marker ids (``<|im_start|>``, ``<think>``, ...) are the
  tokenizer's single tokens. ``markers`` lists every id content must avoid.
- ``render(messages, tools, add_generation_prompt)`` produces exactly the token sequence whose
  decoding equals ``CHAT_TEMPLATE`` rendered on the same messages with their content decoded
  (tested), plus boundaries: ``structural`` after the system / tools block, ``message`` after
  every later message, ``opener`` at the start of the generation opener; ``ends`` gives where
  each message ends. Messages are ``Message`` records holding content as token arrays.
- As in Qwen3 templates, an assistant message's ``reasoning`` is rendered only when it comes
  after the last user message; earlier turns lose it. Tool messages render as one user block of
  ``<tool_response>`` entries per run.
- ``assistant_output(message)`` is what the model generates after the opener for that message
  (thinking kept, ``<|im_end|>`` last): a prompt that appends the message renders exactly the
  opener, this output and a newline, so agent loops echo answers token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sglang_hybrid.cpu import tiny_tokenizer as tt

Tokens = np.ndarray  # int32 token ids


@dataclass(slots=True)
class ToolCall:
    name: Tokens  # the JSON-quoted function name, e.g. tokens of '"search"'
    arguments: Tokens  # the arguments JSON text


@dataclass(slots=True)
class Message:
    role: str  # system, user, assistant or tool
    content: Tokens
    reasoning: Tokens | None = None  # assistant thinking (kept only in the current turn)
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)


class Boundary(NamedTuple):
    position: int  # a frontier: tokens [0, position) precede it
    kind: str  # structural, message or opener (``sglang_hybrid.sglang.hints`` kinds)


class Rendered(NamedTuple):
    ids: Tokens
    boundaries: list[Boundary]
    ends: list[int]  # where each message's tokens end (a tool inside a run: its response end)


def _arr(ids: Sequence[int]) -> Tokens:
    return np.asarray(ids, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class TemplateTokens:
    im_start: int
    im_end: int
    think: int
    think_end: int
    markers: frozenset[int]
    system_header: Tokens  # "system\n"
    user_header: Tokens  # "user\n"
    assistant_header: Tokens  # "assistant\n"
    tool_run_header: Tokens  # "user" (tool responses follow on new lines)
    nl: Tokens  # "\n"
    nl2: Tokens  # "\n\n"
    tools_intro: Tokens  # "# Tools ... <tools>"
    tools_outro: Tokens  # "\n</tools>\n\nAnswer a call with <tool_call>...</tool_call>."
    think_open: Tokens  # "<think>\n"
    think_close: Tokens  # "\n</think>\n\n"
    call_open: Tokens  # '<tool_call>{"name": '
    call_mid: Tokens  # ', "arguments": '
    call_close: Tokens  # "}</tool_call>"
    response_open: Tokens  # "\n<tool_response>\n"
    response_close: Tokens  # "\n</tool_response>"

    @classmethod
    def build(cls) -> TemplateTokens:
        tok = tt.build_tokenizer()

        def enc(text: str) -> Tokens:
            return _arr(tok.encode(text, add_special_tokens=False).ids)

        def one(text: str) -> int:
            token_id = tok.token_to_id(text)
            if token_id is None:
                raise RuntimeError(f"{text!r} is not a single token of the tiny tokenizer")
            return int(token_id)

        return cls(
            im_start=one(tt.IM_START),
            im_end=one(tt.IM_END),
            think=one("<think>"),
            think_end=one("</think>"),
            markers=frozenset(one(t) for t in (*tt.SPECIAL_TOKENS, *tt.TAG_TOKENS)),
            system_header=enc("system\n"),
            user_header=enc("user\n"),
            assistant_header=enc("assistant\n"),
            tool_run_header=enc("user"),
            nl=enc("\n"),
            nl2=enc("\n\n"),
            tools_intro=enc(
                "# Tools\n\nYou may call functions. Their signatures are listed in "
                "<tools></tools>:\n<tools>"
            ),
            tools_outro=enc(
                '\n</tools>\n\nAnswer a call with <tool_call>{"name": ..., "arguments": ...}'
                "</tool_call>."
            ),
            think_open=enc("<think>\n"),
            think_close=enc("\n</think>\n\n"),
            call_open=enc('<tool_call>{"name": '),
            call_mid=enc(', "arguments": '),
            call_close=enc("}</tool_call>"),
            response_open=enc("\n<tool_response>\n"),
            response_close=enc("\n</tool_response>"),
        )

    # ------------------------------------------------------------------ pieces
    def opener(self) -> Tokens:
        return np.concatenate([_arr([self.im_start]), self.assistant_header])

    def _assistant_body(self, m: Message, keep_thinking: bool) -> list[Tokens]:
        parts: list[Tokens] = []
        if keep_thinking and m.reasoning is not None and len(m.reasoning):
            parts += [self.think_open, m.reasoning, self.think_close]
        parts.append(m.content)
        for i, call in enumerate(m.tool_calls):
            if len(m.content) or i:
                parts.append(self.nl)
            parts += [self.call_open, call.name, self.call_mid, call.arguments, self.call_close]
        return parts

    def assistant_output(self, m: Message) -> Tokens:
        """What the model generates after the opener for ``m`` (see the module contract)."""
        return np.concatenate([*self._assistant_body(m, True), _arr([self.im_end])])

    # ------------------------------------------------------------------ render
    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tokens] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        """Token ids and boundaries of ``messages`` (see the module contract)."""
        parts: list[Tokens] = []
        bounds: list[Boundary] = []
        ends: list[int] = []
        pos = 0

        def put(*xs: Tokens) -> None:
            nonlocal pos
            for x in xs:
                parts.append(x)
                pos += len(x)

        start, end = _arr([self.im_start]), _arr([self.im_end])
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        has_system = bool(messages) and messages[0].role == "system"
        if tools:
            put(start, self.system_header)
            if has_system:
                put(messages[0].content, self.nl2)
            put(self.tools_intro)
            for t in tools:
                put(self.nl, t)
            put(self.tools_outro, end, self.nl)
        elif has_system:
            put(start, self.system_header, messages[0].content, end, self.nl)
        if tools or has_system:
            bounds.append(Boundary(pos, "structural"))
        for i, m in enumerate(messages):
            if i == 0 and has_system:
                ends.append(pos)
                continue
            if m.role in ("system", "user"):
                header = self.user_header if m.role == "user" else self.system_header
                put(start, header, m.content, end, self.nl)
            elif m.role == "assistant":
                put(start, self.assistant_header)
                put(*self._assistant_body(m, i > last_user))
                put(end, self.nl)
            elif m.role == "tool":
                if i == 0 or messages[i - 1].role != "tool":
                    put(start, self.tool_run_header)
                put(self.response_open, m.content, self.response_close)
                if i == len(messages) - 1 or messages[i + 1].role != "tool":
                    put(end, self.nl)
                else:
                    ends.append(pos)
                    continue  # the run's block is still open: no message boundary yet
            else:
                raise ValueError(f"unknown role {m.role!r}")
            ends.append(pos)
            bounds.append(Boundary(pos, "message"))
        if add_generation_prompt:
            bounds.append(Boundary(pos, "opener"))
            put(self.opener())
        ids = np.concatenate(parts) if parts else _arr([])
        return Rendered(ids, bounds, ends)
