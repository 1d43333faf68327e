"""Strided host <-> device copies on the copy engines: ``cudaMemcpy2DAsync`` (spec §11.2).

A run of consecutive blocks is, for one KV plane, ``count`` rows of ``length`` bytes: contiguous on
the device and one slab apart on the host. PyTorch's ``copy_`` stages a non-contiguous pinned view
through pageable memory (measured on an H200: ~1.5 GB/s against ~47 GB/s for a contiguous copy),
so runs go through the CUDA runtime's 2-D copy instead, on the current stream. The runtime is the
one libtorch already loaded. Without it (no CUDA) callers keep torch's own ``copy_``.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_DEFAULT_KIND = 4  # cudaMemcpyDefault: direction from unified addressing (pinned host + device)


class Memcpy2D:
    """The CUDA runtime's ``cudaMemcpy2DAsync``, found in the process; ``lib`` None without."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        if not torch.cuda.is_available():
            return
        for name in self._candidates():
            try:
                lib = ctypes.CDLL(name)
                fn = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            self.lib = lib
            return

    @property
    def available(self) -> bool:
        return self.lib is not None

    @staticmethod
    def _candidates() -> list[str]:
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        roots = [os.path.dirname(torch.__file__)]
        try:
            import nvidia  # the pip-packaged CUDA runtime libtorch links against

            roots += list(nvidia.__path__)
        except ImportError:
            pass
        for root in roots:
            names += glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)
        return names

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for 2-D uint8 views ``[rows, width]`` with unit inner stride,
        issued as one ``cudaMemcpy2DAsync`` on the current stream."""
        assert dst.shape == src.shape and dst.dtype == src.dtype == torch.uint8
        assert dst.stride(1) == 1 and src.stride(1) == 1
        rows, width = dst.shape
        assert self.lib is not None
        stream = torch.cuda.current_stream().cuda_stream
        err = self.lib.cudaMemcpy2DAsync(
            ctypes.c_void_p(dst.data_ptr()),
            dst.stride(0) if rows > 1 else width,
            ctypes.c_void_p(src.data_ptr()),
            src.stride(0) if rows > 1 else width,
            width,
            rows,
            _DEFAULT_KIND,
            ctypes.c_void_p(stream),
        )
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
