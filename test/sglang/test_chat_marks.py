"""``cache_control`` breakpoints (issue #16): which messages a chat body marks, and that a marked
message's end becomes an explicit hint (``chat_hints.message_boundaries``)."""

from __future__ import annotations

from sglang_hybrid.index import HintKind
from sglang_hybrid.sglang.chat_hints import message_boundaries
from sglang_hybrid.sglang.chat_server import cache_control_marks

EPHEMERAL = {"type": "ephemeral"}


def test_marks_on_messages_and_on_content_parts() -> None:
    messages = [
        {"role": "system", "content": "s", "cache_control": EPHEMERAL},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "user", "content": [{"type": "text", "text": "b", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": "c", "cache_control": "not an object"},
        "not a message",
    ]
    assert cache_control_marks(messages) == [0, 2]
    assert cache_control_marks(None) == [] and cache_control_marks({"messages": 1}) == []


def test_a_marked_message_end_is_explicit() -> None:
    # A fake template: every message is 10 tokens, the opener 3 more.
    def render(msgs, gen):
        out = [t for i, _ in enumerate(msgs) for t in range(10 * i, 10 * i + 10)]
        return out + [999, 998, 997] if gen else out

    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "user"}]
    plain = message_boundaries(render, msgs)
    assert [(h.position, h.kind) for h in plain] == [
        (10, HintKind.STRUCTURAL),
        (20, HintKind.MESSAGE),
        (30, HintKind.MESSAGE),
        (40, HintKind.OPENER),
    ]
    marked = message_boundaries(render, msgs, explicit=frozenset({1}))
    assert [h.kind for h in marked] == [
        HintKind.STRUCTURAL,
        HintKind.EXPLICIT,
        HintKind.MESSAGE,
        HintKind.OPENER,
    ]
