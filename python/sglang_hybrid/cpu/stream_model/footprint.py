"""Which cells of a storage an access touches (``storage.Cells``): the bytes of a strided view,
or of the rows an index op selects along one dimension (its index values read by the model, as
an oracle: not a host read of the program)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .storage import Cells

MAX_RUNS = 1 << 20


def cells_of(
    t: torch.Tensor, cells: Cells, dim: int | None = None, coords: np.ndarray | None = None
) -> np.ndarray | slice:
    """The cells ``t`` covers; with ``dim``/``coords``, only positions ``coords`` along ``dim``."""
    es = t.element_size()
    off = t.storage_offset() * es
    if t.numel() == 0 or (coords is not None and coords.size == 0):
        return np.empty(0, dtype=np.int64)
    dims: list[tuple[np.ndarray | None, int, int]] = []  # (coords, size, stride in bytes)
    for d, (sz, st) in enumerate(zip(t.shape, t.stride())):
        if d == dim:
            dims.append((coords, 0, st * es))
        elif sz != 1:
            dims.append((None, sz, st * es))
    run = es  # the contiguous innermost run, in bytes
    k = len(dims)
    while k > 0 and dims[k - 1][0] is None and dims[k - 1][2] == run:
        run *= dims[k - 1][1]
        k -= 1
    count = 1
    for c, sz, _ in dims[:k]:
        count *= c.size if c is not None else sz
    if count > MAX_RUNS or any(st < 0 for _, _, st in dims):
        return _span(t, cells)
    starts = np.array([off], dtype=np.int64)
    for c, sz, st in dims[:k]:
        pos = c.astype(np.int64) if c is not None else np.arange(sz, dtype=np.int64)
        starts = (starts[:, None] + pos[None, :] * st).reshape(-1)
    size = cells.size
    lo = starts // size
    hi = (starts + run - 1) // size
    if starts.size == 1:
        return slice(int(lo[0]), int(hi[0]) + 1)
    if bool((hi == lo).all()):
        return lo
    lengths = hi - lo + 1
    total = int(lengths.sum())
    firsts = np.repeat(lo - (np.cumsum(lengths) - lengths), lengths)
    return firsts + np.arange(total, dtype=np.int64)


def _span(t: torch.Tensor, cells: Cells) -> slice:
    es = t.element_size()
    lo = t.storage_offset() * es
    hi = lo + es * (1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()) if sz > 0))
    return slice(lo // cells.size, (hi - 1) // cells.size + 1)


def _values(index: Any) -> np.ndarray | None:
    if not isinstance(index, torch.Tensor):
        return None
    if index.dtype == torch.bool:
        return np.flatnonzero(index.detach().reshape(-1).numpy())
    if index.is_floating_point():
        return None
    return index.detach().reshape(-1).numpy().astype(np.int64)


# aten op name -> (dimension argument position or None for an indices list, index position)
INDEXED = {
    "aten::index_select": (1, 2),
    "aten::index_copy_": (1, 2),
    "aten::index_copy": (1, 2),
    "aten::index_fill_": (1, 2),
    "aten::index_fill": (1, 2),
    "aten::index_add_": (1, 2),
    "aten::index_add": (1, 2),
    "aten::index_put_": (None, 1),
    "aten::index_put": (None, 1),
    "aten::_index_put_impl_": (None, 1),
    "aten::index": (None, 1),
}


def indexed(name: str, args: tuple[Any, ...]) -> tuple[int, np.ndarray] | None:
    """For an index op on ``args[0]``: (its indexed dimension, the positions selected)."""
    spec = INDEXED.get(name)
    if spec is None or len(args) <= spec[1]:
        return None
    dpos, ipos = spec
    if dpos is not None:
        dim = int(args[dpos])
        ndim = args[0].dim() if isinstance(args[0], torch.Tensor) else 0
        values = _values(args[ipos])
        return None if values is None else (dim % max(ndim, 1), values)
    entries = list(args[ipos])
    given = [(d, e) for d, e in enumerate(entries) if e is not None]
    if len(given) != 1:
        return None
    d, e = given[0]
    values = _values(e)
    if values is None or (isinstance(e, torch.Tensor) and e.dtype == torch.bool and e.dim() > 1):
        return None
    return d, values
