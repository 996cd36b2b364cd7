"""No import circles between our modules: front end, engine, kernels, client and wire stay a
graph that can be read top-down (the architecture review found a 6-module cycle held up by a
dead fallback; this keeps it from coming back).

Every import counts: module level, inside functions and classes, and under
``if TYPE_CHECKING:``. A circle that only closes at call time or for the type checker is still
a circle to read through; a function may defer a heavy or optional *third-party* import (the
graph holds only our own modules), and a type a lower module needs of a higher one is a
Protocol in the lower module. ``from pkg import sub`` where ``sub`` is a module counts as an
import of ``pkg.sub``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"attention_kernels": "kernels", "attention_service": "service",
            "attention_client": "client", "attention_wire": "client"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, base in PACKAGES.items():
        for path in (ROOT / base / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT / base).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the module (functions, classes, TYPE_CHECKING)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _all_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            subs = {f"{base}.{alias.name}" for alias in node.names} & mods.keys()
            deps.update(subs)
            if len(subs) < len(node.names):  # some names are attributes of the module itself
                deps.add(base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], circles: list[list[str]]) -> str:
    """Each circle's modules, and each one's imports inside it: the edges to cut."""
    lines = []
    for circle in circles:
        lines.append("circle: " + ", ".join(circle))
        lines += [f"    {m} -> {', '.join(sorted(graph[m] & set(circle)))}" for m in circle]
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found our packages
    found = cycles(graph)
    assert found == [], _describe(graph, found)


def test_function_local_and_type_checking_imports_count() -> None:
    """The walk sees an import inside a function, a method and an ``if TYPE_CHECKING:``."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import a\n"
        "def f():\n    import b\n"
        "class C:\n    def m(self):\n        from c import d\n"
    )
    names = {alias.name for node in _all_imports(tree) for alias in node.names}
    assert {"a", "b", "d"} <= names


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_engine_and_kernels_do_not_import_the_front_end() -> None:
    """The layering: the engine and the kernels never reach up into the gRPC front end, and the
    kernels import nothing of the service or the client."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("attention_service.engine"):
            assert not {d for d in deps if d.startswith("attention_service.frontend")}, name
        if name.startswith("attention_kernels"):
            assert all(d.startswith("attention_kernels") for d in deps), (name, deps)
