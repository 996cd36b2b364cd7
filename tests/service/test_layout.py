"""The server's layout holds: no import circles, leaves that stay leaves, a front end that never
imports torch or the engine, an engine that never imports the front end."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "service" / "attention_service"
FRONT_END = ("attention_service.frontend", "attention_service.ipc.frontend_main",
             "attention_service.ipc.remote_link", "attention_service.ipc.channel",
             "attention_service.ipc.arena",
             "attention_service.link", "attention_service.params", "attention_service.errors",
             "attention_service.metrics", "attention_service.config")


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    return {
        m: {i for i in _imports(p, top_level_only) if i in modules and i != m}
        for m, p in modules.items()
    }


def test_no_import_circles() -> None:
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in graph[m]:
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(
                    path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert len(graph) > 25  # the check saw the package


def test_leaves_import_nothing_of_the_service_but_leaves() -> None:
    graph = _graph(top_level_only=False)
    leaves = {"attention_service.errors": set(),
              # params checks cache ids, so it may raise the errors leaf's RequestError.
              "attention_service.params": {"attention_service.errors"},
              "attention_service.link": {"attention_service.params"}}
    for leaf, allowed in leaves.items():
        assert graph[leaf] <= allowed, (leaf, graph[leaf])


def test_front_end_never_imports_torch_or_the_engine() -> None:
    for path in PKG.rglob("*.py"):
        module = _module(path)
        if not module.startswith(FRONT_END):
            continue
        for imp in _imports(path, top_level_only=False):
            assert imp.split(".")[0] not in ("torch", "triton", "attention_kernels"), (module, imp)
            assert not imp.startswith("attention_service.engine"), (module, imp)


def test_engine_never_imports_the_front_end() -> None:
    for path in (PKG / "engine").rglob("*.py"):
        for imp in _imports(path, top_level_only=False):
            assert not imp.startswith("attention_service.frontend"), (_module(path), imp)


def test_a_front_end_process_runs_without_torch() -> None:
    code = ("import sys\n"
            "import attention_service.ipc.frontend_main, attention_service.frontend.server\n"
            "import attention_service.frontend.servicer, attention_service.metrics\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_service_reads_an_ops_rules_never_names_a_kind() -> None:
    """Each op kind carries its rules (``params.Op``: header, queries, kernel, lse layout);
    code reads them (``op.queries``, ``op.kernel``) instead of testing which kind it has
    (``op is Op.APPEND_KV``), so a new kind is one table row, not a hunt through the engine."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, ast.Is | ast.IsNot | ast.Eq | ast.NotEq) for op in node.ops):
                for side in (node.left, *node.comparators):
                    if (isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name)
                            and side.value.id == "Op"):
                        found.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not found, f"op kinds tested by name: {found}"


def test_one_prefill_crosses_at_most_20_files_and_10_shapes(tmp_path: Path) -> None:
    """Issue 62's measure, kept from growing back: ``tools/request_path.py`` records one
    ``client.attention`` Prefill through a process group (cpu) in every process. On the way in
    (up to the kernel) it crossed 33 files and made 24 data shapes before the redesign; 20 and
    10 now (docs/service.md, "The path of one call, counted")."""
    out = tmp_path / "path.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "request_path.py"), "--json", str(out)],
        timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(out.read_text())
    files, shapes = counts["files"]["in"], counts["data shapes"]["in"]
    assert any(f.endswith("cpu_attention.py") for f in files), files  # the kernel was reached
    assert len(files) <= 20, files
    assert len(shapes) <= 10, shapes
