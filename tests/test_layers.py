"""Imports point one way, and no file of mmspec/ reaches itself through its imports:
core, cpu <- hub <- modeling, metrics <- adapters <- drafters <- api <- pipelines <- serve/bench/train/cli.

Every module of the package is parsed (not imported): each of its imports of another mmspec module
(top level, inside a function or under TYPE_CHECKING) is resolved to the file it names, an import
from a lower layer to a higher one fails the test with the offending lines, and so does a circle of
files (one or more layers' worth: files of one layer may import each other, but never in a circle)."""

import ast
from pathlib import Path

import mmspec

PACKAGE = Path(mmspec.__file__).parent
#: first component of the module path under mmspec/ -> layer (a higher number may import a lower
#: one, or one of its own). The hub (names -> weights, dtype and device choice) sits below the model
#: code, which the adapters wrap; the metrics read only the hub's paths, so they sit beside modeling.
LAYERS = {
    "core": 0, "cpu": 0,
    "hub": 1,
    "modeling": 2, "metrics": 2,
    "adapters": 3,
    "drafters": 4,
    "api": 5,
    "pipelines": 6,
    "serve": 7, "bench": 7, "train": 7, "cli": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: module name -> its file, for every module of the package
MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every mmspec import in the file; ``from package import name``
    counts as an import of the submodule ``package.name`` where there is one (of the package else)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("mmspec")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("mmspec"):
                # "from . import caption" names submodules; "from .x import y" may too
                targets = {f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES or not node.module else module
                           for alias in node.names}
                found += [(node.lineno, target) for target in sorted(targets)]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports: the first line importing it}."""
    graph = {}
    for name, path in MODULES.items():
        edges = {}
        for line, module in _imports(path):
            if module in MODULES and module != name:
                edges.setdefault(module, line)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion): each a set of files every one of which reaches every other through its imports."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
    return sorted(found)


def test_every_subpackage_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name not in ("__init__.py", "__main__.py")}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_imports_point_one_way():
    upward = []
    for path in MODULES.values():
        own = _layer(_module_name(path))
        if own is None:  # mmspec/__init__.py and __main__.py sit above everything
            continue
        for line, module in _imports(path):
            other = _layer(module)
            if other is not None and other > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_circle_of_imports():
    graph = _graph()
    report = []
    for component in _circles(graph):
        members = set(component)
        report.append("circle of " + ", ".join(str(MODULES[m].relative_to(PACKAGE.parent)) for m in component) + ":")
        report += [f"  {MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {other}"
                   for m in component for other, line in sorted(graph[m].items()) if other in members]
    assert not report, "files that import themselves through others (cut each circle):\n" + "\n".join(report)


def test_circles_are_found():
    """The circle finder on a made-up graph: two circles (one through three modules), a chain, a
    module importing a member of a circle without being part of it."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1, "e": 1}, "e": {"d": 1},
             "f": {"g": 1}, "g": {}}
    assert _circles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_submodule_imports_resolve_to_their_files():
    """``from ..modeling import fused`` is an import of mmspec/modeling/fused.py, not of the
    package's __init__: else a circle through it would go unseen."""
    imports = dict((module, line) for line, module in _imports(PACKAGE / "modeling" / "llamagen.py"))
    assert "mmspec.modeling.fused" in imports and "mmspec.modeling" not in imports
