"""The stages import each other one way: no import cycle between kvwire's top-level packages and modules.

The graph is read from the sources (the AST), so it counts every import -- at module level,
inside functions (the lazy ones), and under ``TYPE_CHECKING`` -- whether or not a test
happens to run it. A node is a top-level package or module of ``kvwire`` (``kvwire.hf``,
``kvwire.models``, ...); ``kvwire`` itself (the package's ``__init__``, which re-exports
the stages) is not one, and nothing inside the package may import from it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvwire"


def _top(dotted: str) -> str | None:
    """``kvwire.hf.cache`` -> ``hf``; ``kvwire`` -> ``""``; anything outside kvwire -> None."""
    parts = dotted.split(".")
    if parts[0] != "kvwire":
        return None
    return parts[1] if len(parts) > 1 else ""


def _imported(path: Path) -> Iterator[tuple[str, int]]:
    """(dotted module imported, line) for every import in ``path``; ``from X import name`` gives
    ``X.name`` (a submodule or a name in X: both depend on X's package)."""
    module = ".".join(path.relative_to(SRC).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if path.name == "__init__.py":
        module = package
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                yield f"{origin}.{alias.name}" if origin else alias.name, node.lineno


def _node_of(dotted: str) -> str | None:
    top = _top(dotted)
    if top is None or top == "":
        return top
    return top if (PACKAGE / top).is_dir() or (PACKAGE / f"{top}.py").exists() else ""


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{importing node: {imported node: ["path:line", ...]}} over every source file of kvwire."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _node_of(".".join(path.relative_to(SRC).with_suffix("").parts))
        if source == "":
            continue  # kvwire/__init__.py: the public surface, importing every stage
        for dotted, line in _imported(path):
            target = _node_of(dotted)
            if target is not None and target != source:
                graph.setdefault(source, {}).setdefault(target, []).append(f"{path.relative_to(SRC)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_every_kind_of_import():
    graph = import_graph()
    assert "wire" in graph["store"] or "errors" in graph["store"]
    assert "hf" in graph["serve"]  # serve/reuse.py: from .. import hf
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]


def test_no_module_inside_kvwire_imports_the_package_root():
    graph = import_graph()
    offenders = {source: where[""] for source, where in graph.items() if "" in where}
    assert not offenders, f"import the stage itself, not kvwire: {offenders}"


def test_no_import_cycle_between_top_level_packages():
    graph = import_graph()
    found = cycles(graph)
    detail = []
    for component in found:
        for source in component:
            for target in component:
                if target in graph.get(source, {}):
                    detail.append(f"{source} -> {target}: {', '.join(graph[source][target][:3])}")
    assert not found, "import cycles between kvwire's packages:\n" + "\n".join(detail)
