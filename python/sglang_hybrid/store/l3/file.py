"""A directory as L3, through SGLang's own ``HiCacheFile`` backend (issue #39).

``file://DIR?max_size=SIZE``: SGLang's file backend (``hicache_storage.HiCacheFile``, made by its
``StorageBackendFactory``) stores each object as ``DIR/<key>_<model>_<rank>_<size>.bin``, writes
through a temporary file and ``os.replace`` (a reader never sees half an object) and, with
``max_size`` (e.g. ``64G``), evicts the least recently used files (its ``LRUFileEvictor``). Its
tensor ``get``/``set``/``exists`` fit our whole-object records, so the file store needs no client
of ours; every server of a machine (or of a shared file system) pointed at one directory shares
it. A short file raises inside ``HiCacheFile.get``: read here as a truncated object.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import numpy as np
import torch

from .backend import FAILED, MISSING, L3Backend, L3Unavailable, L3Url


class FileBackend(L3Backend):
    name = "file"

    def __init__(self, url: L3Url, *, tp_rank: int, tp_size: int) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.dir = Path(url.target).expanduser().absolute()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)  # every rank: HiCacheFile makes it on 0
        except OSError as e:
            raise L3Unavailable(f"{self.dir} cannot be created ({e})") from e
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise L3Unavailable(f"{self.dir} is not writable")
        extra: dict[str, object] = {"file_storage_path": str(self.dir)}
        if "max_size" in url.params:
            extra["max_size"] = url.params["max_size"]
        config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=False,
            model_name=None,  # the fingerprint in our keys names the model
            extra_config=extra,
        )
        store = StorageBackendFactory.create_backend("file", config, None)
        # SGLang's failure injector (its test variables) wraps the backend: the file is inside.
        self.store = cast(HiCacheFile, getattr(store, "_backend", store))

    def exists(self, keys: list[str]) -> list[bool]:
        if not self.dir.is_dir():
            raise L3Unavailable(f"{self.dir} is gone")
        return [bool(self.store.exists(k)) for k in keys]

    def put(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        return [
            bool(self.store.set(k, torch.from_numpy(b))) for k, b in zip(keys, bufs, strict=True)
        ]

    def get(self, keys: list[str], bufs: list[np.ndarray]) -> list[int]:
        out: list[int] = []
        for k, b in zip(keys, bufs, strict=True):
            if not self.store.exists(k):
                out.append(MISSING)
                continue
            try:
                got = self.store.get(k, torch.from_numpy(b))
            except OSError:  # a short read: the object is truncated
                out.append(self._size(k))
                continue
            out.append(b.nbytes if got is not None else MISSING)
        return out

    def _size(self, key: str) -> int:
        path = self.dir / f"{self.store._get_suffixed_key(key)}.bin"
        try:
            return path.stat().st_size
        except OSError:
            return FAILED

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            (self.dir / f"{self.store._get_suffixed_key(k)}.bin").unlink(missing_ok=True)

    def path_of(self, key: str) -> Path:
        """The file holding ``key`` (tests plant objects there)."""
        return self.dir / f"{self.store._get_suffixed_key(key)}.bin"
