"""Request programs of the exactness suite (spec §13.3): what each scenario sends, and when.

A program is a generator: it yields a step (a ``Wave`` of requests submitted together and run to
idle, a ``Cancel``, a ``Flush`` or an ``EvictDevice``) and receives every result so far. The same
program runs against every cache configuration; prompts that depend on earlier outputs (the next
turn) therefore depend on outputs the suite has already compared with the uncached run.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from sglang_hybrid.index import HintKind, TapHint, TapPlanner
from sglang_hybrid.replay.chat_session import WORDS
from sglang_hybrid.sglang.chat_hints import hints_envelope, message_boundaries

CHUNK = 128
LADDER, MIN_GAP, TAPS = 512, 256, 6


@dataclass
class Req:
    rid: str
    ids: list[int]
    max_new: int = 8
    hints: list[TapHint] = field(default_factory=list)
    disabled: bool = False
    # Decode all ``max_new`` tokens (``ignore_eos``): a later request's expected reuse is this
    # one's endpoint, and whether §7.7 publishes it depends on how far past the prompt's last
    # state the answer ends. Where a model emits a stop token varies with the device and dtype
    # (the GPU check's bf16 run stopped ho-1 after 43 tokens, the float32 suite never does).
    to_length: bool = False

    def submit_attrs(self) -> dict[str, Any]:
        """What the scheduler's ``submit`` takes for this request beyond ids and max_new (the
        suite's driver and the GPU check's, alike)."""
        attrs: dict[str, Any] = {}
        if self.hints:
            attrs["kv_hints"] = hints_envelope(self.hints)
        if self.disabled:
            attrs["skip_radix_cache_insert"] = True
        if self.to_length:
            attrs["sampling_overrides"] = {"ignore_eos": True}
        return attrs


@dataclass
class Wave:
    reqs: list[Req]


@dataclass
class Cancel:
    req: Req
    after_chunks: int


@dataclass
class EvictDevice:
    """Drop every unpinned device copy the cache holds (KV pages and snapshot slots)."""


Step = Wave | Cancel | EvictDevice
Program = Generator[Step, dict, None]


def floor64(x: int) -> int:
    return x - x % 64


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(20, 1500) for _ in range(n)]


class Chat:
    """Renders conversations with the tiny model's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def render(
        self, messages: list[dict], gen: bool = True, tools: list | None = None
    ) -> list[int]:
        out = self.tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=gen, tokenize=True
        )
        if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def prompt(self, messages: list[dict], tools: list | None = None) -> tuple[list[int], list]:
        ids = self.render(messages, True, tools)
        hints = message_boundaries(lambda m, g: self.render(list(m), g, tools), messages, ids)
        return ids, hints

    def text(self, n_words: int, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS[:17]) for _ in range(n_words))  # the demo's words


# ---------------------------------------------------------------- the programs
def resume_equivalence(chat: Chat, rng: random.Random) -> Program:
    prompt = toks(rng, 600)
    yield Wave([Req("re-warm", prompt, 1)])  # leaves the prompt-tail tap at 599
    yield Wave([Req("re-resume", prompt, 256)])


def multi_turn(chat: Chat, rng: random.Random) -> Program:
    msgs = [
        {"role": "system", "content": chat.text(40, rng)},
        {"role": "user", "content": chat.text(60, rng)},
    ]
    ids, hints = chat.prompt(msgs)
    results = yield Wave([Req("mt-1", ids, 90, hints, to_length=True)])
    # An agent loop echoes the reply token for token and appends the next message.
    out = list(results["mt-1"].output_ids)
    nxt = ids + out + toks(rng, 40)
    yield Wave([Req("mt-2", nxt, 8)])


def rerendered_history(chat: Chat, rng: random.Random) -> Program:
    msgs = [
        {"role": "system", "content": chat.text(30, rng)},
        {"role": "user", "content": chat.text(50, rng)},
    ]
    ids, hints = chat.prompt(msgs)
    yield Wave([Req("rr-1", ids, 8, hints)])
    # The template strips the reply's thinking once the next user turn follows it.
    msgs += [
        {
            "role": "assistant",
            "content": chat.text(30, rng),
            "reasoning_content": chat.text(40, rng),
        },
        {"role": "user", "content": chat.text(20, rng)},
    ]
    ids2, hints2 = chat.prompt(msgs)
    yield Wave([Req("rr-2", ids2, 8, hints2)])


def deep_edit(chat: Chat, rng: random.Random) -> Program:
    msgs = [{"role": "system", "content": chat.text(30, rng)}]
    for _ in range(24):
        msgs += [
            {"role": "user", "content": chat.text(40, rng)},
            {"role": "assistant", "content": chat.text(40, rng)},
        ]
    msgs.append({"role": "user", "content": chat.text(20, rng)})
    ids, hints = chat.prompt(msgs)
    yield Wave([Req("de-1", ids, 8, hints)])
    edited = [dict(m) for m in msgs]
    edited[37]["content"] = chat.text(40, rng)  # an edit deep in history, past a ladder rung
    ids2, hints2 = chat.prompt(edited)
    yield Wave([Req("de-2", ids2, 8, hints2)])


def deep_edit_expectation(
    req1: Req, req2: Req, pieces1: list[tuple[int, int]], captured1: list[int]
) -> int:
    """Where the edited prompt must resume, derived without the cache: the taps the first request
    planned (the planner) as the model worker actually realised them (its record of model calls
    and of the positions it captured inside them). An exact tap lands on its position; a
    flexible one where it was captured, else on the first call boundary at or after it (spec
    §7.1: flexible taps ride on chunk ends). The deepest of those at or below the edit."""
    edit = next(i for i, (a, b) in enumerate(zip(req1.ids, req2.ids)) if a != b)
    taps = TapPlanner(taps_per_request=TAPS, ladder_tokens=LADDER, min_gap_tokens=MIN_GAP).plan(
        len(req1.ids), 0, req1.hints
    )
    ends = sorted(end for _, end in pieces1)
    realised = [
        t.position
        if t.exact or t.position in captured1
        else next(e for e in ends if e >= t.position)
        for t in taps
    ]
    return max([p for p in realised if p <= edit], default=0)


def shared_preamble(chat: Chat, rng: random.Random) -> Program:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "description": chat.text(12, rng),
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for i in range(6)
    ]
    system = {"role": "system", "content": chat.text(60, rng)}
    for i in range(8):
        ids, hints = chat.prompt([system, {"role": "user", "content": chat.text(30, rng)}], tools)
        yield Wave([Req(f"sp-{i}", ids, 4, hints)])


def identical_together(chat: Chat, rng: random.Random) -> Program:
    prompt = toks(rng, 500)
    yield Wave([Req("it-warm", prompt, 2)])  # its prompt-tail tap (499) serves all eight
    yield EvictDevice()  # from here the prefix lives on the host only (when there is one)
    yield Wave([Req(f"it-{i}", prompt + [7, 8, 9], 6) for i in range(8)])


def new_prefix_together(chat: Chat, rng: random.Random) -> Program:
    shared = toks(rng, 700)  # nobody has computed it: the first one's state is waited for
    yield Wave([Req(f"np-{i}", shared + toks(rng, 40), 6) for i in range(6)])


def host_only_restore(chat: Chat, rng: random.Random) -> Program:
    prompt = toks(rng, 400)
    results = yield Wave([Req("ho-1", prompt, 80, to_length=True)])
    yield EvictDevice()
    nxt = prompt + list(results["ho-1"].output_ids) + toks(rng, 20)
    yield Wave([Req("ho-2", nxt, 16)])


def cancel_mid_prefill(chat: Chat, rng: random.Random) -> Program:
    prompt = toks(rng, 900)
    yield Cancel(Req("cm-1", prompt, 4), after_chunks=3)
    yield Wave([Req("cm-2", prompt, 4)])


def disabled_request(chat: Chat, rng: random.Random) -> Program:
    yield Wave([Req("dr-warm", toks(rng, 300), 70)])
    yield Wave([Req("dr-off", toks(rng, 400), 70, disabled=True)])


PROGRAMS = {
    "resume_equivalence": resume_equivalence,
    "multi_turn": multi_turn,
    "rerendered_history": rerendered_history,
    "deep_edit": deep_edit,
    "shared_preamble": shared_preamble,
    "identical_together": identical_together,
    "new_prefix_together": new_prefix_together,
    "host_only_restore": host_only_restore,
    "cancel_mid_prefill": cancel_mid_prefill,
    "disabled_request": disabled_request,
}

__all__ = ["PROGRAMS", "Cancel", "EvictDevice", "HintKind", "Req", "Wave", "hints_envelope"]
