"""Imports point one way: core <- adapters/modeling <- drafters <- api <- pipelines <- bench/train/cli.

Every module of the package is parsed (not imported), each of its imports of another mmspec module
(top level or inside a function) is resolved, and an import from a lower layer to a higher one fails
the test with the offending lines."""

import ast
from pathlib import Path

import mmspec

PACKAGE = Path(mmspec.__file__).parent
#: first component of the module path under mmspec/ -> layer (a higher number may import a lower one)
LAYERS = {
    "core": 0,
    "hub": 1, "adapters": 1, "modeling": 1, "metrics": 1,
    "drafters": 2,
    "api": 3,
    "pipelines": 4,
    "bench": 5, "train": 5, "cli": 5,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every mmspec import in the file."""
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
                # "from . import caption" names submodules: check each
                targets = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
                found += [(node.lineno, target) for target in targets]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name not in ("__init__.py", "__main__.py")}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_imports_point_one_way():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _layer(_module_name(path))
        if own is None:  # mmspec/__init__.py and __main__.py sit above everything
            continue
        for line, module in _imports(path):
            other = _layer(module)
            if other is not None and other > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)
