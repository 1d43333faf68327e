"""Find a CUDA toolkit that can build the kernels for this torch (used by setup.py and build.py).

Loaded by file path from setup.py, so it imports nothing from the package. The build needs:

- a CUDA build of torch (``torch.version.cuda``), whose runtime the kernels link against;
- ``nvcc`` of the same major version, and its headers (``cuda_runtime.h``, ``cuda_bf16.h``),
  looked for in ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``, next to the ``nvcc`` on the
  PATH (resolving wrapper scripts) and in the pip CUDA wheels (``nvidia/cu13``);
- ``libcudart.so`` to link: the toolkit's, or else the runtime the torch wheels ship
  (``nvidia/cu13/lib/libcudart.so.13``, which has no unversioned name: the build links it
  through a ``libcudart.so`` symlink in its build folder);
- a host C++ compiler.

``find_toolkit()`` returns a ``Toolkit`` or the reason none was found (a sentence for the user).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The GPUs the kernels are compiled for: A100 (sm_80) and H100/H200 (sm_90), plus sm_90 PTX so a
# newer GPU (Blackwell) JIT-compiles them. Override: SGL_KERNEL_EXT_ARCHS="8.0;9.0;10.0".
DEFAULT_ARCHS = "8.0;9.0+PTX"


@dataclass
class Toolkit:
    cuda_home: str
    nvcc: str
    version: str  # "13.0"
    include: str
    link_dir: str  # a folder holding libcudart.so (maybe a symlink made in the build folder)
    rpath: list[str] = field(default_factory=list)  # where libcudart.so.<major> was found
    notes: list[str] = field(default_factory=list)


def torch_cuda() -> tuple[str | None, str]:
    """(torch.version.cuda, torch.__version__); (None, reason) without torch."""
    try:
        import torch
    except Exception as e:  # reported as the reason to skip
        return None, f"torch is not importable ({e!r})"
    return torch.version.cuda, torch.__version__


def _site_nvidia_dirs() -> list[Path]:
    out = []
    for p in sys.path:
        d = Path(p) / "nvidia"
        if d.is_dir():
            out.append(d)
    return out


def _home_candidates() -> list[Path]:
    cands: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]))
    cands.append(Path("/usr/local/cuda"))
    which = shutil.which("nvcc")
    if which:
        real = Path(os.path.realpath(which))
        cands.append(real.parent.parent)
        # A wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``): follow its target.
        try:
            text = real.read_text(errors="ignore")[:4096] if real.stat().st_size < 4096 else ""
        except OSError:
            text = ""
        for m in re.finditer(r"(/\S+?)/bin/nvcc", text):
            cands.append(Path(m.group(1)))
    for d in _site_nvidia_dirs():
        cands += [Path(p) for p in sorted(glob.glob(str(d / "cu*")))]
        cands.append(d / "cuda_nvcc")
    seen, out = set(), []
    for c in cands:
        key = os.path.realpath(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _nvcc_version(nvcc: str) -> str | None:
    try:
        text = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _find_cudart(home: Path, major: str) -> tuple[str | None, list[str]]:
    """(folder with libcudart.so for -L or None, folders with libcudart.so.<major> for rpath)."""
    lib_dirs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
    rpath: list[str] = []
    for d in _site_nvidia_dirs():  # the runtime torch itself loads comes first
        for sub in (f"cu{major}/lib", "cuda_runtime/lib"):
            if (d / sub / f"libcudart.so.{major}").exists():
                rpath.append(str(d / sub))
    link = None
    for d in lib_dirs:
        if (d / "libcudart.so").exists():
            link = str(d)
            break
    for d in lib_dirs:
        if (d / f"libcudart.so.{major}").exists() and str(d) not in rpath:
            rpath.append(str(d))
    return link, rpath


def find_toolkit(build_dir: str | os.PathLike[str] | None = None) -> Toolkit | str:
    """The toolkit to build with, or why there is none. ``build_dir``: where a ``libcudart.so``
    symlink may be made when only the torch wheels' ``libcudart.so.<major>`` exists."""
    cuda, tv = torch_cuda()
    if cuda is None:
        if tv.startswith("torch is not"):
            return tv
        return f"torch {tv} is a CPU build (torch.version.cuda is None): nothing to link against"
    major = cuda.split(".")[0]
    if not (shutil.which("c++") or shutil.which("g++") or os.environ.get("CXX")):
        return "no host C++ compiler (c++/g++) on the PATH"
    tried = []
    for home in _home_candidates():
        nvcc = home / "bin" / "nvcc"
        inc = home / "include"
        if not nvcc.exists():
            continue
        if not ((inc / "cuda_runtime.h").exists() and (inc / "cuda_bf16.h").exists()):
            tried.append(f"{home} (nvcc without headers)")
            continue
        version = _nvcc_version(str(nvcc))
        if version is None:
            tried.append(f"{home} (nvcc --version failed)")
            continue
        if version.split(".")[0] != major:
            tried.append(f"{home} (nvcc {version}, torch needs CUDA {major}.x)")
            continue
        link, rpath = _find_cudart(home, major)
        notes = []
        if link is None:
            if not rpath:
                tried.append(f"{home} (no libcudart.so{'.' + major})")
                continue
            target = Path(rpath[0]) / f"libcudart.so.{major}"
            bd = Path(build_dir or Path(__file__).resolve().parents[1] / "build") / "cudart"
            bd.mkdir(parents=True, exist_ok=True)
            link_name = bd / "libcudart.so"
            if link_name.is_symlink() or link_name.exists():
                link_name.unlink()
            link_name.symlink_to(target)
            link = str(bd)
            notes.append(f"linked against {target} through {link_name}")
        return Toolkit(str(home), str(nvcc), version, str(inc), link, rpath, notes)
    where = (
        "; ".join(tried) if tried else "no nvcc in $CUDA_HOME, /usr/local/cuda, PATH, pip wheels"
    )
    return f"no CUDA {major}.x toolkit found ({where})"


def archs() -> list[str]:
    return [a for a in os.environ.get("SGL_KERNEL_EXT_ARCHS", DEFAULT_ARCHS).split(";") if a]


def gencode_flags(arch_list: list[str] | None = None) -> list[str]:
    """nvcc -gencode flags for ``arch_list`` ("8.0", "9.0+PTX", ...)."""
    flags = []
    for a in arch_list if arch_list is not None else archs():
        ptx = a.endswith("+PTX")
        num = a.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags
