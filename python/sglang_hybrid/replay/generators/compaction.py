"""Context compaction that keeps a head (``../shared/spec/cache-coherence.md``).

A harness compacts when the window fills: it keeps every message before a boundary verbatim
(the head: the system / tools block and the first messages, up to ``head_tokens`` into the
session, at least the first user message), replaces the middle with one summary message and
keeps the last ``keep_tail`` messages. Only the head can be served from a prefix cache: the
summary changes every later position. A cache-aware harness marks the head's end as a client
breakpoint (``breakpoint=True``), as Anthropic ``cache_control`` would, from the first request
whose history reaches past the head (the generator pins it then) through every request after the
compaction, so a cache can hold a state exactly where the compacted prompts diverge.

Contract: ``compact(conversation, summary, config) -> Conversation | None`` returns the
compacted copy (``None`` when there is no middle to replace); the input is not modified. The head
is the conversation's pinned breakpoint when it has one, else ``head_messages``; it always ends
at a message end, so it renders identically in every compacted prompt. It also matches the last
prompt before the compaction unless it holds thinking of the current turn, which the template
strips once the summary (a user message) follows it: the template's rule, kept on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from .conversation import Conversation
from .template import Message, Tokens


@dataclass(frozen=True, slots=True)
class CompactionConfig:
    at_tokens: int = 16000  # compact when the next prompt would be longer than this
    head_tokens: int = 4096  # the head ends at the last message end this far past the preamble
    summary_tokens: tuple[int, int] = (400, 1200)
    keep_tail: int = 2
    breakpoint: bool = True


def head_messages(conv: Conversation, head_tokens: int) -> int:
    """How many leading messages the head keeps (at least the system block and first user).

    The head ends at the last message boundary at most ``head_tokens`` past the preamble; a tool
    response inside a run of tool responses is not a boundary (the run renders as one block).
    """
    msgs = conv.messages
    first_user = next((i for i, m in enumerate(msgs) if m.role == "user"), None)
    if first_user is None:
        return 0
    ends = conv.prompt().message_ends
    preamble = ends[0] if msgs[0].role == "system" else 0
    keep = first_user + 1
    for h in range(first_user + 2, len(msgs) + 1):
        if ends[h - 1] > preamble + head_tokens:
            break
        inside_run = msgs[h - 1].role == "tool" and h < len(msgs) and msgs[h].role == "tool"
        if not inside_run:
            keep = h
    return keep


def compact(conv: Conversation, summary: Tokens, config: CompactionConfig) -> Conversation | None:
    """The compacted conversation, or None when nothing lies between head and tail."""
    # A head the harness already pinned (and marked) is the one it keeps.
    head = conv.breakpoint or head_messages(conv, config.head_tokens)
    tail_start = len(conv.messages) - config.keep_tail
    if head == 0 or tail_start - head < 2:
        return None
    messages = [*conv.messages[:head], Message("user", summary), *conv.messages[tail_start:]]
    return Conversation(conv.template, conv.tools, messages, head if config.breakpoint else None)
