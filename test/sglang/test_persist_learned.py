"""The host's learned order across a restart (``--hybrid-cache-file``, issue #37): a scheduler
saves its host tier at an orderly stop and a fresh one on the same file takes the reuse ages,
the duel and the ghosts it had learned, not only its snapshots (before, a restarted server
ranked by GDSF until 256 new events). SGLang's real Scheduler, the checking worker."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from sglang_hybrid.store.cache_file import read_cache_file
from sglang_hybrid.store.cache_inspect import inspect


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def _serve(h: Any) -> None:
    """Conversations continued from their endpoints (hits) on a small host tier (evictions)."""
    for conv in range(6):
        prompt = toks(conv, 200)
        for turn in range(3):
            out = h.run(prompt, max_new=8)
            prompt = prompt + list(out.output_ids) + toks(100 * conv + turn, 40)


def test_a_restart_keeps_the_learned_host_order(build, tmp_path: Path, capsys) -> None:
    path = tmp_path / "host.bin"
    opts = {"host_cache_mib": 16, "cache_file": str(path)}
    a = build(total=4096, running=2, mamba=8, chunk=256, opts=opts)
    _serve(a)
    a.cache.host_tier.drain()
    learned = a.cache.index.export_learned()
    assert learned["events"] > 0, learned  # resumes were counted
    assert a.cache.persistence.save(a.cache)
    header = read_cache_file(path).header
    assert json.loads(json.dumps(header["learned"])) == learned
    assert inspect(path) == 0  # ``sglang-hybrid cache inspect`` says what the file holds
    assert f"host order from {learned['events']:,} hits and evictions" in capsys.readouterr().out

    b = build(total=4096, running=2, mamba=8, chunk=256, opts=opts)
    assert b.cache.index.export_learned() == learned  # the same ages, duel and ghosts
    d_a, d_b = a.cache.index.density, b.cache.index.density
    for key, hits, age in ((0, 0, 1), (1, 1, 3), (2, 0, 10)):
        assert d_b.density(key, hits, age) == d_a.density(key, hits, age)
    b.cache.index.check_integrity()


def test_a_learned_order_of_another_version_is_left_out(
    build, tmp_path: Path, monkeypatch, caplog
) -> None:
    """A file whose learned state does not fit (another version's classes) still restores its
    snapshots; the order starts fresh and the log says why."""
    import logging

    from sglang_hybrid.sglang import persistence

    path = tmp_path / "host.bin"
    opts = {"host_cache_mib": 16, "cache_file": str(path)}
    a = build(total=4096, running=2, mamba=8, chunk=256, opts=opts)
    _serve(a)
    a.cache.host_tier.drain()
    real = persistence.write_cache_file

    def other_version(*args: Any, **kw: Any) -> Any:
        kw["learned"] = {**kw["learned"], "shape": [3, 4]}
        return real(*args, **kw)

    monkeypatch.setattr(persistence, "write_cache_file", other_version)
    assert a.cache.persistence.save(a.cache)
    caplog.set_level(logging.WARNING, logger="sglang_hybrid.sglang.persistence")
    b = build(total=4096, running=2, mamba=8, chunk=256, opts=opts)
    assert b.cache.index.snapshots  # the host tier itself was restored
    assert b.cache.index.density.events == 0
    assert any("is not used: classes x bins [3, 4]" in r.getMessage() for r in caplog.records)
    b.cache.index.check_integrity()
