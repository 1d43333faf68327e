"""The build did one of two things, and the package says which: it produced a CUDA library that
loads and registers the torch operators (they cannot run without a GPU here), or it skipped it
with a reason and every op falls back to the torch reference."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import sgl_kernel_ext as kx
import torch
from sgl_kernel_ext import _lib, _registry, toolkit

KEXT = Path(kx.__file__).resolve().parents[1]


def _status():
    st = kx.extension_status()
    if st["build"] is None and not st["available"]:
        pytest.skip("no build recorded here: run `make kernel-ext` (make venv does)")
    return st


def test_built_and_loadable_or_skipped_with_the_reason():
    st = _status()
    build = st["build"] or {}
    if st["available"]:
        assert Path(st["library"]).exists()
        assert st["torch_ops_registered"], st["registration_error"]
        assert all(kx.registered_ops().values()), kx.registered_ops()
        for name in _registry.SCHEMAS:
            assert callable(getattr(torch.ops.sgl_kernel_ext, name))
        lib = _lib.STATE.lib
        assert lib.sgl_kext_abi_version() == _lib.ABI_VERSION
        assert lib.sgl_kext_max_layers() >= 48 and lib.sgl_kext_max_buffers() >= 32
        # Deliberately free of libtorch: one binary for any torch built on the same CUDA major.
        data = Path(st["library"]).read_bytes()
        assert b"libcudart.so" in data and b"libtorch" not in data and b"libc10" not in data
        if build:
            assert build["built"] and build["archs"], build
    else:
        assert st["reason"], "a missing library must say why"
        assert build.get("built") is False, build
        reason = build["reason"]
        assert reason.startswith(("skipped: ", "compile failed", "built but did not load"))
        if reason.startswith("skipped: ") and "SGL_KERNEL_EXT_BUILD=0" not in reason:
            # skipped for want of a toolkit: the search still finds none
            found = toolkit.find_toolkit(KEXT / "build")
            assert isinstance(found, str) and found in reason
        assert not kx.registered_ops()["kv_blocks_to_staging"]


def test_without_a_toolkit_the_build_is_skipped_with_a_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(toolkit, "torch_cuda", lambda: (None, "2.14.1+cpu"))
    assert "is a CPU build" in toolkit.find_toolkit(tmp_path)
    monkeypatch.setattr(toolkit, "torch_cuda", lambda: ("13.0", "2.14.1+cu130"))
    monkeypatch.setattr(toolkit, "_home_candidates", lambda: [tmp_path / "nowhere"])
    msg = toolkit.find_toolkit(tmp_path)
    assert isinstance(msg, str) and msg.startswith("no CUDA 13.x toolkit found")
    # setup.py then builds the pure-Python package and says why.
    spec = importlib.util.spec_from_file_location("_kext_setup", KEXT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "_toolkit_module", lambda: toolkit)
    assert mod.extensions() == ([], {})
    assert "CUDA library skipped: no CUDA 13.x toolkit found" in capsys.readouterr().out


def test_a_toolkit_without_libcudart_so_links_the_torch_wheels_runtime(monkeypatch, tmp_path):
    """The recipe for a toolkit lacking the unversioned libcudart.so: a symlink in the build
    folder to the runtime the torch wheels ship (nvidia/cu13/lib/libcudart.so.13)."""
    real = toolkit.find_toolkit(tmp_path / "real")
    if isinstance(real, str):
        pytest.skip(f"no toolkit here: {real}")
    if not real.rpath:
        pytest.skip("no pip-packaged libcudart.so.<major> to link against")
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    os.symlink(real.nvcc, home / "bin" / "nvcc")
    os.symlink(real.include, home / "include")
    monkeypatch.setenv("CUDA_HOME", str(home))
    tk = toolkit.find_toolkit(tmp_path / "build")
    assert not isinstance(tk, str), tk
    assert tk.cuda_home == str(home) and tk.notes
    link = Path(tk.link_dir) / "libcudart.so"
    assert link.is_symlink() and os.path.realpath(link).endswith(".so." + tk.version.split(".")[0])


def test_arch_flags():
    assert toolkit.gencode_flags(["8.0", "9.0+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
