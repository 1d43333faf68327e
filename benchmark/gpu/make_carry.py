"""Build ``.gpu-carry/``: what the GPU check needs on a device without SGLang (``make gpu-carry``).

    .venv/bin/python benchmark/gpu/make_carry.py [--out .gpu-carry] [--limit-mib 60]

The device (an H200: torch 2.11 + cu130, Triton 3.6, transformers 5.17, Python 3.12, no network)
has no SGLang. The check imports SGLang's pools, allocators, Scheduler, server arguments and
Triton GDN kernels, and this package (which travels with the working tree). Built here:

- ``site.zip``: a ``site-packages`` tree of SGLang 0.5.23's sources from this venv, minus what
  the check never imports and what cannot run there (``TRIM``: the diffusion package, test kits,
  benchmarks, and every compiled ``.so`` (built for this Python: the Rust tree core; SGLang falls
  back to its Python tree core); the JIT
  kernels' C++ sources stay, SGLang checks that they exist at import), plus the pure-Python
  packages SGLang imports that the device image lacks (``PURE``), each with its ``.dist-info``
  (SGLang reads some versions through ``importlib.metadata``);
- ``wheels/``: cp312 manylinux wheels of the compiled packages it imports that the device lacks
  (``WHEELS``), at this venv's versions, fetched once with ``pip download`` (the only step that
  needs the network; kept between builds);
- ``kernel-ext/``: ``sgl_kernel_ext``'s CUDA library when it was built here (``make
  kernel-ext``; the GPU check's stage K looks for it under the carry);
- ``MANIFEST.json``: versions, the import names each package provides (the device simulation
  of ``gpu_env`` reads them), what was trimmed, what is stubbed there, and sizes.

The bundle must stay under ``--limit-mib`` (default 60 MiB: the device takes 64 MiB per call,
working tree included); the build fails if it does not. ``sgl_kernel``, FlashInfer, flash-attn
and model weights do not travel: ``gpu_env.STUBS`` are stubbed there instead.

Which packages are needed was found by importing, with CUDA faked present and the device's
package set simulated, everything the check imports (``check_backend.py --dry-run`` repeats that
probe against the built bundle).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_env  # noqa: E402

# What SGLang imports (with CUDA present) that the device image lacks, by distribution name.
# Found by importing everything the check imports with CUDA faked present and the device's
# package set simulated (gpu_env); ``check_backend.py --dry-run`` repeats that probe.
PURE = (
    "sglang",
    "pydantic",
    "annotated-types",
    "typing-inspection",
    "fastapi",
    "starlette",
    "uvicorn",
    "sniffio",
    "distro",
    "openai",
    "dill",
    "loguru",
    "gguf",
    "compressed-tensors",
    "partial-json-parser",
    "opentelemetry-api",
    "ipython",  # sglang.utils: from IPython.display import HTML, display
    "traitlets",
    # The OpenAI chat server the plugin hooks (serving_chat): schema checks, audio inputs.
    "jsonschema",
    "referencing",
    "jsonschema-specifications",
    "soundfile",  # with its libsndfile (a plain C library, loaded through cffi)
    "pycparser",
)
# Compiled: carried as cp312 manylinux wheels of the same version (their files are not copied).
WHEELS = (
    "msgspec",  # the scheduler's io_struct messages
    "pyzmq",  # the scheduler's sockets
    "orjson",
    "pybase64",
    "pydantic-core",
    "setproctitle",
    "apache-tvm-ffi",  # imported at import time by SGLang's JIT-kernel modules under CUDA
    "xgrammar",  # function-call detectors import its StructuralTag at import time
    "rpds-py",  # jsonschema's referencing
    "cffi",  # soundfile
)
# Paths inside the sglang package that are not carried.
TRIM = (
    "sglang/multimodal_gen/*",
    "sglang/test/*",
    "sglang/benchmark/*",
    "sglang/bench_*.py",
    "*.so",
    "*.so.*",
    "*/__pycache__/*",
    "*.pyc",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def installed(dist: str) -> md.Distribution | None:
    try:
        return md.distribution(dist)
    except md.PackageNotFoundError:
        return None


def dist_files(dist: md.Distribution) -> list[Path]:
    base = Path(dist.locate_file(""))
    out = []
    for f in dist.files or []:
        p = Path(f)
        if p.parts and p.parts[0] == "..":
            continue  # scripts and data outside site-packages
        out.append(base / p)
    return out


def top_levels(dist: md.Distribution) -> list[str]:
    tops = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data")):
            continue
        name = parts[0]
        if name.startswith("__"):
            continue
        if name.endswith(".py"):
            name = name[:-3]
        elif "." in name:
            name = name.split(".")[0]
        tops.add(name)
    return sorted(tops)


def trimmed(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pat) for pat in TRIM)


def fetch_wheel(dist: str, version: str, wheels: Path) -> Path:
    """A cp312 manylinux wheel of ``dist==version`` in ``wheels`` (downloaded once)."""
    norm = dist.replace("-", "_").lower()
    for w in wheels.glob("*.whl"):
        if w.name.lower().startswith(f"{norm}-{version}-"):
            return w
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(wheels),
        f"{dist}=={version}",
    ]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    print("  fetching", f"{dist}=={version}", "(cp312 wheel)", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {dist}=={version} failed:\n{proc.stderr[-2000:]}")
    for w in wheels.glob("*.whl"):
        if w.name.lower().startswith(f"{norm}-{version}-"):
            return w
    raise RuntimeError(f"pip download did not produce a wheel of {dist}=={version}")


def build(out: Path, limit_mib: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    wheels = out / "wheels"
    wheels.mkdir(exist_ok=True)
    packages: dict[str, dict] = {}
    skipped = []
    site_zip = out / "site.zip.tmp"
    wanted_wheels: list[str] = []
    n_files = trimmed_files = 0
    with zipfile.ZipFile(site_zip, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name in (*PURE, *WHEELS):
            dist = installed(name)
            if dist is None:
                skipped.append(name)
                continue
            version = dist.version
            kind = "wheel" if name in WHEELS else "pure"
            packages[dist.metadata["Name"]] = {
                "version": version,
                "kind": kind,
                "top_level": top_levels(dist),
            }
            if kind == "wheel":
                wanted_wheels.append(fetch_wheel(name, version, wheels).name)
                continue
            base = Path(dist.locate_file(""))
            for path in dist_files(dist):
                rel = path.relative_to(base).as_posix()
                if name == "sglang" and trimmed(rel):
                    trimmed_files += 1
                    continue
                if rel.endswith(".pyc") or "/__pycache__/" in rel or not path.is_file():
                    continue
                if rel.endswith("RECORD") and ".dist-info/" in rel:
                    continue  # lists files that were trimmed
                z.write(path, rel)
                n_files += 1
    site_zip.replace(out / "site.zip")
    for stale in wheels.glob("*.whl"):
        if stale.name not in wanted_wheels:
            stale.unlink()
    # sgl_kernel_ext's CUDA library, when built here (make kernel-ext): stage K finds it here.
    kext = out / "kernel-ext"
    if kext.exists():
        shutil.rmtree(kext)
    libs = sorted((ROOT / "sgl-kernel-ext" / "sgl_kernel_ext").glob("_kernels*.so"))
    for lib in libs:
        kext.mkdir(exist_ok=True)
        shutil.copy2(lib, kext / lib.name)
    sizes = {
        "site_zip": (out / "site.zip").stat().st_size,
        "wheels": sum((wheels / w).stat().st_size for w in wanted_wheels),
        "kernel_ext": sum(lib.stat().st_size for lib in libs),
    }
    sizes["total"] = sizes["site_zip"] + sizes["wheels"] + sizes["kernel_ext"]
    manifest = {
        "sglang": packages.get("sglang", {}).get("version"),
        "built_with_python": sys.version.split()[0],
        "packages": packages,
        "wheels": sorted(wanted_wheels),
        "not_installed_here": skipped,
        "trimmed_from_sglang": list(TRIM),
        "trimmed_files": trimmed_files,
        "site_files": n_files,
        "stubbed_on_device": list(gpu_env.STUBS),
        "kernel_ext": [lib.name for lib in libs],
        "sizes_bytes": sizes,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    mib = sizes["total"] / 2**20
    print(
        f"gpu-carry: {out} = {mib:.1f} MiB (site.zip {sizes['site_zip'] / 2**20:.1f} MiB, "
        f"{n_files} files; {len(wanted_wheels)} cp312 wheels {sizes['wheels'] / 2**20:.1f} MiB; "
        f"{trimmed_files} SGLang files trimmed; sgl_kernel_ext library: "
        f"{', '.join(lib.name for lib in libs) or 'not built'})"
    )
    if mib > limit_mib:
        raise SystemExit(f"gpu-carry is {mib:.1f} MiB, over the {limit_mib} MiB limit")
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=gpu_env.DEFAULT_CARRY)
    ap.add_argument("--limit-mib", type=float, default=60.0)
    ap.add_argument("--clean", action="store_true", help="remove the folder first (wheels too)")
    args = ap.parse_args()
    if args.clean and args.out.exists():
        shutil.rmtree(args.out)
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    build(args.out, args.limit_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
