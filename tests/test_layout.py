"""The package's layout: no import circles among ddip's modules.

The graph is read from the source with `ast`, every import counted (a function-level import
hides a circle from Python, not from a reader), so imports run one way: kernel/ and launch/ may
use rank/ and hosts/, rank/ uses neither (DESIGN.md: "imports run one way").
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "ddip"
NATIVE = {"ddip._core"}  # the bindings (python/src): they import no Python module of ddip


def module_name(path: Path) -> str:
    parts = ("ddip",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of ddip (its .py files) -> the modules of ddip it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import name`: the submodule pkg.name where there is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files.keys() | NATIVE else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in NATIVE:
                    continue
                while target and target not in files:  # `import ddip.rank.worker` names the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read_from_the_package():
    graph = import_graph()
    assert "ddip.rank.heal" in graph["ddip.kernel.heal"]
    assert "ddip.rank.worker" in graph["ddip.launch.oneshot"]  # a function-level import counts


def test_no_import_circles():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_a_circle_is_found():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_a_rank_imports_nothing_of_the_kernel_hosts_or_launches():
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("ddip.rank"):
            bad = sorted(e for e in edges if e.startswith(("ddip.kernel", "ddip.hosts", "ddip.launch", "ddip.magics")))
            assert not bad, f"{name} imports {bad}"


def test_every_function_of_the_package_reads_on_one_screen():
    # contributing.md's rule: a function over 60 lines is split where its steps are.
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
