"""The layers of `src/plait`: imports run down `plait._layers.FLOORS`, no module imports
itself through others, bench and experiment stay outside what training imports, no module
is over 400 lines, and docs/architecture.md shows the same table.

Every import counts: top-level, in a function (lazy) and under `if TYPE_CHECKING:`, since
each is a dependency that a reader and a refactoring must follow. The graph is built here
from the source with `ast`, independently of the package (nothing of plait is imported but
the table).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from plait._layers import FLOORS, OUTSIDE, floor_of, markdown_table

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "plait"
MAX_LINES = 400
KNOWN_CIRCLES: list[list[str]] = []


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    where: str  # file:line of the import


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module that `name` (a module, or a name inside one) lives in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> list[Edge]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from a import b` depends on the module a.b when b is one, else on a
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]  # fmt: skip
        else:
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}"
        for name in names:
            if name == "plait" or name.startswith("plait."):
                target = _resolve(name)
                if target != module:
                    edges.append(Edge(module, target, where))
    return edges


EDGES = sorted({e for module, path in MODULES.items() for e in _imports(module, path)},
               key=lambda e: (e.where, e.target))  # fmt: skip


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_graph_holds_every_kind_of_import(tmp_path: Path) -> None:
    # a regression in the walk would pass every check below: the three kinds must count
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from plait.layout import Layout\n"
        "if TYPE_CHECKING:\n"
        "    from plait.mesh import Meshes\n"
        "def f():\n"
        "    import plait.config\n"
        "    from plait.schedule import ir\n"
    )
    found = {(e.target, e.where.rsplit(":", 1)[1]) for e in _imports("plait.x", source)}
    assert found == {("plait.layout", "2"), ("plait.mesh", "4"), ("plait.config", "6"),
                     ("plait.schedule.ir", "7")}  # fmt: skip


def test_circles_are_found() -> None:
    edges = [
        Edge("plait.config", "plait.layout", "a"),
        Edge("plait.layout", "plait.mesh", "b"),
        Edge("plait.mesh", "plait.config", "c"),
        Edge("plait.mesh", "plait.wait", "d"),
    ]
    assert _cycles(edges) == [["plait.config", "plait.layout", "plait.mesh"]]
    assert _cycles(edges[1:]) == []


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in MODULES}
    listed = [r for rooms_ in FLOORS.values() for r in rooms_]
    assert len(listed) == len(set(listed)), "a room is on two floors"
    assert sorted(rooms - set(listed)) == [], "rooms missing from plait._layers.FLOORS"
    assert sorted(set(listed) - rooms) == [], "rooms in the table that do not exist"


def test_no_import_runs_up():
    up = [f"{e.where}: {e.source} (floor {floor_of(_room(e.source))}) imports {e.target} "
          f"(floor {floor_of(_room(e.target))})"
          for e in EDGES if floor_of(_room(e.target)) > floor_of(_room(e.source))]  # fmt: skip
    assert up == [], "imports up the layers:\n" + "\n".join(up)


def test_no_circles():
    cycles = [c for c in _cycles(EDGES) if c not in KNOWN_CIRCLES]
    lines = []
    for members in cycles:
        inside = [e for e in EDGES if e.source in members and e.target in members]
        lines.append(" <-> ".join(members))
        lines += [f"    {e.where}: imports {e.target}" for e in inside]
    assert cycles == [], "modules that import each other:\n" + "\n".join(lines)


def test_bench_and_experiment_stay_outside():
    allowed = {*OUTSIDE, "cli", "__main__"}
    wrong = [f"{e.where}: imports {e.target}" for e in EDGES
             if _room(e.target) in OUTSIDE and _room(e.source) not in allowed]  # fmt: skip
    assert wrong == [], "bench/experiment imported from the core:\n" + "\n".join(wrong)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_docs_show_the_table():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert markdown_table() in text, (
        "docs/architecture.md's layer table differs from plait._layers.FLOORS; paste:\n"
        + markdown_table()
    )
