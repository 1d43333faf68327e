"""A seeded random-operation driver for ``--radix-cache hybrid`` inside SGLang's real Scheduler.

Why a seeded driver and not ``hypothesis.stateful``: the system under test is one
``InProcessScheduler`` (SGLang builds its process groups once per process, so one scheduler is
alive at a time and building one costs about a second), and the interesting failures need long
histories: a pool full of evictable cache, a host tier under constant eviction, retractions only
after many decodes have filled the KV pool. A ``RuleBasedStateMachine`` would either rebuild the
scheduler for every example (most of the budget spent building) or share it across examples
(then examples are not independent and shrinking replays are meaningless). Shrinking a history
of thousands of scheduler passes would also take far longer than reading the trace the driver
keeps. The driver is therefore a plain loop over ``random.Random(seed)``: a run is reproduced
exactly by its seed and operation count (SGLang's scheduling and the token worker are
deterministic), and a failure names the seed, the index of the failing operation and the last
operations before it. Hypothesis still drives the index's own property tests (``test/index``).

An *operation* is one driver action, each followed by the checks:

- ``submit``: one request, its prompt drawn so that prompts share prefixes: a fresh prompt, a
  fork of an earlier prompt, the next turn of a finished conversation (prompt + its output + new
  tokens), an exact repeat, an edit deep in history (one token changed in the first half), a
  suffix-only change; sometimes with tap hints (an opener or structural boundary, so exact taps
  with tails happen);
- ``group``: 2-5 requests with a new shared prefix submitted together (coalescing holds them);
- ``step``: one scheduler pass (``get_next_batch_to_run`` -> run -> process result);
- ``abort``: a request chosen by where it is: waiting, held by coalescing, mid-prefill (the
  chunked request), mid-decode, or any live one;
- ``flush``: drain, then ``scheduler.flush_cache()`` on the idle scheduler;
- ``drain``: passes until idle (each pass counts as an operation), then the idle checks.

After every pass: the index's ``check_integrity()``, the KV pool identity (allocator available +
cache evictable + cache protected + the KV rows live requests own == pool size), the MambaPool
identity (available + snapshot slots + slots live requests hold == pool size), and SGLang's own
strict busy check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1``, run inside ``step``). The
worker is ``CheckingWorker``: every pass proves the resumed state and every prefix KV slot equal
what an uncached run holds. At every idle point: SGLang's idle leak check and tree sanity check
(``on_idle``), and no lanes, 0 protected tokens, no restore pins, every snapshot slot accounted
for, every submitted request finished (full length, the token worker's tokens) or aborted.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from sglang_hybrid.cpu.token_worker import deterministic_token
from sglang_hybrid.sglang.hints import make_envelope

VOCAB_LO, VOCAB_HI = 20, 900  # prompt tokens (a narrow range: forks meet again by chance)


@dataclass(frozen=True)
class Config:
    """One scheduler configuration the random operations run against."""

    name: str
    page: int = 1
    host_mib: int = 0  # 0: host tier off
    total: int = 3072  # KV pool tokens
    running: int = 4
    mamba: int = 20
    chunk: int = 128
    slots: int | None = None  # device snapshot slots (None: the backend's default)
    taps: int | None = None
    max_prompt: int = 900  # tokens
    long_decode: float = 0.08  # share of requests with a long decode (KV pressure, retraction)
    long_new: tuple[int, int] = (150, 500)  # max_new_tokens of a long decode
    abort_rate: float = 0.06  # share of busy operations that abort a request
    max_live: int = 10  # submitted but unfinished requests, at most
    conservativeness: float = 1.0  # --schedule-conservativeness: low admits optimistically
    ratio_decay_steps: int | None = None  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS (default 600)
    expect_retract: bool = False
    share: float = 1.0  # relative share of the operations
    tap_mode: str = "auto"  # --hybrid-tap-mode (auto: zero-split with the CPU workers)
    overlap: bool = False  # SGLang's overlap loop (the next batch runs before this one's results)
    tail_tap: str = "exact"  # --hybrid-tail-tap (flexible: realised where a pass ends)
    seed: int | None = None  # a pinned seed (a regression found at that seed), else derived
    label: str | None = None  # the test id when it is not the name (request ids use the name)
    ops: int | None = None  # with a pinned seed: the operations that reach the regression

    def build_kwargs(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "host_cache_mib": self.host_mib,
            "tap_mode": self.tap_mode,
            # Host copies in flight for one iteration, run on this thread: every asynchronous
            # state is reached and a seed replays exactly (no copy-thread timing).
            "host_copy": "deferred",
            "tail_tap": self.tail_tap,
        }
        if self.slots is not None:
            opts["device_snapshot_slots"] = self.slots
        if self.taps is not None:
            opts["taps_per_request"] = self.taps
        return dict(
            page=self.page,
            chunk=self.chunk,
            total=self.total,
            running=self.running,
            mamba=self.mamba,
            opts=opts,
            schedule_conservativeness=self.conservativeness,
            disable_overlap_schedule=not self.overlap,
        )


class OpFailed(AssertionError):
    pass


@dataclass
class Live:
    rid: str
    prompt: list[int]
    max_new: int


@dataclass
class Tally:
    ops: Counter = field(default_factory=Counter)
    aborts: Counter = field(default_factory=Counter)
    prompts: Counter = field(default_factory=Counter)
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    idle_checks: int = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class RandomOps:
    """Seeded random operations on one Harness (``test/reliability/conftest.py``)."""

    def __init__(self, harness: Any, config: Config, seed: int, *, label: str = "") -> None:
        self.h = harness
        self.s = harness.s
        self.config = config
        self.seed = seed
        self.label = label or config.name
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.history: list[list[int]] = []  # prompts (and continuations) to draw from
        self.finished: list[tuple[list[int], list[int]]] = []  # (prompt, output) for next turns
        self.live: dict[str, Live] = {}
        self.submitted: dict[str, Live] = {}
        self.aborted_by_us: set[str] = set()
        self.trace: deque[str] = deque(maxlen=25)
        self.index_stats: Counter = Counter()
        self.n_rid = 0
        self.op_index = 0
        sched = self.s.scheduler
        self.vocab = int(sched.model_config.vocab_size)
        self.eos = frozenset(sched.model_config.hf_eos_token_id or ())

    # ================================================================ prompts
    def _tokens(self, n: int) -> list[int]:
        r = self.rng
        return [r.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]

    def _length(self) -> int:
        r, top = self.rng.random(), self.config.max_prompt
        mid = min(400, 2 * top // 3)
        if r < 0.1:
            return self.rng.randrange(1, 64)
        return self.rng.randrange(64, mid) if r < 0.7 else self.rng.randrange(mid, top)

    def _prompt(self) -> tuple[str, list[int]]:
        r = self.rng
        if not self.history or r.random() < 0.12:
            return "fresh", self._tokens(self._length())
        x = r.random()
        if x < 0.3 and self.finished:
            prompt, out = r.choice(self.finished)
            kind, p = "next_turn", prompt + out + self._tokens(r.randrange(1, 120))
        elif x < 0.3:
            kind, p = "fresh", self._tokens(self._length())
        elif x < 0.5:
            old = r.choice(self.history)
            cut = r.randrange(0, len(old) + 1)
            kind, p = "fork", old[:cut] + self._tokens(r.randrange(1, 200))
        elif x < 0.65:
            kind, p = "repeat", list(r.choice(self.history))
        elif x < 0.8:
            old = list(r.choice(self.history))
            if len(old) < 2:
                kind, p = "repeat", old
            else:
                at = r.randrange(0, max(1, len(old) // 2))
                old[at] = VOCAB_HI + (old[at] % 50)  # outside the usual range: a real change
                kind, p = "deep_edit", old
        else:
            old = r.choice(self.history)
            kind, p = (
                "suffix",
                old[: max(0, len(old) - r.randrange(1, 40))] + self._tokens(r.randrange(1, 40)),
            )
        p = p[: self.config.max_prompt]
        if not p:
            p = self._tokens(1)
        return kind, p

    def _max_new(self) -> int:
        r = self.rng
        if r.random() < self.config.long_decode:
            return r.randrange(*self.config.long_new)
        return r.randrange(1, 24)

    def _hints(self, n: int) -> dict[str, Any] | None:
        r = self.rng
        if n < 8 or r.random() > 0.25:
            return None
        k = r.randrange(1, 3)
        positions = sorted({r.randrange(1, n) for _ in range(k)})
        kinds = [r.choice(["opener", "structural", "explicit", "message"]) for _ in positions]
        return make_envelope(positions, kinds)

    def _rid(self) -> str:
        self.n_rid += 1
        return f"{self.label}-{self.seed}-{self.n_rid:07d}"  # fixed width: no rid prefixes another

    def _submit(self, kind: str, prompt: list[int]) -> str:
        rid = self._rid()
        max_new = self._max_new()
        attrs: dict[str, Any] = {}
        hints = self._hints(len(prompt))
        if hints is not None:
            attrs["kv_hints"] = hints
        self.s.submit(rid, prompt, max_new, **attrs)
        req = Live(rid, prompt, max_new)
        self.live[rid] = req
        self.submitted[rid] = req
        self.history.append(prompt)
        if len(self.history) > 60:
            self.history.pop(0)
        self.tally.prompts[kind] += 1
        self.tally.requests += 1
        return rid

    # ================================================================ operations
    def run(self, n_ops: int) -> Tally:
        """``n_ops`` operations (a drain's passes count one each), then a final flush."""
        while self.tally.total < n_ops:
            self._one(self._choose())
        self._one("flush")
        return self.tally

    def _choose(self) -> str:
        r = self.rng.random()
        busy = self.s.has_work()
        room = len(self.live) < self.config.max_live
        if not busy:
            if r < 0.04:
                return "flush"
            return "group" if r < 0.2 and room else "submit" if room else "drain"
        if r < 0.12 and room:
            return "submit"
        if r < 0.15 and room:
            return "group"
        r -= 0.15
        if r < self.config.abort_rate and self.live:
            return "abort"
        r -= self.config.abort_rate
        if r < 0.004:  # a drain runs every pass to idle: hundreds with long decodes
            return "drain"
        if r < 0.006:
            return "flush"
        return "step"

    def _one(self, op: str) -> None:
        try:
            getattr(self, f"_op_{op}")()
        except OpFailed:
            raise
        except BaseException as exc:
            raise OpFailed(self._where(op, exc)) from exc

    def _where(self, op: str, exc: BaseException) -> str:
        trace = "\n  ".join(self.trace)
        return (
            f"{self.label}: seed {self.seed}, operation {self.op_index} ({op}) failed: "
            f"{type(exc).__name__}: {exc}\n last operations:\n  {trace}"
        )

    def _note(self, op: str, detail: str = "") -> None:
        self.tally.ops[op] += 1
        self.op_index += 1
        self.trace.append(f"#{self.op_index} {op} {detail}")

    def _op_submit(self) -> None:
        kind, prompt = self._prompt()
        rid = self._submit(kind, prompt)
        self._note("submit", f"{rid} {kind} len {len(prompt)}")

    def _op_group(self) -> None:
        r = self.rng
        if self.history and r.random() < 0.5:
            base = r.choice(self.history)
            shared = base[: r.randrange(0, len(base) + 1)] + self._tokens(r.randrange(64, 500))
        else:
            shared = self._tokens(r.randrange(64, 700))
        k = min(r.randrange(2, 6), self.config.max_live - len(self.live))
        rids = []
        for _ in range(max(1, k)):
            p = (shared + self._tokens(r.randrange(1, 80)))[: self.config.max_prompt]
            rids.append(self._submit("group", p))
        self._note("group", f"{len(rids)} x shared {len(shared)}: {rids[0]}..")

    def _op_step(self) -> None:
        batch = self.s.step()
        mode = batch.forward_mode.name if batch else "idle"
        self._note("step", mode)
        self._after_pass()
        if not self.s.has_work():
            self._idle()

    def _op_drain(self) -> None:
        passes = 0
        while self.s.has_work():
            self.s.step()
            passes += 1
            self._note("step", "(drain)")
            self._after_pass()
            if passes > 20_000:
                raise AssertionError("the scheduler did not drain in 20,000 passes")
        self._idle()

    def _op_flush(self) -> None:
        self._op_drain()
        self._keep_index_stats()
        assert self.s.scheduler.flush_cache(), "flush_cache refused on an idle scheduler"
        self._note("flush")
        self._idle()

    def _op_abort(self) -> None:
        sched = self.s.scheduler
        cache = self.h.cache
        r = self.rng
        where: dict[str, list[str]] = {"waiting": [], "held": [], "prefill": [], "decode": []}
        held = set(cache.coalescer.holds) if getattr(cache, "coalescer", None) else set()
        for req in sched.waiting_queue:
            where["held" if req.rid in held else "waiting"].append(req.rid)
        if sched.chunked_req is not None:
            where["prefill"].append(sched.chunked_req.rid)
        for req in sched.running_batch.reqs:
            if req.rid not in where["prefill"]:
                where["decode"].append(req.rid)
        options = [k for k, v in where.items() if v]
        if options:
            kind = r.choice(options)
            rid = r.choice(where[kind])
        else:
            kind, rid = "live", r.choice(sorted(self.live))
        self.s.abort(rid)
        self.aborted_by_us.add(rid)
        self.tally.aborts[kind] += 1
        self._note("abort", f"{rid} ({kind})")
        self._reap()

    def _keep_index_stats(self) -> None:
        """A flush replaces the index and its counters: keep what they counted so far."""
        index = getattr(self.h.cache, "index", None)
        if index is not None:
            for f in index.stats.__dataclass_fields__:
                self.index_stats[f] += getattr(index.stats, f)

    def cache_stats(self) -> dict[str, int]:
        """The cache's counters over the whole run (the index's summed across flushes)."""
        out = dict(self.h.cache.stats())
        for k, v in self.index_stats.items():
            out[k] = out.get(k, 0) + v
        return out

    # ================================================================ checks
    def _after_pass(self) -> None:
        self.h.check_pass()
        self._reap()

    def _reap(self) -> None:
        results = self.s.results()
        for rid in list(self.live):
            res = results.get(rid)
            if res is None or not res.finished:
                continue
            req = self.live.pop(rid)
            self.tally.prompt_tokens += len(req.prompt)
            self.tally.cached_tokens += res.cached_tokens
            if res.finish_type == "abort":
                # Only the aborts this driver sent: anything else is the scheduler or the cache
                # giving up on a request it should have served.
                assert rid in self.aborted_by_us, (
                    f"{rid} was aborted by the server, not by the driver: {res.finish_reason}"
                )
                self.tally.aborted += 1
                continue
            self._check_output(req, res)
            self.tally.finished += 1
            self.finished.append((req.prompt, list(res.output_ids)))
            if len(self.finished) > 30:
                self.finished.pop(0)

    def _check_output(self, req: Live, res: Any) -> None:
        """A finished request decoded to its length, the token worker's tokens for its rid
        (retracted and resumed requests included)."""
        n = len(req.prompt)
        want = [
            deterministic_token(req.rid, n + i, self.vocab, self.eos) for i in range(req.max_new)
        ]
        assert list(res.output_ids) == want, (
            f"{req.rid}: output {list(res.output_ids)[:8]}.. ({len(res.output_ids)}) != "
            f"{want[:8]}.. ({len(want)}); finish {res.finish_reason}"
        )

    def _idle(self) -> None:
        self.s.on_idle()  # SGLang's idle leak check and tree sanity check
        self.h.check_idle()
        self._reap()
        assert not self.live, f"requests never finished: {sorted(self.live)[:5]}"
        self.tally.idle_checks += 1
