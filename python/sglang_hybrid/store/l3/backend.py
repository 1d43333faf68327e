"""L3 stores: whole objects moved between a key and a buffer (issue #39).

``--hybrid-l3 URL`` names one:

- ``mooncake://MASTER_HOST:PORT?metadata=URL&segment=MIB&protocol=tcp&device=NAME&host=ADDR``:
  Mooncake Store through its own client (``mooncake.store.MooncakeDistributedStore``);
  ``mooncake.py`` says why not through SGLang's ``MooncakeStore``;
- ``file://DIR?max_size=SIZE``: a directory, through SGLang's own ``HiCacheFile`` backend (its
  atomic writes and its LRU size cap), for one machine and for tests;
- ``memory://NAME?capacity_mib=N``: a store inside this process (``memory.py``), for the
  replay's modelled L3 and for tests.

Both take ``prefix=TEXT``: an operator's namespace in every key (a fleet, an experiment).

Contract of a backend, for its callers on the L3 threads (``store/l3/jobs.py``): ``exists``,
``put`` and ``get`` move whole objects; buffers are 1-D uint8 numpy views into the buffers the
backend was given (``register``) before any transfer; a store that cannot be reached raises
:class:`L3Unavailable` (the caller turns L3 off and retries later), a key that is absent reads
as :data:`MISSING`, any other failure of one object as :data:`FAILED`. Two threads (one reading,
one writing) may call a backend at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

import numpy as np

MISSING = -1
FAILED = -2
FLAG = "--hybrid-l3"


class L3Unavailable(Exception):
    """The store cannot be reached (master, metadata service or directory)."""


class L3ConfigError(ValueError):
    """A ``--hybrid-l3`` URL this build cannot use; the message says why and what to write."""


class L3Url(NamedTuple):
    scheme: str  # "mooncake", "file" or "memory"
    target: str  # HOST:PORT of the master, the directory, or the in-process store's name
    params: dict[str, str]
    prefix: str

    def describe(self) -> str:
        return f"{self.scheme}://{self.target}"


MOONCAKE_PARAMS = ("metadata", "segment", "protocol", "device", "host", "buffer")
FILE_PARAMS = ("max_size",)
MEMORY_PARAMS = ("capacity_mib",)


def parse_url(url: str) -> L3Url:
    """``--hybrid-l3``'s value, checked; :class:`L3ConfigError` names what is wrong."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    prefix = query.pop("prefix", "")
    if any(c in prefix for c in "/\\ \0"):
        raise L3ConfigError(f"{FLAG} {url}: prefix={prefix!r} may not hold '/', '\\' or spaces")
    if parts.scheme == "mooncake":
        if not parts.hostname or not parts.port:
            raise L3ConfigError(
                f"{FLAG} {url}: name the Mooncake master as mooncake://HOST:PORT (its "
                f"--rpc_port, 50051 by default)"
            )
        _only(url, query, MOONCAKE_PARAMS)
        for k in ("segment", "buffer"):
            if k in query and not query[k].isdigit():
                raise L3ConfigError(f"{FLAG} {url}: {k}= takes MiB, a whole number")
        target = f"{parts.hostname}:{parts.port}"
        return L3Url("mooncake", target, query, prefix)
    if parts.scheme == "file":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise L3ConfigError(f"{FLAG} {url}: name a directory, file:///abs/dir or file://dir")
        _only(url, query, FILE_PARAMS)
        return L3Url("file", path, query, prefix)
    if parts.scheme == "memory":
        _only(url, query, MEMORY_PARAMS)
        if not parts.netloc or not query.get("capacity_mib", "").isdigit():
            raise L3ConfigError(f"{FLAG} {url}: write memory://NAME?capacity_mib=MIB")
        return L3Url("memory", parts.netloc, query, prefix)
    raise L3ConfigError(
        f"{FLAG} {url}: use mooncake://MASTER_HOST:PORT?metadata=URL (a Mooncake Store) or "
        f"file://DIR (a directory on this machine)"
    )


def _only(url: str, query: dict[str, str], known: tuple[str, ...]) -> None:
    unknown = sorted(set(query) - set(known))
    if unknown:
        raise L3ConfigError(
            f"{FLAG} {url}: unknown parameter(s) {', '.join(unknown)}; this scheme takes "
            f"{', '.join((*known, 'prefix'))}"
        )


class L3Backend(ABC):
    """One rank's connection to the store (see the module docstring for the contract)."""

    name = "l3"

    def register(self, buf: np.ndarray) -> None:
        """``buf`` will be read from and written into by transfers (Mooncake registers it)."""
        return None

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        """Store each buffer under its key; an existing key counts as stored (objects are
        immutable: a key names its content)."""

    @abstractmethod
    def get(self, keys: list[str], bufs: list[np.ndarray]) -> list[int]:
        """Read each key into its buffer: bytes read, :data:`MISSING` or :data:`FAILED`."""

    def remove(self, keys: list[str]) -> None:
        """Best effort (tests plant and clear objects)."""
        return None

    def close(self) -> None:
        return None
