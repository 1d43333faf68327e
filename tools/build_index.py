"""Compile the index (``python/sglang_hybrid/index``) with mypyc (``make venv`` attempts it).

The modules are compiled as they are (``sglang_hybrid.index.native`` lists the ones left out) into
one extension group, built under ``build/index-native/`` and installed into the package's
``_compiled/`` folder with the fingerprint of the sources it was built from; the package imports
them only while that fingerprint holds (``native.py``). ~1 minute on 2 cores.

    python tools/build_index.py            # build (skipped when current; --force rebuilds)
    python tools/build_index.py --clean    # remove the build: the index runs from its sources

Needs mypy (pinned in requirements/cpu-lock.txt, which ships mypyc) and a C compiler. Exit status
0 when built, current or cleaned; 1 when the build or its import check failed (``make`` carries
on: the index then runs from its sources, the same decisions, slower). The log of a failed build
is ``build/index-native/build.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIR = ROOT / "python"
SOURCE_DIR = PYTHON_DIR / "sglang_hybrid" / "index"
BUILD = ROOT / "build" / "index-native"
GROUP = "sglang_hybrid.index.compiled"  # the shared library: sglang_hybrid/index/compiled__mypyc


def _native() -> ModuleType:
    """The package's loader (``native.py``), imported by path: no package init, no build used."""
    spec = importlib.util.spec_from_file_location("_index_native", SOURCE_DIR / "native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# Run in a child interpreter from python/ (mypyc names modules by their path from there).
_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
group, build, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
config = build + "/mypy.ini"
setup(
    name="sglang-hybrid-index-native",
    ext_modules=mypycify(
        ["--config-file", config, *paths], group_name=group, opt_level="3", target_dir=build + "/c"
    ),
    script_args=["build_ext", "--build-lib", build + "/lib", "--build-temp", build + "/tmp"],
)
"""


def build(force: bool) -> int:
    native = _native()
    target = SOURCE_DIR / native.COMPILED_DIR
    want = native.fingerprint(SOURCE_DIR)
    if not force and native.stamped(SOURCE_DIR) == want:
        print(f"compiled index is current ({target.relative_to(ROOT)})")
        return 0
    sources = [str(p.relative_to(PYTHON_DIR)) for p in native.compiled_modules(SOURCE_DIR)]
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    # mypyc's own mypy configuration: the project's (pyproject.toml, found upwards) names paths
    # from the repository root. ``make lint`` type-checks the same sources strictly.
    (BUILD / "mypy.ini").write_text("[mypy]\nignore_missing_imports = True\n")
    log = BUILD / "build.log"
    print(f"compiling {len(sources)} index modules with mypyc (~1 min; {log.relative_to(ROOT)})")
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.call(
            [sys.executable, "-c", _SETUP, GROUP, str(BUILD), *sources],
            cwd=PYTHON_DIR,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        print("mypyc build failed; the index runs from its sources:\n  " + "\n  ".join(tail))
        return 1
    built = BUILD / "lib" / "sglang_hybrid" / "index"
    # Install: replace the folder whole, the stamp written last (a half-copied build has none).
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for so in sorted(built.glob("*.so")):
        shutil.copy2(so, target / so.name)
    (target / native.STAMP).write_text(want + "\n")
    # The check: a fresh interpreter must import the package from the build.
    check = (
        "import sglang_hybrid.index as i, sglang_hybrid.index.tree as t; "
        "assert i.NATIVE.compiled, i.NATIVE; assert t.__file__.endswith('.so'), t.__file__"
    )
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), env.get("PYTHONPATH", "")])
    if subprocess.call([sys.executable, "-c", check], env=env) != 0:
        shutil.rmtree(target, ignore_errors=True)
        print("the compiled index did not import; removed, the index runs from its sources")
        return 1
    n = len(list(target.glob("*.so")))
    print(f"compiled index built in {time.monotonic() - t0:.0f} s: {n} libraries in {target}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when current")
    parser.add_argument("--clean", action="store_true", help="remove the compiled index")
    args = parser.parse_args()
    if args.clean:
        shutil.rmtree(SOURCE_DIR / _native().COMPILED_DIR, ignore_errors=True)
        shutil.rmtree(BUILD, ignore_errors=True)
        print("compiled index removed; the index runs from its sources")
        return 0
    return build(args.force)


if __name__ == "__main__":
    sys.exit(main())
