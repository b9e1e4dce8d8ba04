# Copyright © 2026 turboquant_mlx contributors.

"""The package's modules import each other without a cycle. An import inside a
function counts: it is a cycle that only waits for its first call."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "turboquant_mlx"


def _imported_modules(path: pathlib.Path, modules: set) -> set:
    """The package's modules that ``path`` imports anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                parts = node.module.split(".") if node.module else []
            elif node.level == 0 and (node.module or "").split(".")[0] == "turboquant_mlx":
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                found.add(parts[0])
            else:  # from . import a, b
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "turboquant_mlx" and len(parts) > 1:
                    found.add(parts[1])
    return found & modules


def _graph():
    files = {p.stem: p for p in PACKAGE.glob("*.py")}
    modules = set(files)
    return {name: _imported_modules(path, modules) - {name} for name, path in files.items()}


def _find_cycle(graph):
    """A list of modules that import each other in a circle, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_package():
    graph = _graph()
    assert {"cache", "kv_cache", "attention", "factory"} <= set(graph)
    assert "kv_cache" in graph["cache"] and "kv_cache" in graph["factory"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle)
