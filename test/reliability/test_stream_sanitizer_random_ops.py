"""The scheduler reliability driver under the CPU stream model (issue #35).

Random operations (submissions, aborts, flushes, KV pressure) through SGLang's overlap loop with a
host tier, every scheduler under a ``StreamModel`` (``cpu/stream_model``): the cache in its CUDA
branches, its host copies on a stream queue (``host_copy="async"``: under the model a stream
queue is deterministic, each operation answering "not done" to its first poll), the WAR barrier
on, and a budget on each per-pass entry point of the cache where a host sync fails. Whatever the
driver checks after each operation (``reliability_driver.py``) is checked too. Short in CI
(about 250 operations per configuration; ``--reliability-ops`` scales it with the suite).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
from reliability_driver import Config, RandomOps

from sglang_hybrid.cpu.stream_model import StreamModel

CONFIGS = [
    Config("model-overlap-host-p64", page=64, host_mib=4, overlap=True),
    Config("model-overlap-p1", overlap=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_stream_sanitizer_random_operations(build, request, config: Config) -> None:
    total = request.config.getoption("--reliability-ops")
    n_ops = max(120, total // 50)
    seed = (
        request.config.getoption("--reliability-seed") * 1_000_003
        + zlib.crc32(config.name.encode()) % 100_000
    )
    kwargs = config.build_kwargs()
    kwargs["opts"] = dict(kwargs["opts"], host_copy="async")
    model = StreamModel()
    h = build(stream_model=model, **kwargs)
    tally = RandomOps(h, dataclasses.replace(config), seed).run(n_ops)
    print(f"\n{config.name} seed {seed}: {tally.total} ops {dict(tally.ops)}")
    assert tally.total >= n_ops and tally.finished > 0
    assert not model.budget_syncs()
    assert h.s.scheduler.forward_stream is not h.s.scheduler.schedule_stream
