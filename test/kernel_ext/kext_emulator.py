"""A CPU stand-in for the CUDA library's C ABI (tests only).

Each function takes exactly what the ``sgl_kext_*`` entry points take and does, on CPU memory
addressed by raw pointers, what ``csrc/kernels.cu`` does with them: the same address arithmetic
(offset units, strides, per-layer bases, groups of layers) and an alignment assertion wherever the
kernel would issue a vector access. The ops' CUDA-path glue (pointer tables, offsets scaled to the
vector unit, dtype codes) runs against it on a machine without a GPU.
"""

from __future__ import annotations

import ctypes

import torch

DT = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}


def _mem(addr: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of memory at ``addr`` as a uint8 tensor (a view, writes go through)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


def _i64(addr: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(addr)) if n else []


class Emulator:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (entry point, layers or buffers, vector)

    def sgl_kext_error_string(self, code: int) -> bytes:
        return b"emulated error"

    def sgl_kext_kv_copy(
        self,
        to_staging,
        n_buf,
        buf_ptr,
        row_stride,
        row_bytes,
        plane_off,
        slots,
        n_blocks,
        rows,
        staging,
        pitch,
        vec,
        max_ctas,
        stream,
    ) -> int:
        self.calls.append(("kv", n_buf, vec))
        assert vec in (1, 2, 4, 8, 16)
        sl = _i64(slots, n_blocks * rows)
        for b in range(n_blocks):
            for k in range(n_buf):
                rb = row_bytes[k]
                assert rb % vec == 0
                for r in range(rows):
                    dev = buf_ptr[k] + sl[b * rows + r] * row_stride[k]
                    stg = staging + b * pitch + plane_off[k] + r * rb
                    assert dev % vec == 0 and stg % vec == 0, (dev, stg, vec)
                    src, dst = (dev, stg) if to_staging else (stg, dev)
                    _mem(dst, rb).copy_(_mem(src, rb))
        return 0

    def sgl_kext_state_taps(
        self,
        n_layers,
        src,
        dst,
        src_dtype,
        dst_dtype,
        taps,
        n_taps,
        row_elems,
        vec,
        max_ctas,
        stream,
    ) -> int:
        self.calls.append(("state", n_layers, vec))
        t = _i64(taps, 2 * n_taps)
        sdt, ddt = DT[src_dtype], DT[dst_dtype]
        ss, ds = sdt.itemsize, ddt.itemsize
        if src_dtype == dst_dtype:
            unit_s = unit_d = 16 if vec else ss
        else:
            n = 16 // max(ss, ds)
            unit_s, unit_d = (n * ss, n * ds) if vec else (ss, ds)
        for layer in range(n_layers):
            for i in range(n_taps):
                a = src[layer] + t[2 * i] * unit_s
                d = dst[layer] + t[2 * i + 1] * unit_d
                assert a % unit_s == 0 and d % unit_d == 0, (a, d, unit_s, unit_d)
                assert (row_elems * ss) % unit_s == 0
                vals = _mem(a, row_elems * ss).view(sdt)
                _mem(d, row_elems * ds).view(ddt).copy_(vals.to(ddt))
        return 0

    def sgl_kext_conv_taps(
        self,
        n_layers,
        x,
        inc,
        dst,
        taps,
        n_taps,
        dim,
        width,
        strides,
        x_dtype,
        in_dtype,
        dst_dtype,
        max_ctas,
        stream,
    ) -> int:
        self.calls.append(("conv", n_layers, 0))
        t = _i64(taps, 4 * n_taps)
        x_t, x_c, in_c, in_j, d_c, d_j = (strides[i] for i in range(6))
        xd, idt, dd = DT[x_dtype], DT[in_dtype], DT[dst_dtype]

        def elem(base: int, i: int, dt: torch.dtype) -> torch.Tensor:
            return _mem(base + i * dt.itemsize, dt.itemsize).view(dt)

        for layer in range(n_layers):
            for k in range(n_taps):
                pos, x_row0, in_off, d_off = t[4 * k : 4 * k + 4]
                for c in range(dim):
                    for j in range(width):
                        if j < width - pos:
                            v = elem(inc[layer], in_off + c * in_c + (pos + j) * in_j, idt)
                        else:
                            v = elem(x[layer], (x_row0 + j) * x_t + c * x_c, xd)
                        elem(dst[layer], d_off + c * d_c + j * d_j, dd).copy_(v.to(dd))
        return 0
