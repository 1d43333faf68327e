"""The embedded agent session ``make demo`` and ``replay live --trace demo-session`` send: a
recorded coding-agent conversation as OpenAI chat requests (``live.chat_request``).

One main agent and one subagent share a system prompt and six tool definitions (the preamble).
The main agent reads a file, runs the tests, answers, is asked a follow-up, the user retries
that request, the agent writes a fix, and finally an earlier tool result is edited (the file was
re-read after a change) and the conversation is resent. Assistant turns are recorded with their
reasoning and tool calls; the chat template strips the reasoning of earlier turns when it
re-renders the history, as Qwen3-family templates do. The requests are sent one after another
(closed loop), as an agent harness sends them; the model's own replies are generated and
measured but not echoed back (a recorded session replays its recorded turns).

Text is pseudo-English from a fixed word list and seed, so the session is identical on every
run and for every cache.
"""

from __future__ import annotations

import json
import random
from typing import Any

from .live import LiveRequest, chat_request

WORDS = [
    "cache",
    "state",
    "block",
    "agent",
    "tool",
    "file",
    "test",
    "loop",
    "prefix",
    "token",
    "model",
    "query",
    "result",
    "error",
    "value",
    "page",
    "slot",
    "branch",
    "commit",
    "merge",
    "patch",
    "parse",
    "build",
    "check",
    "return",
    "import",
    "module",
    "class",
    "method",
    "field",
    "record",
    "index",
    "table",
    "queue",
    "batch",
    "layer",
    "kernel",
    "buffer",
    "stream",
    "event",
    "thread",
    "shard",
]


class _Text:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def code(self, lines: int) -> str:
        out = []
        for i in range(lines):
            name, arg = self.rng.choice(WORDS), self.rng.choice(WORDS)
            out.append(f"def {name}_{i}({arg}):\n    return {arg}.{self.rng.choice(WORDS)}()")
        return "\n".join(out)


def _tools(t: _Text) -> list[dict[str, Any]]:
    names = ["read_file", "write_file", "run_tests", "grep", "list_dir", "git_diff"]
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": t.words(30),
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": t.words(8)}},
                    "required": ["path"],
                },
            },
        }
        for name in names
    ]


def _tool_exchange(i: int, name: str, path: str, reasoning: str, result: str) -> list[dict]:
    """An assistant turn calling ``name`` (its reasoning recorded) and the tool's answer."""
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"path": path})},
    }
    return [
        {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
    ]


def agent_session(max_tokens: int = 16, seed: int = 0, model: str = "default") -> list[LiveRequest]:
    """The session's requests in order, each released when the previous one finished."""
    t = _Text(seed)
    tools = _tools(t)
    system = {"role": "system", "content": "You are a coding agent. " + t.words(260)}
    task = {"role": "user", "content": "Fix the failing test. " + t.words(70)}
    file_v1 = t.code(24)
    main: list[dict[str, Any]] = [system, task]
    steps: list[tuple[str, str, list[dict[str, Any]]]] = []

    def step(rid: str, label: str, messages: list[dict[str, Any]]) -> None:
        steps.append((rid, label, [dict(m) for m in messages]))

    step("main-1", "task", main)
    main += _tool_exchange(1, "read_file", "src/cache.py", t.words(60), file_v1)
    step("main-2", "tool result: read_file", main)
    sub = [system, {"role": "user", "content": "Subagent: list the tests. " + t.words(40)}]
    step("sub-1", "subagent, same preamble", sub)
    main += _tool_exchange(2, "run_tests", "tests/", t.words(50), t.words(120))
    step("main-3", "tool result: run_tests", main)
    sub += _tool_exchange(3, "list_dir", "tests/", t.words(30), t.words(90))
    step("sub-2", "subagent tool result", sub)
    main += [
        {"role": "assistant", "content": t.words(40), "reasoning_content": t.words(70)},
        {"role": "user", "content": "Now also handle the empty case. " + t.words(30)},
    ]
    step("main-4", "next user turn (thinking stripped)", main)
    step("main-4-retry", "retry of the same request", main)
    main += _tool_exchange(4, "write_file", "src/cache.py", t.words(60), "written. " + t.words(20))
    step("main-5", "tool result: write_file", main)
    edited = [dict(m) for m in main]
    edited[3] = dict(edited[3], content=t.code(24))  # the file read in main-2 changed
    step("main-edit", "edit deep in history", edited)

    reqs = []
    for i, (rid, label, messages) in enumerate(steps):
        reqs.append(
            chat_request(
                rid,
                messages,
                max_tokens=max_tokens,
                tools=tools,
                after=(steps[i - 1][0],) if i else (),
                tag=label,
                session="sub" if rid.startswith("sub") else "main",
                turn=i,
                model=model,
            )
        )
    return reqs
