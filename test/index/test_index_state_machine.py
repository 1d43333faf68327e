"""The random index operations as a ``hypothesis.stateful`` machine: integrity after every step.

Each rule is one of ``test_random_ops.World``'s operations (start, advance, cancel, device and
host pressure, a lost host copy); hypothesis picks the sequence and each operation's seed, and on
a failure shrinks it to a short sequence of small seeds. The seeded walker stays: its 20,000
steps (400k in ``make stress-index``) reach states these short runs do not, and it asserts that
every eviction path was taken. Runs are derandomized: the same examples each time.
"""

from __future__ import annotations

import random

from helpers import make_index
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_random_ops import World

from sglang_hybrid.index import check_integrity
from sglang_hybrid.index.host_eviction import make_room

SEEDS = st.integers(min_value=0, max_value=2**16)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World(seed=0)
        # A third of the walker's host tier: these short runs fill it and evict from it too.
        self.w.idx = make_index(host_slabs=30, slots=4, image_bytes=700, slab_bytes=100)

    def _with_seed(self, seed: int) -> World:
        self.w.rng = random.Random(seed)  # the operation's own choices (prompts, lanes, cuts)
        return self.w

    def _after(self) -> None:
        self.w.dev.collect(self.w.idx)  # the handles the index released go back to the device

    @precondition(lambda m: len(m.w.lanes) < 3)
    @rule(seed=SEEDS)
    def start(self, seed: int) -> None:
        self._with_seed(seed).start()
        self._after()

    @precondition(lambda m: bool(m.w.lanes))
    @rule(seed=SEEDS, times=st.integers(min_value=1, max_value=4))
    def advance(self, seed: int, times: int) -> None:
        w = self._with_seed(seed)
        for _ in range(times):  # commits outnumber the other operations, as in the walker
            if w.lanes:
                w.advance()
        self._after()

    @precondition(lambda m: bool(m.w.lanes))
    @rule(seed=SEEDS)
    def cancel(self, seed: int) -> None:
        w = self._with_seed(seed)
        w.finish(w.rng.choice(w.lanes), cancelled=True)
        self._after()

    @rule(tokens=st.integers(min_value=1, max_value=600))
    def device_pressure(self, tokens: int) -> None:
        self.w.idx.evict_device(tokens)
        self._after()

    @rule(slabs=st.integers(min_value=1, max_value=40))
    def host_pressure(self, slabs: int) -> None:
        make_room(self.w.idx, slabs)
        self._after()

    @rule(seed=SEEDS)
    def lose_copy(self, seed: int) -> None:
        self._with_seed(seed).lose_copy()
        self._after()

    @invariant()
    def integrity(self) -> None:
        check_integrity(self.w.idx)

    def teardown(self) -> None:
        w, idx = self.w, self.w.idx
        while w.lanes:
            w.finish(w.lanes[0], cancelled=True)
        w.dev.collect(idx)
        check_integrity(idx)
        assert not idx.lanes and idx.protected_tokens == 0
        # Once no lane is left everything on the device is evictable, and evicting it all frees
        # exactly the handles the index was given.
        idx.evict_device(1 << 30)
        w.dev.collect(idx)
        assert idx.device_tokens == 0 and not w.dev.live


IndexMachine.TestCase.settings = settings(
    derandomize=True,
    database=None,
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    # Speed is for benchmarks: on a loaded machine generation is slow, which is not a failure.
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexMachine = IndexMachine.TestCase
