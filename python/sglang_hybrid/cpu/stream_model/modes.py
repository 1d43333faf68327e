"""The two torch modes that feed the model: residency at the Python API, accesses at aten.

``FunctionMode`` (``__torch_function__``) sees calls as code wrote them: factories and their
``device=``, ``.to(...)`` / ``.cpu()`` / ``.cuda()`` / ``pin_memory()``, ``tolist()`` /
``numpy()``, ``Tensor.device`` / ``is_cuda``, ``record_stream``. It decides where a new tensor
lives and performs host<->device transfers as real copies (on the CPU ``.to("cpu")`` of a CPU
tensor would alias it), each recorded on the stream that runs it.

``DispatchMode`` (``__torch_dispatch__``) sees every aten op with its schema: which arguments it
writes, which outputs are new storages. An op with a device operand (or inside a device region,
the CPU worker's forward) runs on the current stream; any other op runs on the host. Each access
is checked by ``storage.Storages`` (on the cells it touches, ``footprint.py``); scalar reads
(``item``, ``int()``, ``bool()``, ...), ``nonzero`` and friends are host syncs. Inside a device
region only existing device memory is followed (SGLang's pools, what the cache and SGLang made):
the worker's own temporaries stand for a kernel's registers and scratch.

Where "cuda" is not written (SGLang's CPU pools say ``device="cpu"``), residency comes from how a
call names the CPU (``_device_target``): the backend's own device reads ``cuda:0`` under the
model, so a CPU it names is the host; SGLang (and the CPU worker outside its forward) names its
device by a variable (``self.device``: device memory on a GPU) and the host by the literal
``"cpu"`` (host memory), which the call's source text tells apart; a factory without a device is
host memory; the CPU worker's forward allocates device memory. ``Tensor.device`` reports
``cuda:0`` for device memory to the backend (``BACKEND_MODULES``), so it branches as on a GPU,
and the truth to everyone else (SGLang's CPU paths, the CPU worker).
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .clock import HOST
from .footprint import INDEXED as _INDEXED
from .footprint import cells_of, indexed
from .storage import Record, StreamViolation, site

if TYPE_CHECKING:
    from .model import StreamModel

BACKEND_MODULES = ("sglang_hybrid.sglang.", "sglang_hybrid.store.", "sglang_hybrid.index.")
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")

_DEVICE_GET = torch.Tensor.device.__get__
_IS_CUDA_GET = torch.Tensor.is_cuda.__get__  # type: ignore[attr-defined]  # a getset descriptor
_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.empty_strided,
    torch.linspace,
    torch.randint,
    torch.randn,
    torch.rand,
}
_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like}
_NEW = {
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
}
_FROM_DATA = {torch.tensor, torch.as_tensor}
# aten ops that return a host value the host must wait for (the result's size or value)
_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::repeat_interleave.Tensor",
    "aten::equal",
    "aten::is_nonzero",
}
# aten ops that touch no data (metadata, aliases)
_META_OPS = {
    "aten::is_pinned",
    "aten::lift_fresh",
    "aten::detach",
    "aten::alias",
    "aten::_has_compatible_shallow_copy_type",
    "aten::record_stream",
    "aten::set_",
}


def _caller_frame() -> FrameType | None:
    """The nearest frame outside torch and this package: the code that made the call."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name.startswith("sglang_hybrid.cpu.stream_model")):
            return f
        f = f.f_back
    return None


def _caller() -> str:
    f = _caller_frame()
    return str(f.f_globals.get("__name__", "")) if f is not None else ""


_LITERAL_CPU: dict[tuple[Any, int], bool] = {}  # a cache of source lookups, not state


def _spelled_cpu(frame: FrameType) -> bool:
    """Whether the call being made in ``frame`` spells the CPU as a literal ("cpu", ``.cpu()``):
    SGLang names host memory that way and device memory by a variable (``self.device``), which
    on the CPU also holds "cpu"."""
    key = (frame.f_code, frame.f_lasti)
    hit = _LITERAL_CPU.get(key)
    if hit is not None:
        return hit
    text = ""
    try:
        l0, l1, c0, c1 = list(frame.f_code.co_positions())[frame.f_lasti // 2]
        if l0 is not None and l1 is not None:
            lines = [linecache.getline(frame.f_code.co_filename, i) for i in range(l0, l1 + 1)]
            if lines:
                lines[-1] = lines[-1][:c1] if c1 is not None else lines[-1]
                lines[0] = lines[0][c0:] if c0 is not None else lines[0]
                text = "".join(lines)
    except (IndexError, ValueError):
        text = ""
    hit = "'cpu'" in text or '"cpu"' in text
    _LITERAL_CPU[key] = hit
    return hit


def _device_target(device: Any) -> bool | None:
    """Whether a ``device=`` argument names device memory (None: not given). CUDA does; the
    CPU does not from the backend (whose device reads ``cuda:0`` under the model, so a CPU
    there is the host) nor where spelled as a literal, and does from SGLang's and the CPU
    worker's code naming their device by a variable (see ``_spelled_cpu``)."""
    if device is None or isinstance(device, torch.Tensor):
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return True
    frame = _caller_frame()
    if frame is None:
        return False
    if str(frame.f_globals.get("__name__", "")).startswith(BACKEND_MODULES):
        return False
    return not _spelled_cpu(frame)


@dataclass(frozen=True, slots=True)
class OpInfo:
    meta: bool  # touches no data
    writes: tuple[int, ...]  # positional arguments it writes
    write_kwargs: tuple[str, ...]
    sync: bool
    copy: bool  # aten::copy_ (transfer semantics)
    name: str  # schema name (index ops: ``footprint.INDEXED``)


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _OP_INFO.get(func)
    if info is not None:
        return info
    schema = func._schema
    name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    writes = []
    write_kwargs = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only:
                write_kwargs.append(a.name)
            else:
                writes.append(i)
    returns_alias = bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    meta = schema.name in _META_OPS or (returns_alias and not writes and not write_kwargs)
    info = OpInfo(
        meta=meta,
        writes=tuple(writes),
        write_kwargs=tuple(write_kwargs),
        sync=schema.name in _SYNC_OPS or name in _SYNC_OPS,
        copy=schema.name == "aten::copy_",
        name=schema.name,
    )
    _OP_INFO[func] = info
    return info


def where(t: torch.Tensor, rec: Record, ix: tuple[int, Any] | None = None) -> Any:
    """The cells of ``rec`` that ``t`` touches (None: the storage is tracked whole)."""
    if rec.cells is None:
        return None
    if ix is not None:
        return cells_of(t, rec.cells, ix[0], ix[1])
    return cells_of(t, rec.cells)


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _tensors(x, out)


class DispatchMode(TorchDispatchMode):
    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        m = self.model
        if m.suspended:
            return func(*args, **kwargs)
        info = op_info(func)
        if info.meta:
            return func(*args, **kwargs)
        written: list[torch.Tensor] = []
        for i in info.writes:
            if i < len(args):
                _tensors(args[i], written)
        for k in info.write_kwargs:
            _tensors(kwargs.get(k), written)
        inputs: list[torch.Tensor] = []
        for i, a in enumerate(args):
            if i not in info.writes:
                _tensors(a, inputs)
        for k, v in kwargs.items():
            if k not in info.write_kwargs:
                _tensors(v, inputs)
        st = m.storages
        recs_in = [(t, st.get(t)) for t in inputs]
        recs_w = [(t, st.get(t)) for t in written]
        on_device = m.device_depth > 0 or any(
            r is not None and r.device for _, r in (*recs_in, *recs_w)
        )
        out = func(*args, **kwargs)
        if on_device:
            self._device_op(func, info, args, recs_in, recs_w, out)
        else:
            self._host_op(func, recs_in, recs_w)
        return out

    def _device_op(
        self,
        func: Any,
        info: OpInfo,
        args: tuple[Any, ...],
        recs_in: list[tuple[torch.Tensor, Any]],
        recs_w: list[tuple[torch.Tensor, Any]],
        out: Any,
    ) -> None:
        m = self.model
        st = m.storages
        stream = m.clocks.current()
        tick = m.clocks.enqueue(stream)
        clock, ex = stream.clock, stream.id
        what = f"{func}"
        seen = set()
        ix = None
        if info.name in _INDEXED and args and isinstance(args[0], torch.Tensor):
            with m.suspend():
                ix = indexed(info.name, args)
        self_t = args[0] if args else None
        for t, rec in recs_in:
            if rec is not None:
                st.read(rec, ex, tick, clock, what, where(t, rec, ix if t is self_t else None))
                seen.add(rec.weak.cdata)
            elif m.device_depth == 0 and t.dim() > 0 and not info.copy:
                m.host_operand(f"{func}", t)
        host_copy_src = None
        if info.copy and recs_in:
            host_copy_src = recs_in[0]
        for t, rec in recs_w:
            if rec is None:  # host memory a device op writes (a device-to-host copy)
                rec = st.adopt(t, device=False, alloc=HOST)
            st.write(rec, ex, tick, clock, what, where(t, rec, ix if t is self_t else None))
            seen.add(rec.weak.cdata)
        outs: list[torch.Tensor] = []
        if m.device_depth == 0:  # the worker's own temporaries are not followed (module doc)
            _tensors(out, outs)
        for t in outs:
            key = t.untyped_storage()._cdata
            if key in seen:
                continue
            m.on_device_alloc(ex, what)
            rec = st.adopt(t, device=True, alloc=ex)
            st.write(rec, ex, tick, clock, what)
        if info.copy:
            self._copy_semantics(args, recs_w, host_copy_src, stream)
        if info.sync and m.device_depth == 0:
            m.host_sync(f"{func} of a device tensor", clock)

    def _copy_semantics(
        self,
        args: tuple[Any, ...],
        recs_w: list[tuple[torch.Tensor, Any]],
        src: tuple[torch.Tensor, Any] | None,
        stream: Any,
    ) -> None:
        """``dst.copy_(src, non_blocking)`` across residencies: blocking, or from pageable
        memory, the host waits (a sync); non-blocking between device and pinned memory it
        does not."""
        m = self.model
        if m.device_depth or not recs_w or src is None:
            return
        non_blocking = bool(args[2]) if len(args) > 2 else False
        dst_t, dst = recs_w[0]
        src_t, src_rec = src
        dst_dev = dst is not None and dst.device
        src_dev = src_rec is not None and src_rec.device
        if dst_dev == src_dev:
            return
        host_t = src_t if dst_dev else dst_t
        if dst_dev and host_t.dim() == 0:
            return  # a Python scalar written into device memory: a fill, no copy
        if not non_blocking or not m.pinned(host_t):
            kind = "host-to-device" if dst_dev else "device-to-host"
            how = "blocking" if not non_blocking else "from pageable memory"
            m.host_sync(f"a {how} {kind} copy", stream.clock)

    def _host_op(
        self,
        func: Any,
        recs_in: list[tuple[torch.Tensor, Any]],
        recs_w: list[tuple[torch.Tensor, Any]],
    ) -> None:
        m = self.model
        st = m.storages
        if not any(r is not None for _, r in (*recs_in, *recs_w)):
            return
        tick = m.clocks.host_tick()
        host = m.clocks.host
        for t, rec in recs_in:
            if rec is not None:
                st.read(rec, HOST, tick, host, f"host {func}", where(t, rec))
        for t, rec in recs_w:
            if rec is not None:
                st.write(rec, HOST, tick, host, f"host {func}", where(t, rec))


class FunctionMode(TorchFunctionMode):
    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        m = self.model
        if m.suspended:
            return func(*args, **kwargs)
        if func in (_DEVICE_GET, _IS_CUDA_GET):
            return self._device_property(func, args[0])
        if func in _FACTORIES or func in _FROM_DATA:
            return self._factory(func, args, kwargs, data=func in _FROM_DATA)
        if func in _LIKE or func in _NEW:
            return self._like(func, args, kwargs)
        if func is torch.Tensor.new_tensor:
            return self._like(func, args, kwargs, data=True)
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.cpu:
            return self._transfer(args[0], device=False, non_blocking=False, dtype=None)
        if func is torch.Tensor.cuda:
            nb = bool(kwargs.get("non_blocking", False))
            return self._transfer(args[0], device=True, non_blocking=nb, dtype=None)
        if func is torch.Tensor.pin_memory:
            return self._pin(args[0])
        if func is torch.Tensor.is_pinned:
            return m.pinned(args[0])
        if func is torch.Tensor.tolist:
            self._host_read(args[0], "tolist()")
        elif func is torch.Tensor.numpy:
            rec = m.storages.get(args[0])
            if rec is not None and rec.device and m.device_depth == 0:
                raise StreamViolation(
                    "numpy", f"numpy() of a device tensor (an error on a GPU) at {site()}"
                )
            self._host_read(args[0], "numpy()")
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ residency
    def _device_property(self, func: Any, t: torch.Tensor) -> Any:
        m = self.model
        rec = m.storages.get(t)
        if rec is not None and rec.device and _caller().startswith(BACKEND_MODULES):
            return CUDA if func == _DEVICE_GET else True
        return func(t)

    def _birth(self, device_arg: Any, pin: bool) -> bool:
        """Whether a new tensor is device memory (see the module docstring)."""
        if pin:
            return False
        if self.model.device_depth:
            return True
        return bool(_device_target(device_arg))

    def _factory(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, data: bool
    ) -> Any:
        m = self.model
        device = kwargs.get("device")
        pin = bool(kwargs.get("pin_memory", False))
        on_device = self._birth(device, pin)
        if device is not None:
            kwargs = dict(kwargs, device=CPU)
        if pin:
            kwargs = dict(kwargs, pin_memory=False)
        with m.suspend():
            out = func(*args, **kwargs)
        if data and on_device and m.device_depth == 0:
            # Python data to a device: a blocking host-to-device copy.
            m.host_sync(f"torch.{func.__name__}(<python data>, device=cuda)", None)
        self._born(out, on_device, pin)
        return out

    def _like(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, data: bool = False
    ) -> Any:
        m = self.model
        device = kwargs.get("device")
        pin = bool(kwargs.get("pin_memory", False))
        if device is None:
            rec = m.storages.get(args[0])
            on_device = (rec is not None and rec.device) or m.device_depth > 0
        else:
            on_device = self._birth(device, pin)
            kwargs = dict(kwargs, device=CPU)
        if pin:
            kwargs = dict(kwargs, pin_memory=False)
        with m.suspend():
            out = func(*args, **kwargs)
        if data and on_device and m.device_depth == 0:
            m.host_sync(f"Tensor.{func.__name__}(<python data>) on a device tensor", None)
        self._born(out, on_device, pin)
        return out

    def _born(self, out: Any, on_device: bool, pin: bool) -> None:
        m = self.model
        if not isinstance(out, torch.Tensor):
            return
        if pin:
            m.storages.adopt(out, device=False, alloc=HOST, pinned=True)
        if not on_device:
            return
        stream = m.clocks.current()
        tick = m.clocks.enqueue(stream)
        m.on_device_alloc(stream.id, "an allocation")
        rec = m.storages.adopt(out, device=True, alloc=stream.id)
        m.storages.write(rec, stream.id, tick, stream.clock, "allocation")

    # ------------------------------------------------------------------ transfers
    def _to(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m = self.model
        t = args[0]
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            other = m.storages.get(args[1])
            device: Any = CUDA if other is not None and other.device else CPU
            dtype = args[1].dtype
            nb = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        else:
            parsed = torch._C._nn._parse_to(*args[1:], **kwargs)
            device, dtype, nb = parsed[0], parsed[1], bool(parsed[2])
        rec = m.storages.get(t)
        src_dev = rec is not None and rec.device
        target = _device_target(device) if device is not None else None
        dst_dev = src_dev if m.device_depth or target is None else target
        if dst_dev == src_dev:
            kwargs = dict(kwargs)
            rest = list(args[1:])
            for i, a in enumerate(rest):
                if isinstance(a, str | torch.device):
                    rest[i] = CPU
            if "device" in kwargs:
                kwargs["device"] = CPU
            return torch.Tensor.to(t, *rest, **kwargs)
        return self._transfer(t, device=dst_dev, non_blocking=nb, dtype=dtype)

    def _transfer(
        self, t: torch.Tensor, *, device: bool, non_blocking: bool, dtype: Any
    ) -> torch.Tensor:
        """A copy between host and device memory, run on the current stream."""
        m = self.model
        st = m.storages
        rec = st.get(t)
        src_dev = rec is not None and rec.device
        if src_dev == device or m.device_depth:
            with m.suspend():
                return t.to(dtype=dtype) if dtype is not None else t
        with m.suspend():
            out = t.to(dtype=dtype, copy=True) if dtype is not None else t.clone()
        stream = m.clocks.current()
        tick = m.clocks.enqueue(stream)
        what = "host-to-device copy" if device else "device-to-host copy"
        if rec is not None:
            st.read(rec, stream.id, tick, stream.clock, what, where(t, rec))
        pinned_out = not device and non_blocking  # torch pins an async copy's destination
        alloc = stream.id if device else HOST
        if device:
            m.on_device_alloc(stream.id, what)
        out_rec = st.adopt(out, device=device, alloc=alloc, pinned=pinned_out)
        st.write(out_rec, stream.id, tick, stream.clock, what)
        if not non_blocking or (device and not m.pinned(t)):
            how = "blocking" if not non_blocking else "from pageable memory"
            m.host_sync(f"a {how} {what}", stream.clock)
        return out

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        m = self.model
        self._host_read(t, "pin_memory()")
        with m.suspend():
            out = t.clone()
        m.storages.adopt(out, device=False, alloc=HOST, pinned=True)
        return out

    def _host_read(self, t: torch.Tensor, what: str) -> None:
        """The host reads ``t``'s memory now: a device tensor is first waited for (a sync)."""
        m = self.model
        if m.device_depth:
            return
        rec = m.storages.get(t)
        if rec is None:
            return
        if rec.device:
            stream = m.clocks.current()
            tick = m.clocks.enqueue(stream)
            m.storages.read(rec, stream.id, tick, stream.clock, what, where(t, rec))
            m.host_sync(f"{what} of a device tensor", stream.clock)
            return
        tick = m.clocks.host_tick()
        m.storages.read(rec, HOST, tick, m.clocks.host, f"host {what}", where(t, rec))
