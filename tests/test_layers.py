"""common/ is layered: a package imports only from itself and the packages before it in common/__init__.py's list,
and no modules import each other in a circle. Read from the sources (ast), nothing imported; function-level imports
count as much as the module's own."""

import ast
import re
from pathlib import Path

from conftest import REPO


def layer_order(root: Path) -> list[str]:
    """The layers, lowest first, as common/__init__.py's docstring lists them (an indented name, then its job)."""
    docstring = ast.get_docstring(ast.parse((root / "__init__.py").read_text()), clean=False)
    return re.findall(r"^    (\w+) {2,}\S", docstring, flags=re.MULTILINE)


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root` by its dotted name (a package by its own name)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict) -> dict[str, int]:
    """The modules of the tree that `name` imports (anywhere in the file), each with the first line that does."""
    found = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            while target and target not in modules:  # `import common.a.b.name` -> the module that holds it
                target = target.rpartition(".")[0]
            if target and target != name:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def layering_problems(root: Path) -> list[str]:
    """Each import against the layer order, each package or module the order leaves out, and each circle."""
    order = layer_order(root)
    modules = module_names(root)
    top = root.name
    problems = []
    present = {name.split(".")[1] for name in modules if name.count(".") >= 1}
    for missing in sorted(present - set(order)):
        problems.append(f"{top}/{missing} is in no layer of {top}/__init__.py's list")
    graph = {}
    for name, path in modules.items():
        graph[name] = imports_of(name, path, modules)
        if name == top:
            continue
        own = order.index(name.split(".")[1]) if name.split(".")[1] in order else None
        for target, line in graph[name].items():
            if target == top or own is None or target.split(".")[1] not in order:
                continue
            if order.index(target.split(".")[1]) > own:
                problems.append(
                    f"{path.relative_to(root.parent)}:{line} imports {target}, a higher layer than "
                    f"{name.split('.')[1]} ({' < '.join(order)})"
                )
    problems += [f"import circle: {' -> '.join(circle)}" for circle in circles(graph)]
    return problems


def circles(graph: dict[str, dict]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), each closed on its first module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(_closed_path(sorted(group), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _closed_path(group: list[str], graph: dict) -> list[str]:
    """A path from the group's first module back to itself, through the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {target: [start, target] for target in graph[start] if target in members}
    frontier = list(paths)
    while start not in paths:
        node = frontier.pop(0)
        for target in graph[node]:
            if target in members and target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    return paths[start]


def test_common_is_layered_with_no_import_circle():
    order = layer_order(REPO / "common")
    assert order[0] == "launch" and order[-1] == "run", order
    assert layering_problems(REPO / "common") == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


LAYERED = {
    "pkg/__init__.py": '"""Layers:\n\n    low     the bottom\n    high    on top\n    run     the run\n"""\n',
    "pkg/low/__init__.py": "",
    "pkg/low/a.py": "import os\n",
    "pkg/low/b.py": "from pkg.low.a import thing\n",
    "pkg/high/__init__.py": "",
    "pkg/high/c.py": "from pkg.low import b\n\n\ndef f():\n    from pkg.high.d import g\n",
    "pkg/high/d.py": "from .c import f\n",
    "pkg/run.py": "from pkg.high import c\nfrom pkg.low.b import thing\n",
}


def test_the_check_finds_a_planted_circle_an_upward_import_and_a_package_in_no_layer(tmp_path):
    clean = _tree(tmp_path / "clean", {**LAYERED, "pkg/high/d.py": "from pkg.low.a import x\n"})
    assert layer_order(clean / "pkg") == ["low", "high", "run"]
    assert layering_problems(clean / "pkg") == []
    # c imports d inside a function and d imports c (relative): a circle, however deep the import sits
    circle = _tree(tmp_path / "circle", LAYERED)
    assert layering_problems(circle / "pkg") == ["import circle: pkg.high.c -> pkg.high.d -> pkg.high.c"]
    upward = _tree(
        tmp_path / "upward",
        {**LAYERED, "pkg/high/d.py": "", "pkg/low/b.py": "", "pkg/low/a.py": "import pkg.high.c.f\n"},
    )
    assert layering_problems(upward / "pkg") == [
        "pkg/low/a.py:1 imports pkg.high.c, a higher layer than low (low < high < run)"
    ]
    stray = _tree(tmp_path / "stray", {**LAYERED, "pkg/high/d.py": "", "pkg/extra.py": ""})
    assert layering_problems(stray / "pkg") == ["pkg/extra is in no layer of pkg/__init__.py's list"]
