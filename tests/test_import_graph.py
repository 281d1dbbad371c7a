"""No import loops among treespec modules, and every module imports."""

from __future__ import annotations

import pytest


# The floors of the package, lowest first. A module may import its own package and any package
# on a lower floor, never one on its own floor or above: so the graph has no loops by
# construction, and the floors say what depends on what.
FLOORS = {
    "core": 0, "fastpath": 0, "data": 0,   # pure tensor math; CPU kernels; prompt files
    "planning": 1, "targets": 1,           # the pure cost model; loading target models
    "drafters": 2,
    "builders": 3, "export": 3,
    "runtime": 4,                          # verifiers, the generator, the server
    "calibrate": 5, "train": 5,            # what runs models to measure or to train
    "testing": 5,                          # the drafter conformance kit (runs the generator)
    "cli": 6,
    "": 7, "__main__": 7,                  # treespec/__init__ (the public API) and ``python -m``
}


def _module_graph() -> dict[str, set[str]]:
    """treespec module -> treespec modules it imports anywhere (function bodies included)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[1] / "treespec"
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + ".") :   # a package's own __init__ is its parent
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_module_graph_has_no_cycles():
    assert _cycles(_module_graph()) == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Edges into another package on the same floor or above."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
            if _package(a) != _package(b) and FLOORS[_package(b)] >= FLOORS[_package(a)]]


def test_imports_only_go_down_the_floors():
    graph = _module_graph()
    assert {_package(m) for m in graph} == set(FLOORS), "a new package needs its floor in FLOORS"
    assert _upward(graph) == []


def test_the_checks_see_an_upward_import_and_a_loop():
    graph = _module_graph()
    graph["treespec.core.tree"] = graph["treespec.core.tree"] | {"treespec.runtime.generator"}
    assert _upward(graph) == ["treespec.core.tree -> treespec.runtime.generator"]
    graph = _module_graph()
    graph["treespec.core.tree"] = graph["treespec.core.tree"] | {"treespec.core.masks"}   # masks imports tree
    assert ["treespec.core.masks", "treespec.core.tree"] in _cycles(graph)


def test_every_module_imports():
    """Every module imports (any ``import treespec.X`` runs ``treespec/__init__`` first, so the
    import order is that file's; the static graph above is what rules out loops)."""
    import importlib
    import pkgutil

    import treespec

    names = [m.name for m in pkgutil.walk_packages(treespec.__path__, "treespec.")]
    assert len(names) > 40 and "treespec.core.tree" in names and "treespec.drafters.feature" in names
    for name in names:
        importlib.import_module(name)
