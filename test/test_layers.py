"""No import cycles in ``sglang_hybrid``: between modules, and between its subpackages.

Every ``import`` counts wherever it sits (module level or inside a function: a function-level
import only hides a cycle until that function runs); only ``if TYPE_CHECKING:`` blocks are left
out, as they never run. A cycle fails with each edge's file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sglang_hybrid"

Graph = dict[str, dict[str, str]]  # module -> {imported module: "file:line"}


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [root.name, *f.relative_to(root).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement in ``package`` names (modules or their members)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{a.name}" for a in node.names]


def import_graph(root: Path) -> Graph:
    mods = _modules(root)

    def owner(name: str) -> str | None:
        while name and name not in mods:  # a member: the module that defines it
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {m: {} for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, package):
                target = owner(name)
                if target is not None and target != mod:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    graph[mod].setdefault(target, where)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _explain(graph: Graph, comps: list[list[str]]) -> str:
    lines = []
    for comp in comps:
        lines.append(" <-> ".join(comp))
        lines += [f"    {a} -> {b} ({graph[a][b]})" for a in comp for b in graph[a] if b in comp]
    return "\n".join(lines)


def _unit(module: str) -> str:
    """``sglang_hybrid.<x>``: the subpackage (or top-level module) ``module`` belongs to."""
    return ".".join(module.split(".")[:2])


def _by_subpackage(graph: Graph) -> Graph:
    """The graph between subpackages (and top-level modules), first edge kept for each pair."""
    out: Graph = {}
    for a, targets in graph.items():
        for b, where in targets.items():
            if _unit(a) != _unit(b):
                out.setdefault(_unit(a), {}).setdefault(_unit(b), where)
    return out


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 100 and graph["sglang_hybrid.replay.cli"]  # the walk saw the tree
    comps = cycles(graph)
    assert not comps, "import cycles:\n" + _explain(graph, comps)


def test_no_import_cycle_between_subpackages() -> None:
    graph = _by_subpackage(import_graph(PACKAGE))
    comps = cycles(graph)
    assert not comps, "import cycles between subpackages:\n" + _explain(graph, comps)


def test_a_function_level_import_cycle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert graph["pkg.sub.b"]["pkg.a"] == "pkg/sub/b.py:2"
    assert graph["pkg.c"] == {}  # TYPE_CHECKING imports never run
    assert cycles(_by_subpackage(graph)) == [["pkg.a", "pkg.sub"]]
