"""The compiled index: the same modules built by mypyc, used only while they match the sources.

``tools/build_index.py`` (run by ``make venv`` / ``make test``) compiles this package's modules
with mypyc into ``_compiled/`` beside them and records there the fingerprint of the sources it
compiled (``SOURCES``). The package's ``__init__`` asks :func:`search_path` which folders to
import its submodules from: ``_compiled/`` first while its fingerprint equals the sources' now,
otherwise the sources alone. So a compiled module never shadows a newer source (an edit without
a rebuild falls back to Python, with the reason in :func:`status`), and a machine without the
build (a GPU box reached by copying the tree; another Python version) runs the same Python.

Why compile: match, commit, release and eviction run per request on the scheduler's thread and
are attribute-heavy Python over per-block nodes; compiled, they run the same decisions with
native attribute access and calls (measured in ``docs/benchmarks.md``, "Cache CPU time per
scheduler pass"). mypyc compiles the modules as they are (type hints checked at run time), so
there is one source of truth; ``SGLANG_HYBRID_PURE_PYTHON=1`` forces the sources.

Pure Python and import-light: it runs before any other module of the package is imported.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

COMPILED_DIR = "_compiled"
STAMP = "SOURCES"
PURE_ENV = "SGLANG_HYBRID_PURE_PYTHON"
# Modules left to the interpreter: this loader and the package's ``__init__`` run before the
# compiled modules can be found; ``invariants`` subclasses AssertionError (mypyc cannot) and is
# a test-time proof, not a hot path.
NOT_COMPILED = frozenset({"__init__", "native", "invariants"})


class NativeStatus(NamedTuple):
    compiled: bool
    reason: str  # why not compiled, or where the compiled modules came from


def compiled_modules(source_dir: Path) -> list[Path]:
    """The sources mypyc compiles, in a fixed order."""
    return sorted(p for p in source_dir.glob("*.py") if p.stem not in NOT_COMPILED)


def fingerprint(source_dir: Path) -> str:
    """Names and contents of the compiled sources, and the interpreter they were built for."""
    h = hashlib.blake2b(digest_size=16)
    h.update(sys.implementation.cache_tag.encode())
    for p in compiled_modules(source_dir):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def stamped(source_dir: Path) -> str | None:
    """The fingerprint the build in ``source_dir`` was made from; None when there is none."""
    try:
        return (source_dir / COMPILED_DIR / STAMP).read_text().strip()
    except OSError:  # not built (or unreadable, which counts the same)
        return None


def _probe(source_dir: Path) -> NativeStatus:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return NativeStatus(False, f"{PURE_ENV} is set")
    built = stamped(source_dir)
    if built is None:
        return NativeStatus(False, "not built (make venv or python tools/build_index.py)")
    if built != fingerprint(source_dir):
        return NativeStatus(
            False, "the sources changed since the build (python tools/build_index.py rebuilds)"
        )
    return NativeStatus(True, str(source_dir / COMPILED_DIR))


def search_path(package_path: list[str]) -> tuple[list[str], NativeStatus]:
    """The package's ``__path__``: the compiled folder first when it is current."""
    source_dir = Path(package_path[0])
    st = _probe(source_dir)
    if not st.compiled:
        return list(package_path), st
    return [str(source_dir / COMPILED_DIR), *package_path], st


def status() -> NativeStatus:
    """Whether this process runs the compiled index, and why not."""
    pkg = sys.modules[__name__.rpartition(".")[0]]
    st: NativeStatus | None = getattr(pkg, "NATIVE", None)
    return st if st is not None else NativeStatus(False, "the package was not initialised")
