"""The benchmark's shared L3 (``scaleout/shared_store.py``): a real Mooncake Store on loopback,
emptied between runs even of objects just read (the master's read lease keeps them 10 s)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sglang_hybrid.scaleout.shared_store import SharedStore
from sglang_hybrid.store.l3.backend import parse_url
from sglang_hybrid.store.l3.local_store import mooncake_usable

pytestmark = pytest.mark.skipif(mooncake_usable() is not None, reason=str(mooncake_usable()))


def test_a_run_starts_from_an_empty_store(tmp_path: Path) -> None:
    from sglang_hybrid.store.l3.mooncake import MooncakeBackend

    with SharedStore(tmp_path, 64) as store:
        b = MooncakeBackend(parse_url(store.url))
        try:
            buf = np.arange(3 << 12, dtype=np.uint32).view(np.uint8)
            b.register(buf)
            keys = ["r1-a", "r1-b", "r1-c"]
            assert b.put(keys, [buf[i << 14 : (i + 1) << 14] for i in range(3)]) == [True] * 3
            out = np.zeros(1 << 14, dtype=np.uint8)
            b.register(out)
            assert b.get(["r1-a"], [out]) == [1 << 14]  # read: leased by the master
            use = store.usage()
            assert use.objects == 3 and use.nbytes >= 3 << 14, use
            store.clear()
            assert store.usage().objects == 0
            assert b.exists(keys) == [False] * 3
        finally:
            b.close()
    assert store.mooncake.master is None and store.mooncake.storage is None  # stopped
