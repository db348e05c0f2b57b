"""The import graph, read from the source (AST only: nothing is imported or run).

Every import counts, function-local ones included (a circle held together by imports inside functions is
still a circle); imports under `if TYPE_CHECKING:` do not, since they never run. The checks:
1. No module imports another that (through any chain) imports it back.
2. The engine packages (`jaxserve/`, `pallas_kernels/`, `sharding/`) never import `server`.
3. `jaxserve/`'s rooms import only rooms below them (the order in jaxserve/__init__.py's docstring); so do
   `server/`'s rooms and top-level modules (the order in server/__init__.py's docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "pallas_kernels", "sharding", "server")
ENGINE_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")

# jaxserve's rooms from the top down; a room may import rooms on lower levels (and itself), never higher
# or level with it. Top-level modules of jaxserve not named here are leaves (level 0): config.py, ...
ROOM_LEVELS = {"__init__": 10, "__main__": 10, "bench": 9, "entrypoints": 8, "engine": 7, "speculative": 6.5,
               "execution": 6, "loader": 5, "model": 4, "scheduling": 4, "sampling": 3, "lora": 3, "multimodal": 2.5,
               "text": 2}
# server's rooms and top-level modules the same way: the command line and the process on top, the app that
# assembles the routes, the endpoints, the context the handlers are given, the playground's page, HTTP
# plumbing, the server's options, and reading a model's replies at the bottom.
SERVER_ROOM_LEVELS = {"__init__": 13, "cli": 12, "serve": 11, "app": 10, "openapi": 9, "responses": 8,
                      "openai": 7, "serving": 6, "playground": 5, "http": 4, "options": 3, "replies": 2,
                      "tools": 1}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module name an import in `source` may load (`from a import b` may load a.b or just a)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:  # `else:` of a TYPE_CHECKING test does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up node.level - 1 more
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: modules of `sources` it imports}, from {module: (source, is_package)}."""
    graph = {}
    for module, (source, is_package) in sources.items():
        targets = {name for name in imported_names(source, module, is_package) if name in sources}
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def room_of(module: str, package: str = "jaxserve", levels: dict = ROOM_LEVELS) -> str | None:
    """`package`'s room of a module: its subpackage (or a top-level module `levels` names), or "" for a
    leaf module (None outside `package`)."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    if len(parts) == 1:
        return "__init__"
    return parts[1] if parts[1] in levels else ""


def upward_imports(graph: dict[str, set[str]], package: str = "jaxserve", levels: dict = ROOM_LEVELS) -> list[str]:
    bad = []
    for module, targets in graph.items():
        room = room_of(module, package, levels)
        if room is None:
            continue
        for target in targets:
            other = room_of(target, package, levels)
            if other is None or other == room:
                continue
            if levels.get(other, 0) >= levels.get(room, 0):
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def project_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            sources[module_name(path, ROOT)] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
    return sources


def test_the_checks_catch_what_they_should():
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def f():\n    from pkg.c import g\n", False),  # a function-local import is an edge too
        "pkg.c": ("from .a import x\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n", False),
        "pkg.d": ("import pkg.c\n", False),
    }
    graph = import_graph(sources)
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.c"] == {"pkg.a"}  # TYPE_CHECKING: no edge
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    rooms = {"jaxserve.engine.x": ("import jaxserve.entrypoints.llm\n", False),
             "jaxserve.entrypoints.llm": ("from jaxserve.engine import x\n", False),
             "jaxserve.engine": ("", True)}
    assert upward_imports(import_graph(rooms)) == ["jaxserve.engine.x -> jaxserve.entrypoints.llm"]


def test_no_module_imports_itself_through_a_circle():
    assert circles(import_graph(project_sources())) == []


def test_the_engine_packages_never_import_the_server():
    sources = project_sources()
    offenders = [module for module, (source, is_package) in sources.items()
                 if module.split(".")[0] in ENGINE_PACKAGES
                 and any(name == "server" or name.startswith("server.")
                         for name in imported_names(source, module, is_package))]
    assert offenders == []


def test_jaxserve_rooms_import_only_rooms_below_them():
    graph = import_graph(project_sources())
    assert upward_imports(graph) == []
    assert {room_of(m) for m in graph if room_of(m) not in (None, "")} == set(ROOM_LEVELS)  # every room exists


def test_server_rooms_import_only_rooms_below_them():
    graph = import_graph(project_sources())
    assert upward_imports(graph, "server", SERVER_ROOM_LEVELS) == []
    rooms = {room_of(m, "server", SERVER_ROOM_LEVELS) for m in graph}
    assert "" not in rooms  # every module of server/ is in a room the order names
    assert rooms - {None} == set(SERVER_ROOM_LEVELS)  # and every room the order names exists


def test_the_engine_loop_stays_short_and_no_module_grows_past_450_lines():
    """Issue 25's size limits: a module that outgrows them is doing two jobs and wants splitting."""
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
               for folder in (*PACKAGES, "tests", "benchmarks", "tools") for path in (ROOT / folder).rglob("*.py")}
    assert lengths["jaxserve/engine/engine.py"] < 300
    assert {path: n for path, n in lengths.items() if n > 450} == {}
