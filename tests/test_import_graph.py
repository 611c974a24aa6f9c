"""The import graph of ``slime_ascend/`` has no circle, between files or between folders.

The graph is read statically (``ast``), so it sees every import whether or not it runs in a test:

- every ``import`` and ``from ... import`` of a ``slime_ascend`` module counts, at module level or inside a
  function or class (a function-level import is still an arrow: the two files depend on each other; it only
  hides the circle from the interpreter); relative imports are resolved against the importing file's
  package; imports under ``if TYPE_CHECKING:`` do not count (they never run);
- ``from pkg import name`` imports ``pkg.name`` when that is a module of the package, else ``pkg`` (its
  ``__init__.py``); ``import pkg.mod`` imports ``pkg.mod``. The parent packages' ``__init__.py`` that Python
  runs on the way are not counted as arrows (they would put every ``__init__.py`` on a circle with the
  package's own modules).

Files: one node per ``.py`` file. Folders, checked twice: one node per top-level package (``rollout``, with
``rollout/torch_engine`` inside it: the feature and layer boundaries; this is where a ledger that loads its patches
by name and patches that import features meet the features' own imports), and one node per package folder at
its full depth (``rollout`` and ``rollout/torch_engine`` are two). A package's ``__init__.py`` belongs to its own
folder (it is that package: importing a name from it depends on the folder). The files directly in
``slime_ascend/`` are not a folder here: that folder is the whole package (its modules are entry points and
bottom-level helpers reached from every folder), so each of them is its own node in the folder graphs too. An
arrow inside one folder is not a folder arrow.

On failure the message names every circle as a list of files (or folders), first node repeated at the end.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slime_ascend"
NAME = PACKAGE.name


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in ``tree``, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = list(node.orelse)
        stack.extend(children)


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``module`` (defined in ``path``) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def nearest(name: str) -> str | None:  # the longest existing module prefix of a dotted name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [nearest(alias.name) for alias in node.names if alias.name.split(".")[0] == NAME]
        else:
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != NAME:
                continue
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else nearest(base) for a in node.names]
        found.update(t for t in targets if t and t != module)
    return found


def file_graph() -> dict[str, set[str]]:
    """File (path relative to the repository) -> the files it imports."""
    modules = module_files()
    rel = {m: p.relative_to(ROOT).as_posix() for m, p in modules.items()}
    return {rel[m]: {rel[t] for t in imported_modules(m, p, modules)} for m, p in modules.items()}


def folder_of(file: str, depth: str = "full") -> str:
    """The folder node of ``file``: its package folder (``depth="full"``) or top-level package (``"top"``)."""
    parts = Path(file).parts
    if len(parts) == 2:  # a module directly in slime_ascend/: its own node
        return file
    return "/".join(parts[:2] if depth == "top" else parts[:-1])


def folder_graph(files: dict[str, set[str]], depth: str = "full") -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source, targets in files.items():
        here = folder_of(source, depth)
        graph.setdefault(here, set()).update(t for t in (folder_of(t, depth) for t in targets) if t != here)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one node, as a node list whose first node is
    repeated at the end: a shortest circle through the component's first node (in sorted order)."""
    return sorted(_shortest_circle(graph, c) for c in components(graph))


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan): the nodes that lie on circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(root: str) -> None:  # iterative Tarjan: the package's graph is deep enough for the recursion limit
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _shortest_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {start} in its component")  # a component always has one


def _report(kind: str, graph: dict[str, set[str]]) -> str:
    lines = []
    for component in sorted(components(graph), key=min):
        circle = _shortest_circle(graph, component)
        rest = sorted(component - set(circle))
        lines.append(f"  {circle}" + (f"\n    and, on circles with them: {rest}" if rest else ""))
    return f"{len(lines)} import circle(s) between {kind}:\n" + "\n".join(lines)


# -- the finder itself, on hand-made graphs ----------------------------------------------------------------
def test_cycles_finds_a_circle_and_its_members():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_cycles_accepts_a_tree_and_a_diamond():
    assert cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []


def test_imports_are_resolved_relative_function_level_and_from_package(tmp_path, monkeypatch):
    package = tmp_path / NAME
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("VALUE = 1\n")
    (package / "sub" / "leaf.py").write_text("")
    (package / "top.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .sub import leaf, VALUE\n"
        "def f():\n    from . import other\n"
        "if TYPE_CHECKING:\n    from .sub import hidden\n")
    (package / "other.py").write_text("import slime_ascend.sub.leaf\nfrom ..outside import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    files = file_graph()
    assert files == {
        f"{NAME}/__init__.py": set(),
        f"{NAME}/sub/__init__.py": set(),
        f"{NAME}/sub/leaf.py": set(),
        f"{NAME}/top.py": {f"{NAME}/sub/leaf.py", f"{NAME}/sub/__init__.py", f"{NAME}/other.py"},
        f"{NAME}/other.py": {f"{NAME}/sub/leaf.py"},
    }
    assert folder_graph(files)[f"{NAME}/top.py"] == {f"{NAME}/sub", f"{NAME}/other.py"}
    assert folder_of(f"{NAME}/a/b/c.py") == f"{NAME}/a/b" and folder_of(f"{NAME}/a/b/c.py", "top") == f"{NAME}/a"


# -- the package ---------------------------------------------------------------------------------------------
def test_no_circle_between_files():
    graph = file_graph()
    if cycles(graph):
        pytest.fail(_report("files", graph), pytrace=False)


@pytest.mark.parametrize("depth", ["top", "full"])
def test_no_circle_between_folders(depth):
    graph = folder_graph(file_graph(), depth)
    if cycles(graph):
        pytest.fail(_report(f"folders ({depth})", graph), pytrace=False)
