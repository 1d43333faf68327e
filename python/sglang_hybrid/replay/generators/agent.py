"""Agent sessions: tool loops over a re-rendered history, with the events that stress a cache.

Contract: ``AgentGenerator(config, seed, template).session(index, start_s) -> list[TraceRequest]``
emits one session's requests in release order; the same (config, seed, index) always yields the
same requests. A session:

- shares one system + tools preamble with every other session and subagent of the generator
  (its length is not a multiple of 64, so conversations diverge inside a block);
- runs user turns; each turn is a tool loop: the assistant thinks and calls a tool, the tool
  answers, ... then the assistant answers. Inside a turn every prompt echoes the previous answer
  token for token (thinking kept, the template keeps it after the last user message); the next
  user message re-renders the history without the earlier thinking;
- closed loop: a request is released ``delay_s`` after the requests it waits for finished (tool
  latency inside a turn, user think time between turns);
- events, each drawn with its probability: a **retry** (the same prompt sent again, the
  conversation continues from the retry's answer), a **deep edit** (a new turn edits an earlier
  user message and continues from it), **subagents** (a tool call spawns conversations with the
  shared preamble and their own task, released together; the parent waits for all), a
  **fan-out** (workers released together on a new shared document), and **compaction** (when a
  prompt would exceed ``compaction.at_tokens``; see ``compaction``).

Every request carries the template's hints and a ``tag``: session_start, tool_step, turn, edit,
retry, compaction, subagent, fanout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ...index.keys import BLOCK_TOKENS
from ..trace import TraceRequest
from .compaction import CompactionConfig, compact, head_messages
from .content import ContentSource
from .conversation import Conversation
from .template import Message, TemplateTokens, Tokens, ToolCall

Range = tuple[int, int]
FRange = tuple[float, float]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    turns: Range = (2, 4)  # user turns per session
    steps: Range = (1, 5)  # tool calls per turn before the answer
    system_tokens: int = 1200
    tools: int = 8
    tool_def_tokens: Range = (120, 300)
    user_tokens: Range = (30, 300)
    reasoning_tokens: Range = (40, 300)
    call_tokens: Range = (10, 60)
    answer_tokens: Range = (30, 250)
    result_tokens: Range = (80, 2000)
    tool_latency_s: FRange = (0.2, 2.0)
    user_think_s: FRange = (5.0, 30.0)
    retry_delay_s: FRange = (1.0, 5.0)
    retry_prob: float = 0.05  # per request
    edit_prob: float = 0.15  # per later turn
    subagent_prob: float = 0.12  # per tool call
    subagents: Range = (2, 4)
    subagent_steps: Range = (1, 3)
    fanout_prob: float = 0.04  # per tool call
    fanout: Range = (3, 6)
    document_tokens: Range = (2000, 6000)
    compaction: CompactionConfig = field(default_factory=CompactionConfig)


class AgentGenerator:
    """Shared preamble, template and randomness of one generated workload."""

    def __init__(self, config: AgentConfig, seed: int, template: TemplateTokens) -> None:
        self.cfg = config
        self.seed = seed
        self.tmpl = template
        self.content = ContentSource(seed, template.markers)
        self.system = Message("system", self.content.text(config.system_tokens))
        rng = random.Random(seed)
        self.tools = [
            self.content.text(rng.randint(*config.tool_def_tokens)) for _ in range(config.tools)
        ]
        if self.conversation().prompt().hint_positions[0] % BLOCK_TOKENS == 0:
            # Keep the preamble's end inside a block: the case SGLang's own cache misses.
            self.system.content = self.content.text(config.system_tokens + 1)

    # ------------------------------------------------------------------ messages
    def _text(self, rng: random.Random, r: Range) -> Tokens:
        return self.content.text(rng.randint(*r))

    def _call(self, rng: random.Random) -> ToolCall:
        name = self.content.name(rng.randrange(self.cfg.tools))
        return ToolCall(name, self._text(rng, self.cfg.call_tokens))

    def _assistant(self, rng: random.Random, final: bool) -> Message:
        reasoning = self._text(rng, self.cfg.reasoning_tokens)
        if final:
            return Message("assistant", self._text(rng, self.cfg.answer_tokens), reasoning)
        return Message("assistant", self.content.text(0), reasoning, (self._call(rng),))

    def conversation(self) -> Conversation:
        return Conversation(self.tmpl, self.tools, [self.system])

    # ------------------------------------------------------------------ requests
    def session(self, index: int, start_s: float) -> list[TraceRequest]:
        rng = random.Random(f"{self.seed}/session/{index}")
        em = _Emitter(self, rng, f"s{index}", start_s)
        conv = self.conversation()
        for turn in range(rng.randint(*self.cfg.turns)):
            em.turn = turn
            users = [i for i, m in enumerate(conv.messages) if m.role == "user"]
            if turn and users and rng.random() < self.cfg.edit_prob:
                j = rng.choice(users)  # an earlier user message, often deep in the history
                edited = Message("user", self._text(rng, self.cfg.user_tokens))
                conv.messages = [*conv.messages[:j], edited]
                if conv.breakpoint is not None and conv.breakpoint > j:
                    conv.breakpoint = None
                tag = "edit"
            else:
                conv.messages.append(Message("user", self._text(rng, self.cfg.user_tokens)))
                tag = "session_start" if turn == 0 else "turn"
            delay = rng.uniform(*self.cfg.user_think_s) if turn else 0.0
            steps = rng.randint(*self.cfg.steps)
            for step in range(steps + 1):
                final = step == steps
                conv, tag = self._maybe_compact(rng, conv, tag)
                msg = self._assistant(rng, final)
                em.request(conv, msg, tag, delay)
                if rng.random() < self.cfg.retry_prob:
                    msg = self._assistant(rng, final)  # the retry's answer is the one kept
                    em.request(conv, msg, "retry", rng.uniform(*self.cfg.retry_delay_s))
                conv.messages.append(msg)
                if final:
                    break
                result = self._tool_result(rng, em)
                conv.messages.append(Message("tool", result))
                delay = rng.uniform(*self.cfg.tool_latency_s)
                tag = "tool_step"
        return em.out

    def _maybe_compact(
        self, rng: random.Random, conv: Conversation, tag: str
    ) -> tuple[Conversation, str]:
        cc = self.cfg.compaction
        n = conv.tokens()
        if cc.breakpoint and conv.breakpoint is None:
            # The harness pins the head it will keep once the session has grown past it.
            head = head_messages(conv, cc.head_tokens)
            if 0 < head < len(conv.messages) - cc.keep_tail:
                conv.breakpoint = head
        if n <= cc.at_tokens:
            return conv, tag
        done = compact(conv, self._text(rng, cc.summary_tokens), cc)
        return (done, "compaction") if done is not None else (conv, tag)

    def _tool_result(self, rng: random.Random, em: _Emitter) -> Tokens:
        """The tool's answer; a subagent or fan-out call first runs its workers."""
        cfg = self.cfg
        roll = rng.random()
        if roll < cfg.subagent_prob:
            em.join(self._subagents(rng, em))
        elif roll < cfg.subagent_prob + cfg.fanout_prob:
            em.join(self._fanout(rng, em))
        return self._text(rng, cfg.result_tokens)

    def _subagents(self, rng: random.Random, parent: _Emitter) -> list[str]:
        """Conversations with the shared preamble and their own task, released together."""
        delay = rng.uniform(*self.cfg.tool_latency_s)
        finals = []
        for k in range(rng.randint(*self.cfg.subagents)):
            em = parent.child(f"{parent.session}.sub{len(parent.out)}_{k}")
            conv = self.conversation()
            conv.messages.append(Message("user", self._text(rng, self.cfg.user_tokens)))
            steps = rng.randint(*self.cfg.subagent_steps)
            d = delay
            for step in range(steps + 1):
                msg = self._assistant(rng, step == steps)
                em.request(conv, msg, "subagent", d)
                conv.messages.append(msg)
                if step < steps:
                    conv.messages.append(Message("tool", self._text(rng, self.cfg.result_tokens)))
                    d = rng.uniform(*self.cfg.tool_latency_s)
            parent.out.extend(em.out)
            finals.append(em.out[-1].rid)
        return finals

    def _fanout(self, rng: random.Random, parent: _Emitter) -> list[str]:
        """Workers released together on one new document: a shared prefix nobody computed yet."""
        delay = rng.uniform(*self.cfg.tool_latency_s)
        doc = Message("user", self._text(rng, self.cfg.document_tokens))
        finals = []
        for k in range(rng.randint(*self.cfg.fanout)):
            em = parent.child(f"{parent.session}.fan{len(parent.out)}_{k}")
            conv = self.conversation()
            conv.messages += [doc, Message("user", self._text(rng, (20, 120)))]
            em.request(conv, self._assistant(rng, True), "fanout", delay)
            parent.out.extend(em.out)
            finals.append(em.out[-1].rid)
        return finals


@dataclass(slots=True)
class _Emitter:
    """Turns (conversation, answer) pairs of one conversation into dependent requests."""

    gen: AgentGenerator
    rng: random.Random
    session: str
    start_s: float | None
    after: tuple[str, ...] = ()
    turn: int = 0
    out: list[TraceRequest] = field(default_factory=list)
    _n: int = 0

    def child(self, session: str) -> _Emitter:
        return _Emitter(self.gen, self.rng, session, None, self.after, self.turn)

    def join(self, rids: list[str]) -> None:
        self.after = tuple(rids)

    def request(self, conv: Conversation, msg: Message, tag: str, delay_s: float) -> None:
        p = conv.prompt()
        answer = conv.answer(msg)
        first = not self.after
        req = TraceRequest(
            rid=f"{self.session}.r{self._n}",
            input_ids=p.ids,
            output_len=len(answer),
            arrival_s=self.start_s if first else None,
            after=() if first else self.after,
            delay_s=0.0 if first else delay_s,
            output_ids=answer,
            hint_positions=p.hint_positions,
            hint_kinds=p.hint_kinds,
            session=self.session,
            turn=self.turn,
            tag=tag,
        )
        self._n += 1
        self.out.append(req)
        self.after = (req.rid,)
