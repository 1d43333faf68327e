"""Build and install ``sgl_kernel_ext`` (``make kernel-ext``; also attempted by ``make venv``).

1. Finds a CUDA toolkit matching torch's CUDA major version (``sgl_kernel_ext/toolkit.py``). None:
   the CUDA library is skipped with the reason, and every op uses its torch reference.
2. Compiles ``csrc/kernels.cu`` in place (``setup.py build_ext --inplace``: torch's
   ``BuildExtension``, nvcc for sm_80 and sm_90 + sm_90 PTX), log in ``build/build.log``.
3. Loads the result in a fresh interpreter: the library and the torch operators must register.
4. Installs the package in editable mode into this Python (``pip --no-build-isolation
   --no-deps -e``), unless it already is.

``SGL_KERNEL_EXT_BUILD=0`` skips the CUDA library. What happened is recorded in
``sgl_kernel_ext/_build_status.json`` (read by the tests and ``extension_status()``). Exit
status 0 when built or skipped, 1 when a compile or load failed (``make`` carries on either way).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PKG = HERE / "sgl_kernel_ext"
STATUS = PKG / "_build_status.json"
BUILD = HERE / "build"


def _toolkit_module() -> Any:
    spec = importlib.util.spec_from_file_location("_sgl_kext_toolkit", PKG / "toolkit.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _installed() -> bool:
    """sgl-kernel-ext installed editable from this folder."""
    from importlib import metadata

    try:
        dist = metadata.distribution("sgl-kernel-ext")
    except metadata.PackageNotFoundError:
        return False
    url = dist.read_text("direct_url.json") or ""
    return HERE.as_uri() in url


def _install(py: str) -> str | None:
    if _installed():
        return None
    env = {**os.environ, "SGL_KERNEL_EXT_BUILD": "0"}  # the library is already in place
    cmd = [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(HERE)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return (r.stdout + r.stderr)[-2000:]
    return None


def _probe(py: str) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import sgl_kernel_ext as k; "
        "print(json.dumps({**k.extension_status(), 'ops': k.registered_ops()}))"
    )
    r = subprocess.run([py, "-c", code, str(HERE)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"available": False, "reason": f"import failed: {r.stderr[-1500:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-install", action="store_true", help="build in place only")
    args = ap.parse_args()
    py = sys.executable
    t0 = time.perf_counter()
    for old in PKG.glob("_kernels*.so"):  # a failed build must not leave a stale library
        old.unlink()
    tk_mod = _toolkit_module()
    if os.environ.get("SGL_KERNEL_EXT_BUILD") == "0":
        tk = "SGL_KERNEL_EXT_BUILD=0 asked for no CUDA library"
    else:
        tk = tk_mod.find_toolkit(BUILD)
    import torch

    status: dict[str, Any] = {
        "built": False,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "archs": tk_mod.archs(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    rc = 0
    if isinstance(tk, str):
        status["reason"] = f"skipped: {tk}"
        print(f"sgl_kernel_ext: CUDA library not built: {tk}.")
        print("sgl_kernel_ext: every op will run its torch reference (correct, slower on a GPU).")
    else:
        BUILD.mkdir(exist_ok=True)
        log = BUILD / "build.log"
        status.update(nvcc=tk.version, cuda_home=tk.cuda_home, log=str(log), notes=tk.notes)
        print(
            f"sgl_kernel_ext: compiling with nvcc {tk.version} ({tk.cuda_home}) for "
            f"{';'.join(tk_mod.archs())}; log {log.relative_to(HERE.parent)}"
        )
        env = {**os.environ, "SGL_KERNEL_EXT_BUILD": "1", "CUDA_HOME": tk.cuda_home}
        with log.open("w") as f:
            r = subprocess.run(
                [py, "setup.py", "build_ext", "--inplace"],
                cwd=HERE,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        status["compile_seconds"] = round(time.perf_counter() - t0, 1)
        libs = sorted(PKG.glob("_kernels*.so"))
        if r.returncode != 0 or not libs:
            rc = 1
            status["reason"] = f"compile failed (exit {r.returncode}); see {log}"
            print(f"sgl_kernel_ext: COMPILE FAILED, last lines of {log}:")
            print("".join(log.read_text().splitlines(keepends=True)[-25:]))
        else:
            status["library"] = libs[0].name
            status["library_bytes"] = libs[0].stat().st_size
            STATUS.write_text(json.dumps({**status, "built": True, "reason": "built"}, indent=1))
            probe = _probe(py)
            ops = probe.get("ops", {})
            if probe.get("available") and ops and all(ops.values()):
                status.update(built=True, reason="built", ops=sorted(ops))
            else:
                rc = 1
                status["reason"] = f"built but did not load: {probe.get('reason')}"
                for so in libs:
                    so.unlink()
    if not args.no_install:
        err = _install(py)
        status["installed"] = err is None
        if err:
            print(f"sgl_kernel_ext: pip install -e failed:\n{err}")
            rc = 1
    status["seconds"] = round(time.perf_counter() - t0, 1)
    STATUS.write_text(json.dumps(status, indent=1))
    print(f"sgl_kernel_ext: {status['reason']} ({status['seconds']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
