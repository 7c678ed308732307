"""The house stays drawable: no import circle among minigpt's modules, and imports run down the
rings (core <- services <- features <- application <- entry points), counting imports made
inside functions and under ``if __name__ == "__main__"`` too (a lazy import hides a circle from
Python, not from a reader). The core's purity: tests/test_model.py."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minigpt"


def module_name(path: Path, root: Path) -> str:
    """``a.b.c`` for ``root/a/b/c.py``; a package's ``__init__.py`` is the package itself."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name ``path`` (module ``name``) imports, anywhere in the file: top level,
    functions, classes and ``__main__`` blocks; relative imports made absolute. For
    ``from a import b`` both ``a`` and ``a.b`` (``b`` may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..a import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (under ``root``) it imports. A module's import of
    the package it sits in is left out: a package's ``__init__`` importing its own modules is
    how a package works, and Python runs that ``__init__`` before the module either way."""
    paths = sorted((root / package).rglob("*.py"))
    names = {module_name(p, root): p for p in paths}
    graph = {}
    for name, path in names.items():
        deps = {d for d in imported_names(path, name) if d in names and d != name}
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
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


def test_no_import_circles():
    graph = import_graph(PACKAGE.parent, "minigpt")
    assert "minigpt.checkpoint.__main__" in graph and len(graph) > 50
    assert not circles(graph), circles(graph)


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_circles_hidden_in_functions_and_main_blocks(tmp_path):
    """A synthetic package: ``a`` imports ``b`` inside a function, ``b`` imports ``a`` only
    under ``if __name__ == "__main__"``, ``sub.c`` reaches ``a`` by a relative import and
    ``a`` imports ``sub.c`` back; ``leaf`` is imported by all and imports nothing."""
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/leaf.py": "X = 1\n",
        "pkg/a.py": "from pkg import leaf\n\ndef f():\n    import pkg.b\n\n"
                    "def g():\n    from pkg.sub import c\n",
        "pkg/b.py": "from pkg.leaf import X\n\nif __name__ == '__main__':\n"
                    "    from pkg import a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\nfrom ..leaf import X\n",
        "pkg/d.py": "import pkg.leaf\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.leaf"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (tmp_path / "pkg/b.py").write_text("from pkg.leaf import X\n")
    (tmp_path / "pkg/sub/c.py").write_text("from ..leaf import X\n")
    assert circles(import_graph(tmp_path, "pkg")) == []



# The rings, lowest first: a module may import its own ring and those below. A module of minigpt
# itself (minigpt/x.py) is the core unless named here; minigpt/<pkg>/__main__.py is an entry point.
RINGS = {"data": 1, "config": 1, "checkpoint": 1, "cpu": 1,
         "chat": 2, "eval": 2, "viz": 2, "inference": 2,
         "train": 3, "serve": 3}
ENTRY_POINT = 4
# The imports allowed to run back up, each with its reason.
UPWARD = {
    # Conversations for fine-tuning render through the chat template, which generation,
    # evaluation and the server share with the chat feature: the one piece of chat the data needs.
    ("minigpt.data.chat", "minigpt.chat.template"),
}


def ring(module: str) -> int:
    """The ring of a module ``minigpt.<part>...`` (see ``RINGS``)."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return ENTRY_POINT
    return RINGS.get(parts[1], 0) if len(parts) > 1 else 0


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every import of a module from a higher ring than its own."""
    return {(a, b) for a, deps in graph.items() for b in deps if ring(b) > ring(a)}


def test_imports_run_down_the_rings():
    graph = import_graph(PACKAGE.parent, "minigpt")
    assert upward(graph) == UPWARD, sorted(upward(graph) - UPWARD)
    assert len(UPWARD) <= 2


def test_the_ring_check_finds_an_upward_import_in_a_function(tmp_path):
    """A service importing the application inside a function is found; a feature importing a
    service and an entry point importing the application are not."""
    write_package(tmp_path, {
        "minigpt/__init__.py": "", "minigpt/model.py": "",
        "minigpt/data/__init__.py": "", "minigpt/chat/__init__.py": "",
        "minigpt/train/__init__.py": "", "minigpt/train/run.py": "from minigpt import model\n",
        "minigpt/data/load.py": "def f():\n    from minigpt.train import run\n",
        "minigpt/chat/talk.py": "from minigpt.data import load\n",
        "minigpt/train/__main__.py": "from minigpt.train.run import f\n",
    })
    graph = import_graph(tmp_path, "minigpt")
    assert upward(graph) == {("minigpt.data.load", "minigpt.train"),
                             ("minigpt.data.load", "minigpt.train.run")}
