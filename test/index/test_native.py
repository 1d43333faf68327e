"""The compiled index (``native.py``, ``tools/build_index.py``): used exactly while it matches the
sources, and deciding exactly as they do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_hybrid.index as index_pkg
from sglang_hybrid.index import native

HERE = Path(__file__).resolve().parent
SOURCE_DIR = Path(native.__file__).resolve().parent
BUILT = (SOURCE_DIR / native.COMPILED_DIR / native.STAMP).is_file()


def _fake_package(tmp_path: Path) -> Path:
    """The index's sources and a 'build' stamped with their fingerprint (no libraries needed)."""
    pkg = tmp_path / "index"
    pkg.mkdir()
    for p in SOURCE_DIR.glob("*.py"):
        shutil.copy2(p, pkg / p.name)
    (pkg / native.COMPILED_DIR).mkdir()
    (pkg / native.COMPILED_DIR / native.STAMP).write_text(native.fingerprint(pkg) + "\n")
    return pkg


def test_a_current_build_goes_first_and_a_stale_one_is_never_used(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    pkg = _fake_package(tmp_path)
    path, st = native.search_path([str(pkg)])
    assert st.compiled and path == [str(pkg / native.COMPILED_DIR), str(pkg)]

    monkeypatch.setenv(native.PURE_ENV, "1")  # forced to the sources
    path, st = native.search_path([str(pkg)])
    assert not st.compiled and path == [str(pkg)] and native.PURE_ENV in st.reason
    monkeypatch.setenv(native.PURE_ENV, "0")
    assert native.search_path([str(pkg)])[1].compiled

    tree = pkg / "tree.py"  # an edit after the build: the sources win until a rebuild
    tree.write_text(tree.read_text() + "\n# edited\n")
    path, st = native.search_path([str(pkg)])
    assert not st.compiled and path == [str(pkg)] and "changed" in st.reason

    (pkg / "__init__.py").write_text("# not compiled: edits here keep the build\n")
    tree.write_text(tree.read_text().removesuffix("\n# edited\n"))
    assert native.search_path([str(pkg)])[1].compiled

    shutil.rmtree(pkg / native.COMPILED_DIR)
    path, st = native.search_path([str(pkg)])
    assert not st.compiled and "not built" in st.reason


def test_this_process_runs_the_build_when_there_is_a_current_one() -> None:
    st = native.status()
    assert st is index_pkg.NATIVE
    from sglang_hybrid.index import prefix_index, tree

    if not BUILT or os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        assert not st.compiled
        assert tree.__file__.endswith(".py")
        pytest.skip(f"runs from the sources: {st.reason}")
    if not st.compiled:  # built, not forced off: only stale sources may refuse it
        assert "changed" in st.reason, st
        pytest.skip(f"the build is stale: {st.reason}")
    for mod in (tree, prefix_index):  # (mypyc names the file as if under a package tree there)
        assert mod.__file__.startswith(str(SOURCE_DIR / native.COMPILED_DIR)), mod.__file__
        assert mod.__file__.endswith(".so")


_DECISIONS = """
import sys
sys.path.insert(0, {here!r})
from test_random_ops import World
import sglang_hybrid.index as index
w = World(seed={seed})
for _ in range({steps}):
    w.step()
idx = w.idx
t = idx.tree
nodes = sorted(
    (n.depth, n.lookup_hash, n.device_state, n.host_state) for n in t.subtree_postorder(t.root)
)
snaps = sorted((s.frontier, int(s.kind), s.superseded) for s in idx.snapshots.values())
print(index.NATIVE.compiled, repr(idx.stats), hash(tuple(nodes)), hash(tuple(snaps)))
"""


def _decisions(pure: bool, seed: int, steps: int) -> tuple[bool, str]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    env[native.PURE_ENV] = "1" if pure else "0"
    out = subprocess.run(
        [sys.executable, "-c", _DECISIONS.format(here=str(HERE), seed=seed, steps=steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    compiled, rest = out.stdout.strip().split(" ", 1)
    return compiled == "True", rest


@pytest.mark.parametrize("seed", [3, 11])
def test_compiled_and_source_index_make_the_same_decisions(seed: int) -> None:
    """Seeded random operations (lanes, taps, endpoints, pressure, restores, lost copies): the
    counters, the tree and the snapshots come out the same from the build and the sources."""
    if not BUILT or not native.status().compiled:
        pytest.skip(f"no current build: {native.status().reason}")
    compiled, got = _decisions(False, seed, 4000)
    pure, want = _decisions(True, seed, 4000)
    assert compiled and not pure
    assert got == want


def test_the_index_suite_passes_on_the_sources() -> None:
    """The suite the rest of the run exercises compiled (when built) also holds for the sources:
    what a machine without the build (a GPU box, another Python) runs."""
    env = dict(os.environ)
    env[native.PURE_ENV] = "1"
    files = [str(p) for p in sorted(HERE.glob("test_*.py")) if p.name != "test_native.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=HERE.parents[1],
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
