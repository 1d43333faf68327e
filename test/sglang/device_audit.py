"""Catch a host tensor handed to a device-side pool, on a machine whose pools live on the CPU.

On a GPU, SGLang's allocators keep their free lists on the pool's device and concatenate what is
freed into them (``MambaSlotAllocator.free``: ``torch.cat((self.free_slots, free_index))``), and its
pools index their buffers with what they are given: a tensor made on the host there raises a
device mismatch in the scheduler, which dies. On the CPU both are the same device and nothing
fails, so this audit keeps the two apart by where a tensor came from.

While one of the cache's methods runs (``audit_cache_methods``), a ``TorchFunctionMode`` tags as
*host* every tensor the package makes without naming a device or naming the string ``"cpu"``,
made from numpy or bytes, or moved with ``.cpu()`` / ``.to("cpu")``. The package's convention:
the pool's device is the ``torch.device`` the cache normalised from the pool
(``HybridRadixCache.device``), the string ``"cpu"`` names host metadata. Every tensor the audit
did not tag (the pools, the allocators' free lists, requests' slots, what SGLang's own code
makes) is device-side. An operation
that meets a host tensor and a device tensor raises :class:`HostTensorOnDevice`, except where
CUDA allows it too: indexing a device tensor with host indices, ``copy_`` across devices, and
0-dim host tensors used as scalars. Reads that bring device values to the host (``.tolist()``,
``.item()``, ``int()``, ``.cpu()``) are counted per method in ``reads``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
}
# Not dispatched to torch-function modes: wrapped while an audit is active.
ALWAYS_HOST = ("from_numpy", "frombuffer")
READS = {T.tolist, T.item, T.__int__, T.__index__, T.__float__, T.__bool__, T.numpy, T.cpu}
MOVES = {T.to, T.cuda}


class HostTensorOnDevice(AssertionError):
    pass


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


PACKAGE = f"{os.sep}sglang_hybrid{os.sep}"


def _caller_file() -> str:
    """The file of the code that made the torch call being handled."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.endswith("device_audit.py"):
        f = f.f_back
    return f.f_code.co_filename if f is not None else ""


def _names_host(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_device(args: tuple, kwargs: dict) -> Any:
    """The device ``Tensor.to`` was given, or None (a dtype-only conversion)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device  # .to(other): other's side; rare, treated as device-side
    return None


class DeviceAudit(TorchFunctionMode):
    def __init__(self, scope: tuple[str, ...] = (PACKAGE,)) -> None:
        super().__init__()
        self.scope = scope
        # id -> weak reference (tensors compare elementwise, so no WeakSet)
        self.host: dict[int, weakref.ref[torch.Tensor]] = {}
        self.reads: Counter[str] = Counter()  # device->host reads, per method
        self.most_reads: Counter[str] = Counter()  # the most one call of the method made
        self.where = "?"

    def is_host(self, t: torch.Tensor) -> bool:
        r = self.host.get(id(t))
        return r is not None and r() is t

    def _tag(self, out: Any, host: bool) -> None:
        for t in _tensors(out):
            key = id(t)
            if host:
                self.host[key] = weakref.ref(t, functools.partial(self._forget, key))
            else:
                self.host.pop(key, None)

    def __enter__(self) -> DeviceAudit:
        self._saved = {name: getattr(torch, name) for name in ALWAYS_HOST}
        for name, fn in self._saved.items():
            setattr(torch, name, self._host_factory(fn))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(torch, name, fn)

    def _host_factory(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def made_on_host(*a: Any, **kw: Any) -> torch.Tensor:
            out = fn(*a, **kw)
            self._tag(out, True)
            return out

        return made_on_host

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        if self.host.get(key) is ref:  # the id may have been reused and tagged again
            del self.host[key]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            out = func(*args, **kwargs)
            # SGLang's own factories name its device as a string: only audited code is tagged.
            if any(part in _caller_file() for part in self.scope):
                self._tag(out, kwargs.get("device") is None or _names_host(kwargs.get("device")))
            return out
        if func in READS:
            if args and isinstance(args[0], torch.Tensor) and not self.is_host(args[0]):
                self.reads[self.where] += 1
            out = func(*args, **kwargs)
            if func is T.cpu:
                self._tag(out, True)
            return out
        if func in MOVES:
            src = args[0]
            device = _to_device(args, kwargs) if func is T.to else "cuda"
            out = func(*args, **kwargs)
            if device is None:
                self._tag(out, self.is_host(src))
                return out
            to_host = _names_host(device)
            if to_host != self.is_host(src):
                if out is src:  # a no-op on the CPU; across devices it is a new tensor
                    out = src.clone()
                if to_host:
                    self.reads[self.where] += 1
            self._tag(out, to_host)
            return out
        host, dev = [], []
        for t in _tensors((args, kwargs)):
            (host if self.is_host(t) else dev).append(t)
        host_arrays = [t for t in host if t.dim() > 0]
        if host_arrays and dev and not self._allowed(func, args, host_arrays):
            raise HostTensorOnDevice(
                f"in {self.where}: {getattr(func, '__qualname__', func)} mixes a host tensor "
                f"{tuple(host_arrays[0].shape)} {host_arrays[0].dtype} with device-side "
                f"tensors (on a GPU this raises a device mismatch)"
            )
        out = func(*args, **kwargs)
        if host and not dev:
            self._tag(out, True)
        return out

    @staticmethod
    def _allowed(func: Any, args: tuple, host: list[torch.Tensor]) -> bool:
        if func is T.copy_:
            return True
        if func in (T.__getitem__, T.__setitem__) and len(args) >= 2:
            # host tensors only in the index: CUDA gathers/scatters with host indices
            index_ids = {id(t) for t in _tensors(args[1])}
            return all(id(t) in index_ids for t in host)
        return False


AUDITED = (
    "match_prefix",
    "init_load_back",
    "lock",
    "unlock",
    "inc_lock_ref",
    "dec_lock_ref",
    "checkpoint",
    "before_chunked_abort",
    "evict",
    "prefix_device_indices",
    "path_device_indices",
    "prefetch_head",
    "on_release",
    "reset",
    "all_values_flatten",
    "all_mamba_values_flatten",
)


@contextlib.contextmanager
def audit_cache_methods(cls: type) -> Iterator[DeviceAudit]:
    """Run every method of ``cls`` that SGLang calls under one ``DeviceAudit``."""
    audit = DeviceAudit()
    saved = {name: cls.__dict__.get(name) for name in AUDITED}
    depth = [0]

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def audited(*a: Any, **kw: Any) -> Any:
            if depth[0]:
                return fn(*a, **kw)  # nested: already inside the mode
            depth[0] += 1
            audit.where = name
            before = audit.reads[name]
            try:
                with audit:
                    return fn(*a, **kw)
            finally:
                depth[0] -= 1
                made = audit.reads[name] - before
                audit.most_reads[name] = max(audit.most_reads[name], made)

        return audited

    for name in AUDITED:
        fn = getattr(cls, name)
        setattr(cls, name, wrap(name, fn))
    try:
        yield audit
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)
