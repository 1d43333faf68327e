"""Tap hints from a chat template (spec §7.1, §8.3): where the rendered prompt's messages end.

A template is a black box, so boundaries are found by rendering: the token prefix the prompt
shares with the rendering of ``messages[:k]`` is where message ``k`` ends. Templates rewrite
earlier turns (Qwen3 strips past thinking), so it is the longest common prefix, not the length of
the partial rendering. Kinds follow the spec: the end of the leading system block (which holds
the tools) is structural, the start of the final generation is the opener, every other message
end is a message boundary. Cost: one rendering per message, in the server process, off the
scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..index import HintKind, TapHint

Render = Callable[[Sequence[dict], bool], Sequence[int]]  # (messages, add_generation_prompt)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def message_boundaries(
    render: Render,
    messages: Sequence[dict],
    prompt: Sequence[int] | None = None,
    explicit: frozenset[int] = frozenset(),
) -> list[TapHint]:
    """Hints for ``prompt`` (the rendering of ``messages`` with a generation opener). The ends of
    the messages whose indices are in ``explicit`` are client breakpoints (``cache_control``)."""
    if prompt is None:
        prompt = render(messages, True)
    out: list[TapHint] = []
    for k in range(1, len(messages) + 1):
        end = common_prefix(render(messages[:k], False), prompt)
        if end <= 0:
            continue
        first_system = k == 1 and messages[0].get("role") in ("system", "developer")
        kind = HintKind.STRUCTURAL if first_system else HintKind.MESSAGE
        if k == len(messages):
            kind = HintKind.OPENER  # the assistant opener that follows the last message
        if k - 1 in explicit:
            kind = HintKind.EXPLICIT
        out.append(TapHint(end, kind))
    return out


def hints_envelope(hints: Sequence[TapHint]) -> dict[str, Any]:
    from .hints import make_envelope

    names = {
        HintKind.EXPLICIT: "explicit",
        HintKind.OPENER: "opener",
        HintKind.STRUCTURAL: "structural",
        HintKind.AUTOMATIC: "automatic",
        HintKind.MESSAGE: "message",
    }
    return make_envelope([h.position for h in hints], [names[h.kind] for h in hints])
