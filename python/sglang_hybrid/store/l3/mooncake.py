"""Mooncake Store as L3, through Mooncake's own client (issue #39).

Why not SGLang's ``MooncakeStore`` (``sglang/srt/mem_cache/storage/mooncake_store``): it is
HiCache's page store. Its batch paths key and lay out objects as HiCache host-pool pages (a K and
a V object per page and TP rank, ``{hash}_{rank}_k``, described by a ``HostKVCache``'s page
metadata), its single-object ``set``/``get`` take raw pointers into HiCache's registered host
pool, and ``exists`` and ``batch_exists`` disagree on how keys are tagged. Our objects are one
checksummed record per 64-token block bundle (every full-attention layer's K and V) or per state
image in our slab layout (``store/l3/objects.py``), with no ``HostKVCache`` to describe them. So
this backend calls ``MooncakeDistributedStore`` directly: ``setup`` with its master and metadata
service, ``register_buffer`` for the two staging buffers, then ``batch_is_exist``,
``batch_put_from`` and ``batch_get_into`` (zero copy from and into those buffers). Same
deployment as SGLang's: one ``mooncake_master`` (with its HTTP metadata server), and memory in
the store from ``mooncake_client`` processes or from the servers' own segments (``segment=``).

Failure codes of the client (Mooncake 0.3.13): RPC_FAIL (-900) when the master does not answer,
OBJECT_NOT_FOUND (-704), NO_AVAILABLE_HANDLE (-200, the segments are full). ``setup`` retries for
about 90 s when the master is down, so the master's port is tried first and a refusal fails fast.
"""

from __future__ import annotations

import logging
import socket

import numpy as np

from .backend import FAILED, MISSING, L3Backend, L3Unavailable, L3Url

logger = logging.getLogger(__name__)

RPC_FAIL = -900
NOT_FOUND = -704
MiB = 1 << 20
LOCAL_BUFFER_MIB = 16  # the client's own transfer buffer: zero-copy transfers do not use it
CONNECT_TIMEOUT_S = 3.0


def local_address(master: str) -> str:
    """The address of this machine that reaches ``master`` (no packet is sent)."""
    host, _, port = master.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class MooncakeBackend(L3Backend):
    name = "mooncake"

    def __init__(self, url: L3Url) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # an install without the wheel, or without libibverbs.so.1
            raise L3Unavailable(
                f"the Mooncake client does not import ({e}); install "
                f"mooncake-transfer-engine-non-cuda (and Debian's libibverbs1)"
            ) from e
        master = url.target
        host, _, port = master.rpartition(":")
        try:  # setup() itself retries ~90 s against a master that is down
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise L3Unavailable(f"the Mooncake master {master} does not answer ({e})") from e
        p = url.params
        metadata = p.get("metadata") or f"http://{host}:8080/metadata"
        segment = int(p.get("segment", "0")) * MiB
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            p.get("host") or local_address(master),
            metadata,
            segment,
            int(p.get("buffer", str(LOCAL_BUFFER_MIB))) * MiB,
            p.get("protocol", "tcp"),
            p.get("device", ""),
            master,
        )
        if rc != 0:
            raise L3Unavailable(f"Mooncake setup against {master} ({metadata}) failed: {rc}")
        self._registered: list[np.ndarray] = []

    def register(self, buf: np.ndarray) -> None:
        rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise L3Unavailable(f"Mooncake register_buffer failed: {rc}")
        self._registered.append(buf)  # kept alive while registered

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        codes = self.store.batch_is_exist(keys)
        if any(c == RPC_FAIL for c in codes):
            raise L3Unavailable("the Mooncake master does not answer (is_exist)")
        return [c == 1 for c in codes]

    def put(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        if not keys:
            return []
        codes = self.store.batch_put_from(
            keys, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs]
        )
        if codes and all(c == RPC_FAIL for c in codes):
            raise L3Unavailable("the Mooncake master does not answer (put)")
        return [c == 0 for c in codes]

    def get(self, keys: list[str], bufs: list[np.ndarray]) -> list[int]:
        if not keys:
            return []
        codes = self.store.batch_get_into(
            keys, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs]
        )
        if codes and all(c == RPC_FAIL for c in codes):
            raise L3Unavailable("the Mooncake master does not answer (get)")
        return [int(c) if c >= 0 else (MISSING if c == NOT_FOUND else FAILED) for c in codes]

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k)

    def close(self) -> None:
        for buf in self._registered:
            self.store.unregister_buffer(buf.ctypes.data)
        self._registered.clear()
        self.store.close()
