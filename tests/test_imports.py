"""The house stays drawable: no import circle among minigpt's modules, counting imports made
inside functions too (a lazy import hides a circle from Python, not from a reader)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minigpt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The minigpt modules ``path`` imports anywhere but under ``if __name__ == "__main__"``."""
    tree = ast.parse(path.read_text())
    main_blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                   and "__main__" in ast.unparse(n.test)]
    skipped = {id(n) for block in main_blocks for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found - {module_name(path)}


def test_no_import_circles():
    paths = [p for p in PACKAGE.rglob("*.py")]
    known = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, known) for p in paths}
    # a package's __init__ importing its own modules is how a package works, not a circle
    graph = {m: {d for d in deps if not m.startswith(d + ".") or d == m} for m, deps in graph.items()}
    circles = []

    def visit(node, stack, done):
        if node in stack:
            circles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, stack + [node], done)
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [], done)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)
