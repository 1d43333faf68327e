"""An L3 store inside this process: ``memory://NAME?capacity_mib=N`` (issue #39).

For the replay (``replay/l3_model.py``), which models a fleet's store for one simulated server,
and for tests: objects are held zlib-compressed (level 1) in a dict under their key, so a replay
whose pools hold a tiny model's bytes (mostly zeros: the replay's worker computes nothing) can keep
millions of objects; reads return the exact bytes written. Capacity counts the *uncompressed*
object bytes, as a real store's memory would: past it the least recently used objects are
evicted (a read or an existing key's put counts as a use), as Mooncake's master evicts when its
segments fill. Every server of one process naming the same ``NAME`` shares one store;
:func:`drop` forgets it. Counters (objects, bytes held, evicted) are on :class:`MemoryStore`.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .backend import FAILED, MISSING, L3Backend, L3ConfigError, L3Url

MiB = 1 << 20


@dataclass(slots=True)
class MemoryCounters:
    puts: int = 0
    put_bytes: int = 0  # uncompressed bytes stored
    gets: int = 0
    get_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0


class MemoryStore:
    """One named store: key -> (compressed bytes, size), in LRU order (oldest first)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.objects: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self.nbytes = 0  # uncompressed bytes held
        self.c = MemoryCounters()
        self.lock = threading.Lock()

    def _evict(self) -> None:
        while self.nbytes > self.capacity and self.objects:
            _, (_, size) = self.objects.popitem(last=False)
            self.nbytes -= size
            self.c.evicted += 1
            self.c.evicted_bytes += size


# Named stores of this process (the registry ``memory://NAME`` resolves against).
_STORES: dict[str, MemoryStore] = {}
_STORES_LOCK = threading.Lock()


def store_named(name: str, capacity_bytes: int) -> MemoryStore:
    """The store ``name``, created with ``capacity_bytes`` on first use."""
    with _STORES_LOCK:
        s = _STORES.get(name)
        if s is None:
            s = _STORES[name] = MemoryStore(capacity_bytes)
        return s


def drop(name: str) -> None:
    with _STORES_LOCK:
        _STORES.pop(name, None)


class MemoryBackend(L3Backend):
    name = "memory"

    def __init__(self, url: L3Url) -> None:
        raw = url.params.get("capacity_mib", "")
        if not raw.isdigit() or int(raw) < 1:
            raise L3ConfigError(f"memory://{url.target}: capacity_mib= takes MiB, at least 1")
        self.store = store_named(url.target, int(raw) * MiB)

    def exists(self, keys: list[str]) -> list[bool]:
        objs = self.store.objects
        return [k in objs for k in keys]

    def put(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        s = self.store
        packed = [zlib.compress(b.tobytes(), 1) for b in bufs]  # outside the lock
        with s.lock:
            for k, b, z in zip(keys, bufs, packed, strict=True):
                if k in s.objects:  # immutable: a key names its content
                    s.objects.move_to_end(k)
                    continue
                s.objects[k] = (z, int(b.nbytes))
                s.nbytes += int(b.nbytes)
                s.c.puts += 1
                s.c.put_bytes += int(b.nbytes)
            s._evict()
        return [True] * len(keys)

    def get(self, keys: list[str], bufs: list[np.ndarray]) -> list[int]:
        s = self.store
        out: list[int] = []
        for k, b in zip(keys, bufs, strict=True):
            with s.lock:
                obj = s.objects.get(k)
                if obj is not None:
                    s.objects.move_to_end(k)
            if obj is None:
                out.append(MISSING)
                continue
            data = zlib.decompress(obj[0])
            n = len(data)
            if n > b.nbytes:  # as Mooncake: an object larger than the buffer is not read
                out.append(FAILED)
                continue
            b[:n] = np.frombuffer(data, dtype=np.uint8)
            out.append(n)
            s.c.gets += 1
            s.c.get_bytes += n
        return out

    def remove(self, keys: list[str]) -> None:
        s = self.store
        with s.lock:
            for k in keys:
                obj = s.objects.pop(k, None)
                if obj is not None:
                    s.nbytes -= obj[1]
