"""No import loops among treespec modules, and every module imports."""

from __future__ import annotations

import pytest


# Module ``__getattr__`` forwarders keep pre-move import paths working; they run only when an old
# name is asked for, never while a module imports, so they are not edges of the import graph.
COMPAT_FORWARDERS = {"treespec.cost", "treespec.cost.calibration", "treespec.trees", "treespec.trees.sequoia"}


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
        skip = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                and name in COMPAT_FORWARDERS for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
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


def test_the_module_graph_has_no_cycles():
    graph = _module_graph()
    # the engine depends on the pure cost model only; measurements that run generations sit above it
    assert "treespec.engine" not in graph["treespec.cost.calibration"]
    assert "treespec.engine" not in graph["treespec.trees.sequoia"]
    assert _cycles(graph) == []


def test_every_module_imports_and_old_paths_still_work():
    """Every module imports (any ``import treespec.X`` runs ``treespec/__init__`` first, so the
    import order is that file's; the static graph above is what rules out loops), and the
    names moved by the de-looping still resolve at their old paths."""
    import importlib
    import pkgutil

    import treespec

    names = [m.name for m in pkgutil.walk_packages(treespec.__path__, "treespec.")]
    assert len(names) > 40 and "treespec.measure" in names and "treespec.drafters.feature" in names
    for name in names:
        importlib.import_module(name)
    from treespec.cost import calibrate_drafter
    from treespec.cost.calibration import calibrate_drafter as c2
    from treespec.drafters.eagle import FeatureDrafter, HeadConfig, Trunk, build_head  # noqa: F401
    from treespec.measure import calibrate_drafter as a, measure_acceptance_vector as b
    from treespec.trees import measure_acceptance_vector
    from treespec.trees.sequoia import measure_acceptance_vector as m2

    assert a is calibrate_drafter is c2 and b is measure_acceptance_vector is m2
    with pytest.raises(AttributeError):
        treespec.trees.no_such_name
