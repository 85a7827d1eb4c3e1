"""The package's layout: no import circles among ddip's modules, and a process loads only its
own side of the package.

The graph is read from the source with `ast`, every import counted (a function-level import
hides a circle from Python, not from a reader), so imports run one way: kernel/ and launch/ may
use rank/ and hosts/, rank/ uses neither (DESIGN.md: "imports run one way").

What a process loads is read from real ones: ranks (cold, forked from a template, a ranch child,
one started by another host's agent) and a host's agent list the ddip modules in their
sys.modules. Each process's command line is written once, in its own package.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "ddip"
NATIVE = {"ddip._core"}  # the bindings (python/src): they import no Python module of ddip


def module_name(path: Path) -> str:
    parts = ("ddip",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _when_loaded(tree: ast.Module):
    """The nodes of a module that run when it is imported: not the bodies of functions, nor
    `if TYPE_CHECKING:` blocks (what type checkers read, never run)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def import_graph(when_loaded: bool = False) -> dict[str, set[str]]:
    """Each module of ddip (its .py files) -> the modules of ddip it imports (`when_loaded`: only
    the imports that run when it is imported)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        tree = ast.parse(path.read_text(), str(path))
        for node in (_when_loaded(tree) if when_loaded else ast.walk(tree)):
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
                    # Loading ddip.rank.worker runs ddip/__init__ and ddip/rank/__init__ first.
                    parent = target.rpartition(".")[0] if when_loaded else ""
                    while parent and parent != name:
                        edges.add(parent)
                        parent = parent.rpartition(".")[0]
    return graph


def loaded_with(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules importing `start` loads (start's package's __init__s, and what they import)."""
    todo, seen = [start], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


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
    assert "ddip.rank.worker" in graph["ddip.rank.oneshot"]  # a function-level import counts


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


# -- what a process loads -----------------------------------------------------------------------

# A rank needs ddip's package top (the package, its lazy attributes, the bindings, messages,
# gpus), the public paths it starts by (ddip.worker, ddip.template, ddip.torchdist) and rank/.
# Nothing of the notebook's side, the hosts' or the launches'; apps/ only when user code asks.
NOT_IN_A_RANK = ("ddip.kernel", "ddip.launch", "ddip.magics", "ddip.hosts", "ddip.apps")
# A host's agent is the hosts' side (and the rank template it starts, rank/template).
NOT_IN_AN_AGENT = ("ddip.kernel", "ddip.launch", "ddip.magics", "ddip.apps")


def _bad(modules, prefixes) -> list[str]:
    return sorted(m for m in modules if m.startswith(prefixes))


def test_what_each_process_imports_runs_one_way():
    # Read from the source: what importing a process's entry module loads, at import time.
    graph = import_graph(when_loaded=True)
    assert "ddip.kernel.group" not in loaded_with(graph, "ddip")  # import ddip is lazy
    assert "ddip.rank.worker" in loaded_with(graph, "ddip.worker")  # the walk follows imports
    rank_side = [m for m in graph if m.startswith("ddip.rank")] + ["ddip.worker", "ddip.template", "ddip.torchdist"]
    for start in rank_side:
        assert not _bad(loaded_with(graph, start), NOT_IN_A_RANK), (start, _bad(loaded_with(graph, start), NOT_IN_A_RANK))
    assert "ddip.hosts.agent" in loaded_with(graph, "ddip.remote")
    assert not _bad(loaded_with(graph, "ddip.remote"), NOT_IN_AN_AGENT)


def _python(script: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_import_ddip_is_lazy():
    p = _python("""
        import json, sys
        import ddip
        loaded = sorted(m for m in sys.modules if m.startswith("ddip"))
        names = dir(ddip)
        ns = {}
        exec("from ddip import *", ns)
        print(json.dumps([loaded, names, sorted(k for k in ns if not k.startswith("__")),
                          ddip.Group.__module__, ddip.kernel.group.gpu_count() >= 0,
                          callable(ddip.hosts.release), hasattr(ddip, "no_such_name")]))
    """, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded, names, star, group_home, reached, release, missing = json.loads(p.stdout)
    assert loaded == ["ddip", "ddip._lazy"]
    import ddip

    assert set(ddip.__all__) <= set(names) and {"template", "torchdist", "hosts", "kernel"} <= set(names)
    assert star == sorted(ddip.__all__)
    assert group_home == "ddip.kernel.group" and reached and release and not missing


PROBE = "import sys, ddip.template; (ddip.template.forked, sorted(m for m in sys.modules if m.startswith('ddip')))"

RANKS = """
    import json, sys
    import ddip
    PROBE = {probe!r}
    out = {{}}
    with ddip.Group(n=1, warm=False, backend=None) as g:
        out["cold"] = g.run(PROBE)[0].value
    ddip.prewarm(modules=())  # a template without torch: cheap, and forks as any
    with ddip.Group(n=1, warm=True, backend=None) as g:
        out["forked"] = g.run(PROBE)[0].value

    def child():
        import sys
        return False, sorted(m for m in sys.modules if m.startswith("ddip"))

    out["ranch child"] = ddip.ranch(1, child, caller_rank=None, warm=False)[0]
    # A rank that another host's agent started: that host is this machine, through a template
    # launcher (its own process, over loopback TCP).
    with ddip.Group(hosts="localhost:1,here:1", launcher="exec {{command}} # {{host}}", bind="127.0.0.1",
                    backend=None, warm=False) as g:
        out["another host's"] = g.run(PROBE, ranks=[1])[0].value
    print(json.dumps(out))
"""


def test_a_real_rank_loads_only_rank_code():
    p = _python(RANKS.format(probe=PROBE))
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert list(seen) == ["cold", "forked", "ranch child", "another host's"]
    assert seen["forked"][0] is True and seen["cold"][0] is False  # the probe saw the two kinds
    for kind, (_forked, modules) in seen.items():
        assert "ddip.rank.worker" in modules, (kind, modules)  # the probe reads a rank's modules
        assert not _bad(modules, NOT_IN_A_RANK), (kind, _bad(modules, NOT_IN_A_RANK))
    assert "ddip.rank.oneshot" in seen["ranch child"][1]


def test_a_host_agent_loads_no_kernel_or_launch_code(tmp_path):
    # The agent's real command line, run with no ticket (it stops at once); a sitecustomize on
    # PYTHONPATH writes the ddip modules it had loaded when it exits.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, json, sys
        atexit.register(lambda: open({str(tmp_path / 'modules.json')!r}, "w").write(
            json.dumps(sorted(m for m in sys.modules if m.startswith("ddip")))))
    """))
    from ddip.hosts import agent

    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run(agent.command(), stdin=subprocess.DEVNULL, capture_output=True, env=env, timeout=60)
    modules = json.loads((tmp_path / "modules.json").read_text())
    assert "ddip.hosts.agent" in modules
    assert not _bad(modules, NOT_IN_AN_AGENT), _bad(modules, NOT_IN_AN_AGENT)


# -- each process's command line, written once -------------------------------------------------

# Where each process's command line is written: a rank's, the template's, a host agent's.
COMMANDS = {"ddip/rank/__init__.py": "ddip.worker.main(", "ddip/rank/template.py": "ddip.template.main(",
            "ddip/hosts/agent.py": "ddip.remote"}
SPELLED = re.compile(r"ddip\.(rank\.)?(worker|template)\.main\(|^ddip\.remote$|-m\s+ddip\.remote")


def _strings(tree: ast.Module):
    """The string constants of a module's code, docstrings left out."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_each_process_command_line_is_written_once():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        for node in _strings(ast.parse(path.read_text(), str(path))):
            if SPELLED.search(node.value):
                found.setdefault(where, []).append(f"{node.lineno}: {node.value!r}")
    assert set(found) == set(COMMANDS) and all(len(v) == 1 for v in found.values()), found
    from ddip import rank
    from ddip.hosts import agent
    from ddip.rank import template

    assert rank.command("/p") == ["/p", "-c", "import ddip.worker; ddip.worker.main()"]
    assert template.command("/p") == ["/p", "-c", "import ddip.template; ddip.template.main()"]
    assert agent.command("/p") == ["/p", "-m", "ddip.remote"]
