"""Stage A1: the backend's tests of ``test/sglang`` with SGLang's pools on the device.

``test_helpers_path.py`` (SGLang's helpers with real ``Req`` objects and pools, pages 1/16/64),
``test_host_tier.py`` (the host tier in SGLang's real Scheduler), ``test_scenarios.py`` (SGLang's
Scheduler with ``--radix-cache hybrid``: repeats, shared preambles, multi-turn, eviction, cancel,
coalescing) and ``test_overlap.py`` (SGLang's overlap loop: on CUDA the passes run on its forward
stream while the scheduler thread sits in the schedule stream, so the cache's pass-end captures and
copies are checked against real stream ordering) run unchanged through pytest in this process, with
``SGLANG_HYBRID_TEST_DEVICE`` set to the device: ``test/sglang/direct.py`` builds its pools there
and ``test/conftest.py``'s schedulers get ``device=...``. Their checking worker proves at every pass
that the resumed state and every prefix KV slot are what an uncached run would hold, SGLang's strict
busy/idle pool checks run after every step, and the index's invariant checker at every idle point,
so the device discipline of every tensor the backend hands SGLang is exercised. One test of
``test_speculative.py`` adds the draft model's KV pool, copied with the target's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from common import ROOT, Ctx, add_paths, log

# Speculative decoding (issue #14): the draft model's KV pool moved with every tail and restore,
# through SGLang's speculative scheduler path (CPU_MTP's verify runs on the CPU workers' model,
# its pools on the device).
DRAFT_KV = "test_speculative.py::test_the_draft_kv_moves_with_the_targets"
FILES = (
    "test_helpers_path.py",
    "test_host_tier.py",
    "test_scenarios.py",
    "test_overlap.py",
    DRAFT_KV,
)
QUICK = (
    "test_helpers_path.py::test_repeat_multiturn_and_tail_resume[1]",
    "test_helpers_path.py::test_abort_mid_prefill_keeps_the_committed_chunks[64]",
    "test_host_tier.py::test_a_conversation_evicted_from_the_device_resumes_from_host[64]",
    "test_scenarios.py::test_same_prompt_twice[1]",
    "test_scenarios.py::test_cancel_mid_prefill_publishes_what_it_computed[64]",
    "test_overlap.py::test_a_tap_at_the_prompt_end_holds_the_state_it_names[1]",
    DRAFT_KV,
)


class Collector:
    """A pytest plugin recording each test's outcome and duration (``on_test`` after each, so a
    stage stopped at its time limit keeps the tests it finished)."""

    def __init__(self, on_test: Any = None) -> None:
        self.tests: dict[str, dict[str, Any]] = {}
        self.collected = 0
        self.on_test = on_test

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        self.collected = len(items)

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] += report.duration
        if report.failed:
            entry["outcome"] = "failed"
            entry["where"] = report.when
            entry["error"] = str(report.longrepr)[-2500:]
        elif report.skipped:  # at setup, or pytest.skip() inside the test body
            entry["outcome"] = "skipped"
        if report.when == "teardown" and self.on_test is not None:
            self.on_test(self.tests)


def targets(quick: bool) -> list[str]:
    base = ROOT / "test" / "sglang"
    return [str(base / t) for t in (QUICK if quick else FILES)]


def _pytest(ctx: Ctx, extra: list[str]) -> tuple[int, Collector]:
    import pytest

    os.environ["SGLANG_HYBRID_TEST_DEVICE"] = ctx.device

    def partial(tests: dict[str, Any]) -> None:
        ctx.note("tests", tests)
        ctx.flush()

    collector = Collector(partial)
    args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(ROOT),
        "-o",
        "console_output_style=classic",
        *extra,
        *targets(ctx.quick),
    ]
    code = pytest.main(args, plugins=[collector])
    return int(code), collector


def run(ctx: Ctx) -> None:
    add_paths()
    t0 = time.perf_counter()
    code, col = _pytest(ctx, [])
    failed = {k: v for k, v in col.tests.items() if v["outcome"] == "failed"}
    passed = sum(1 for v in col.tests.values() if v["outcome"] == "passed")
    ctx.note("pool_device", ctx.device)
    ctx.note("tests", col.tests)
    ctx.note("pytest_exit_code", code)
    ctx.note("seconds_in_tests", time.perf_counter() - t0)
    ctx.check(
        f"test/sglang ({', '.join(FILES)}) with SGLang's pools on {ctx.device}",
        code == 0 and not failed and passed > 0,
        passed=passed,
        failed=len(failed),
        collected=col.collected,
    )
    for nodeid, v in list(failed.items())[:20]:
        ctx.check(nodeid, False, where=v.get("where"), error=v.get("error", "")[-400:])
    slow = sorted(col.tests.items(), key=lambda kv: -kv[1]["seconds"])[:5]
    for nodeid, v in slow:
        log(f"  {v['seconds']:6.1f} s  {nodeid}")


def dry(ctx: Ctx) -> None:
    """Collect the tests with the device selected (imports every test module and helper)."""
    add_paths()

    ctx.device = "cuda"  # collection builds nothing: select the device the check runs on
    code, col = _pytest(ctx, ["--collect-only"])
    ctx.check(
        "the backend tests collect with SGLANG_HYBRID_TEST_DEVICE=cuda",
        code == 0 and col.collected > 0,
        collected=col.collected,
    )
