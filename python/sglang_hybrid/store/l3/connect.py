"""Opening the store a ``--hybrid-l3`` URL names.

Its own module so that ``backend`` (the interface every store implements) never imports a store:
the stores import the interface, this module imports the stores.
"""

from __future__ import annotations

from .backend import L3Backend, L3Url


def open_backend(url: L3Url, *, tp_rank: int, tp_size: int) -> L3Backend:
    """Connect (blocking: call it on an L3 thread). Raises :class:`L3Unavailable`."""
    if url.scheme == "mooncake":
        from .mooncake import MooncakeBackend

        return MooncakeBackend(url)
    if url.scheme == "memory":
        from .memory import MemoryBackend

        return MemoryBackend(url)
    from .file import FileBackend

    return FileBackend(url, tp_rank=tp_rank, tp_size=tp_size)
