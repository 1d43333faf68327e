"""A conversation: messages rendered into prompts, tap hints and scripted answers.

Contract:
- ``Conversation(template, tools, messages)`` holds one chat (system first when present).
- ``prompt()`` renders the messages with the generation opener and returns a ``Prompt``: token
  ids and the hints a template-aware server would attach (``structural`` after the system /
  tools block, ``message`` after each message, ``opener`` at the generation opener, and
  ``explicit`` at the end of ``breakpoint`` messages when a client marked one, e.g. a compacting
  harness marking the head it keeps).
- ``answer(message)`` is the scripted output for the next request: what the model generates
  after the opener (``TemplateTokens.assistant_output``). Appending that message and rendering
  again reproduces prompt + answer + newline, until a later user message strips its thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .template import Message, TemplateTokens, Tokens


class Prompt(NamedTuple):
    ids: Tokens
    hint_positions: tuple[int, ...]
    hint_kinds: tuple[str, ...]
    message_ends: list[int]


@dataclass(slots=True)
class Conversation:
    template: TemplateTokens
    tools: Sequence[Tokens]
    messages: list[Message] = field(default_factory=list)
    breakpoint: int | None = None  # an explicit hint after this many messages

    def prompt(self) -> Prompt:
        r = self.template.render(self.messages, self.tools, add_generation_prompt=True)
        hints = [(b.position, b.kind) for b in r.boundaries if b.position > 0]
        if self.breakpoint is not None and 0 < self.breakpoint <= len(r.ends):
            hints.append((r.ends[self.breakpoint - 1], "explicit"))
        hints.sort()
        return Prompt(
            r.ids,
            tuple(p for p, _ in hints),
            tuple(k for _, k in hints),
            r.ends,
        )

    def answer(self, message: Message) -> Tokens:
        return self.template.assistant_output(message)

    def tokens(self) -> int:
        """Length of the current prompt (with the opener)."""
        return len(self.prompt().ids)

    def copy(self) -> Conversation:
        return Conversation(self.template, self.tools, list(self.messages), self.breakpoint)
