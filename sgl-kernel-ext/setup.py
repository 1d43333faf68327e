"""Build of ``sgl_kernel_ext``: the Python package always, its CUDA library when a toolkit exists.

The CUDA library (``sgl_kernel_ext/_kernels*.so``) is compiled by torch's extension machinery
(``torch.utils.cpp_extension.BuildExtension``: nvcc for the ``.cu``, ninja when present) but links
only the CUDA runtime, not libtorch: it exports a C ABI that the package loads with ctypes and
registers as torch ops, so one binary serves any torch / Python built on CUDA 13's runtime.

Environment: ``SGL_KERNEL_EXT_BUILD=0`` skips the CUDA library, ``=1`` makes a missing toolkit an
error (default: build when a toolkit is found, else skip with the reason);
``SGL_KERNEL_EXT_ARCHS`` (default "8.0;9.0+PTX": sm_80, sm_90 and sm_90 PTX).
Normally run through ``build.py`` (``make kernel-ext``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def _toolkit_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_sgl_kernel_ext_toolkit", HERE / "sgl_kernel_ext" / "toolkit.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def extensions() -> tuple[list[Extension], dict]:
    mode = os.environ.get("SGL_KERNEL_EXT_BUILD", "auto")
    if mode == "0":
        print("sgl_kernel_ext: SGL_KERNEL_EXT_BUILD=0, CUDA library not built")
        return [], {}
    tk_mod = _toolkit_module()
    tk = tk_mod.find_toolkit(HERE / "build")
    if isinstance(tk, str):
        msg = f"sgl_kernel_ext: CUDA library skipped: {tk}; the torch reference path is used"
        if mode == "1":
            raise SystemExit(msg)
        print(msg)
        return [], {}
    os.environ["CUDA_HOME"] = tk.cuda_home  # read by torch.utils.cpp_extension at import
    from torch.utils.cpp_extension import BuildExtension

    jobs = str(max(1, min(len(tk_mod.archs()), os.cpu_count() or 1)))
    nvcc = ["-O3", "-std=c++17", "--threads", jobs, *tk_mod.gencode_flags()]
    ext = Extension(
        "sgl_kernel_ext._kernels",
        sources=["csrc/kernels.cu"],
        include_dirs=[tk.include],
        library_dirs=[tk.link_dir],
        libraries=["cudart", "stdc++"],  # gcc links the .so: add the C++ runtime
        runtime_library_dirs=tk.rpath,
        extra_compile_args={"cxx": ["-O2"], "nvcc": nvcc},
        py_limited_api=True,
    )
    print(
        f"sgl_kernel_ext: building with nvcc {tk.version} from {tk.cuda_home} for "
        f"{';'.join(tk_mod.archs())}" + "".join(f"; {n}" for n in tk.notes)
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


if __name__ == "__main__":  # also how setuptools' build backend runs this file
    ext_modules, cmdclass = extensions()
    setup(
        name="sgl-kernel-ext",
        version="0.1.0",
        description="CUDA copy kernels for sglang-hybrid: state/conv taps, KV blocks <-> staging",
        packages=["sgl_kernel_ext"],
        python_requires=">=3.10",
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )
