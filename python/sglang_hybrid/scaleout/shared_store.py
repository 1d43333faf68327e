"""The L3 store a benchmark's servers share (``sglang-hybrid scaleout --l3``, issue #39).

Contract:
- ``SharedStore(work_dir, size_mib)`` is a real Mooncake Store on loopback
  (``store/l3/local_store.py``: ``mooncake_master`` with its HTTP metadata server and one
  ``mooncake_client`` holding ``size_mib`` of memory). ``url`` is what every server gets as
  ``--hybrid-l3``. ``with`` starts and stops it: the benchmark never leaves a master or a storage
  process behind.
- ``clear()`` empties it; the benchmark calls it before every run, after flushing the servers, so
  no run reuses what an earlier policy's run stored. One store serves all runs rather than one
  per run (or a ``prefix=`` per run): the servers read their URL at start, so either would mean
  restarting every server for every run.
- ``usage()``: the objects it holds, their bytes and the evictions so far (after a run: what the
  fleet wrote).

Mooncake only: a ``file://`` store's LRU cap (SGLang's ``HiCacheFile``) keeps its own account of
the directory in each server, which emptying the directory under it would leave wrong.
"""

from __future__ import annotations

from pathlib import Path

from sglang_hybrid.store.l3.local_store import LocalMooncake, StoreUsage, mooncake_usable

L3_MODES = ("off", "mooncake")


class SharedStore:
    def __init__(self, work_dir: Path, size_mib: int) -> None:
        why = mooncake_usable()
        if why is not None:
            raise SystemExit(f"--l3 mooncake: {why}")
        work_dir.mkdir(parents=True, exist_ok=True)
        self.size_mib = size_mib
        self.mooncake = LocalMooncake(work_dir, segment_mib=size_mib)

    @property
    def url(self) -> str:
        return self.mooncake.url

    def __enter__(self) -> SharedStore:
        self.mooncake.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mooncake.stop()

    def clear(self) -> None:
        self.mooncake.clear()

    def usage(self) -> StoreUsage:
        return self.mooncake.usage()
