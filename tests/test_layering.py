"""Imports go one way (docs/architecture.md, "Layers"), read from the source with ``ast``.

- No treespec module imports another inside a function: such an import hides an edge, and with
  it maybe a cycle, from anyone reading the top of the file.
- The import graph of treespec's own modules has no cycle, and neither has the graph of its
  layers, where each subpackage (``treespec.target``, ``treespec.engine``, ``treespec.bench``,
  ``treespec.proposers``, ``treespec.heads``, its ``training``, ``treespec.kernels``) is one node:
  head modules sit below the proposers, the target below both, training above the engine.

An edge is what an import runs: the named module, the submodules named by ``from X import Y``,
and the packages above them (their ``__init__`` runs first), except the importer's own
packages, which are already running. ``if TYPE_CHECKING:`` blocks never run and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = {
    "treespec": ROOT / "treespec",
    "treespec.kernels": ROOT / "kernels",
    "treespec.heads": ROOT / "heads",
}
LAYERS = (
    "treespec.heads.training", "treespec.heads", "treespec.kernels", "treespec.proposers", "treespec.engine",
    "treespec.target", "treespec.bench", "treespec.serve",
)  # fmt: skip

# Late imports of treespec modules that are allowed, each with its reason. Any other fails the
# test, and so does an entry that no longer matches anything (remove it).
LATE_IMPORTS_ALLOWED = {
    "treespec.cli": "each command imports what it runs when it runs, so that `treespec models ...` "
    "starts without importing transformers; no module imports treespec.cli (tested), so no cycle "
    "can pass through it",
}
# Layer cycles known and scheduled, each naming its issue; as above, a stale entry fails.
KNOWN_LAYER_CYCLES: dict[frozenset[str], str] = {}


def source_modules(folders: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the folders (package name -> folder)."""
    modules = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            modules[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


MODULES = source_modules(FOLDERS)


def _runs(node: ast.AST, function: str | None) -> Iterator[tuple[ast.Import | ast.ImportFrom, str | None]]:
    """Every import statement that can run, with the function it sits in (None: module level)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, function
        elif isinstance(child, ast.If) and ast.unparse(child.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for other in child.orelse:
                yield from _runs(other, function)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _runs(child, function or getattr(child, "name", "<lambda>"))
        else:
            yield from _runs(child, function)


def statements(module: str, modules: dict[str, Path] = MODULES):
    return list(_runs(ast.parse(modules[module].read_text()), None))


def names_treespec(node: ast.Import | ast.ImportFrom) -> bool:
    """Whether the statement imports treespec or any of its modules (a relative import does)."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or node.module == "treespec" or node.module.startswith("treespec.")
    return any(a.name == "treespec" or a.name.startswith("treespec.") for a in node.names)


def imports(module: str, modules: dict[str, Path] = MODULES) -> list[tuple[str, int, str | None]]:
    """(imported treespec module, line, enclosing function or None): the edges out of `module`."""
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node, function in statements(module, modules):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the importer's package, level - 1 packages up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            parts = name.split(".")
            for n in range(1, len(parts) + 1):
                target = ".".join(parts[:n])
                own = module == target or module.startswith(target + ".")
                if target in modules and not own and (target, node.lineno, function) not in found:
                    found.append((target, node.lineno, function))
    return found


def same(module: str) -> str:
    return module


def layer(module: str) -> str:
    """The node of the layer graph a module belongs to: its subpackage, or itself."""
    return next((p for p in LAYERS if module == p or module.startswith(p + ".")), module)


def graph(layer_of=same, modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """Module-level import edges between treespec's modules (or between their layers)."""
    edges: dict[str, set[str]] = {layer_of(m): set() for m in modules}
    for module in modules:
        for target, _, function in imports(module, modules):
            if function is None and layer_of(target) != layer_of(module):
                edges[layer_of(module)].add(layer_of(target))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The nodes of every strongly connected group of more than one node (each lies on a cycle)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return groups


def _closed_path(edges: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path from `start` back to itself within its group (breadth first)."""
    paths = {nxt: [start, nxt] for nxt in sorted(edges[start] & group)}
    while start not in paths:
        paths = {n: [*path, n] for node, path in paths.items() for n in sorted(edges[node] & group)} | paths
    return paths[start]


def describe(group: list[str], edges: dict[str, set[str]], layer_of=same) -> str:
    """A closed path through each node of the group, then the import statements behind each step."""
    paths = {tuple(_closed_path(edges, set(group), node)) for node in group}
    steps = {(a, b) for path in paths for a, b in zip(path, path[1:], strict=False)}
    lines = [" -> ".join(path) for path in sorted(paths)]
    for a, b in sorted(steps):
        where = [
            f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
            for m in MODULES
            if layer_of(m) == a
            for t, line, function in imports(m)
            if function is None and layer_of(t) == b
        ]
        lines.append(f"  {a} -> {b}: " + "; ".join(where))
    return "\n".join(lines)


def test_no_treespec_import_inside_a_function():
    late = [(m, f"{MODULES[m].relative_to(ROOT)}:{node.lineno} in {function}(): {ast.unparse(node)}")
            for m in MODULES for node, function in statements(m) if function and names_treespec(node)]  # fmt: skip
    offenders = [where for m, where in late if m not in LATE_IMPORTS_ALLOWED]
    assert not offenders, (
        "treespec modules imported inside functions (import them at the top):\n" + "\n".join(offenders)
    )
    stale = sorted(set(LATE_IMPORTS_ALLOWED) - {m for m, _ in late})
    assert not stale, (
        f"LATE_IMPORTS_ALLOWED lists modules with no late import any more (remove them): {stale}"
    )
    importers = sorted(m for m in MODULES for t, _, _ in imports(m) if t in LATE_IMPORTS_ALLOWED)
    assert not importers, (
        f"{importers} import a module whose late imports are allowed only while nothing does"
    )


def test_no_module_goes_through_the_lazy_exports():
    """``import treespec`` then ``treespec.generate``: the edge to treespec.api would be invisible."""
    lazy = [f"{MODULES[m].relative_to(ROOT)}:{node.lineno}" for m in MODULES for node, _ in statements(m)
            if isinstance(node, ast.Import) and any(a.name == "treespec" for a in node.names)]  # fmt: skip
    assert not lazy, f"import the module that defines the name instead of treespec itself: {lazy}"


def test_no_import_cycle_between_modules():
    edges = graph()
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_import_cycle_between_layers():
    edges = graph(layer)
    found = cycles(edges)
    unexpected = [c for c in found if frozenset(c) not in KNOWN_LAYER_CYCLES]
    assert not unexpected, "layer cycles:\n" + "\n".join(describe(c, edges, layer) for c in unexpected)
    gone = [sorted(c) for c in set(KNOWN_LAYER_CYCLES) - {frozenset(c) for c in found}]
    assert not gone, f"KNOWN_LAYER_CYCLES lists cycles that are gone (remove them): {gone}"


def test_head_modules_sit_below_proposers_and_training_above_the_engine():
    edges = graph()
    reached, todo = set(), ["treespec.heads"]
    while todo:
        for nxt in edges[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    above = sorted(m for m in reached if layer(m) in ("treespec.proposers", "treespec.heads.training"))
    assert not above and "treespec.engine" not in reached, (
        f"treespec.heads imports {above or 'treespec.engine'}"
    )
    assert "treespec.api" in edges["treespec.heads.training.train"] & edges["treespec.heads.training.data"]


def test_the_checks_see_late_imports_and_cycles(tmp_path):
    """The checks on a made-up package: relative imports, TYPE_CHECKING, a late import, a cycle."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text(
        "from treespec import b\n\ndef f():\n    import treespec.c\n    import treespec\n"
    )
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import treespec.c\n"
    )
    (tmp_path / "c.py").write_text("from . import a\n")
    modules = source_modules({"treespec": tmp_path})
    assert imports("treespec.a", modules) == [("treespec.b", 1, None), ("treespec.c", 4, "f")]
    assert [(n.lineno, f) for n, f in statements("treespec.a", modules) if f and names_treespec(n)] == [
        (4, "f"),
        (5, "f"),  # its own package: no edge, but still a late import
    ]
    assert imports("treespec.b", modules) == []  # under TYPE_CHECKING only
    assert imports("treespec.c", modules) == [("treespec.a", 1, None)]  # relative
    edges = graph(modules=modules)
    assert cycles(edges) == []  # a late import is no edge of the module-level graph: test 1 catches it
    edges["treespec.b"].add("treespec.c")
    assert cycles(edges) == [["treespec.a", "treespec.b", "treespec.c"]]
    edges["treespec.c"].add("treespec.b")  # a second cycle in the same group
    assert [_closed_path(edges, {"treespec.a", "treespec.b", "treespec.c"}, "treespec.b")] == [
        ["treespec.b", "treespec.c", "treespec.b"]
    ]
