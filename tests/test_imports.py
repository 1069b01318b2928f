"""No import circle among the modules of `sparseprefill`, function-local imports included.

Every module of the installed layout (`tools/layout.py`: `sparseprefill/` plus `reference/`,
`fast/` and `conformance/` mapped onto `sparseprefill.*`) is parsed with `ast`; each
`import` and `from ... import` anywhere in it (module level or inside a function) is an
edge to the module it names. `from PKG import name` is an edge to PKG (its `__init__`
runs) and, when `PKG.name` is a module, to that module too. A strongly connected
component of more than one module is a circle: the test names its modules and one
cycle through them. The layers this keeps one-way: reference <- fast <- methods <- the
tools (bench, compare, demo, distributed, ...); conformance reads methods, never the
reverse.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from layout import SUBPACKAGES  # noqa: E402

PACKAGE = "sparseprefill"


def package_folders() -> dict[str, Path]:
    """Installed package name -> source folder (the mapping `tools/layout.py` links)."""
    return {PACKAGE: ROOT / PACKAGE, **{f"{PACKAGE}.{sub}": ROOT / sub for sub in SUBPACKAGES}}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the layout: name -> (file, is a package `__init__`)."""
    found: dict[str, tuple[Path, bool]] = {}
    folders = package_folders()
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if "__pycache__" in parts or (package == PACKAGE and parts[0] in SUBPACKAGES):
                continue
            is_init = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_init else parts)])
            found[name] = (path, is_init)
    return found


def imported(module: str, is_init: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules of the layout one import statement of `module` runs."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        targets = {alias.name for alias in node.names}
    else:
        if node.level:
            base = module.split(".") if is_init else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        targets = {source} | {f"{source}.{alias.name}" for alias in node.names}
    out = set()
    for target in targets:
        if not target.startswith(PACKAGE):
            continue
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != module:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules its import statements name (all of them, lazy ones too)."""
    mods = modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, (path, is_init) in mods.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= imported(name, is_init, node, known)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
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


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A cycle through the component's first module (a path back to it, breadth first)."""
    inside = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return component


def test_no_import_circle() -> None:
    graph = import_graph()
    assert "sparseprefill.methods._core" in graph and "sparseprefill.fast.kernels.block_column" in graph
    found = circles(graph)
    assert not found, "import circles (each a strongly connected component; one cycle shown):\n" + "\n".join(
        f"{len(c)} modules {c}\n    cycle: {' -> '.join(one_cycle(graph, c))}" for c in found)


def test_layers_point_one_way() -> None:
    """reference imports nothing of ours but itself; fast nothing above reference; the
    descriptors no tool and no conformance."""
    graph = import_graph()

    def reaches(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    tools = {m for m in graph if m.startswith(PACKAGE + ".")
             and not m.startswith(tuple(f"{PACKAGE}.{p}" for p in (*SUBPACKAGES, "methods", "sharding")))}
    for name in graph:
        below = reaches(name)
        if name.startswith(f"{PACKAGE}.reference"):
            assert all(m.startswith(f"{PACKAGE}.reference") for m in below), (name, sorted(below))
        if name.startswith(f"{PACKAGE}.fast") and name != f"{PACKAGE}.fast.ops":
            bad = {m for m in below if not m.startswith((f"{PACKAGE}.fast", f"{PACKAGE}.reference"))}
            assert not bad - {PACKAGE}, (name, sorted(bad))
        if name.startswith(f"{PACKAGE}.methods"):
            bad = below & tools | {m for m in below if m.startswith(f"{PACKAGE}.conformance")}
            assert not bad, (name, sorted(bad))


@pytest.mark.parametrize("source,expected", [
    ("from . import b\n", {"sparseprefill.b", "sparseprefill"}),
    ("def f():\n    from .b import x\n", {"sparseprefill.b"}),
    ("import sparseprefill.b\n", {"sparseprefill.b"}),
    ("import torch\n", set()),
])
def test_the_graph_sees_each_form(source: str, expected: set[str]) -> None:
    """Module-level, lazy and absolute imports are all edges; a circle is found and named."""
    known = {"sparseprefill", "sparseprefill.a", "sparseprefill.b"}
    edges: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= imported("sparseprefill.a", False, node, known)
    assert edges == expected
    graph = {"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}
    assert circles(graph) == [["x.a", "x.b", "x.c"]]
    assert one_cycle(graph, ["x.a", "x.b", "x.c"]) == ["x.a", "x.b", "x.c", "x.a"]
