"""Imports go one way (``../shared/DESIGN.md``): ``ir`` imports nothing of tidal, ``passes`` and
``runtime`` import only ``ir``, ``sim`` (the simulator, which runs the runtime's Program objects
with the ir cost models) imports ``ir`` and ``runtime``, ``compiler`` imports those four; nothing
below ``sim`` imports it, and nothing imports ``examples``.
Every ``import`` statement counts, function-level ones included (read from the AST)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("ir", "passes", "runtime", "sim", "compiler")
MAY_IMPORT = {
    "ir": set(),
    "passes": {"ir"},
    "runtime": {"ir"},
    "sim": {"ir", "runtime"},
    "compiler": {"ir", "passes", "runtime", "sim"},
}


def _target(module: str) -> str:
    """The layer a dotted module name belongs to ('' when not tidal's)."""
    parts = module.split(".")
    if parts[0] == "examples":
        return "examples"
    if parts[0] == "tidal" and len(parts) > 1:
        return parts[1]
    return ""


def imports(path: Path):
    """(module name, line) of every import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


def wrong_edges() -> dict[tuple[str, str], list[str]]:
    """(file, layer it should not import) -> the offending imports."""
    out: dict[tuple[str, str], list[str]] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for module, line in imports(path):
                dst = _target(module)
                if dst and dst != layer and dst not in MAY_IMPORT[layer]:
                    out.setdefault((rel, dst), []).append(f"{rel}:{line} imports {module}")
    return out


def test_imports_go_one_way():
    edges = wrong_edges()
    assert not edges, "imports that go the wrong way:\n" + "\n".join(
        line for lines in edges.values() for line in lines)


def test_relative_imports_are_not_used():
    # the walk reads absolute imports only; a relative one would slip past it
    rel = [f"{p.relative_to(ROOT)}:{n.lineno}" for layer in LAYERS
           for p in (ROOT / layer).rglob("*.py")
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not rel, rel


def test_the_zoo_has_one_import_name():
    import importlib

    import pytest

    assert hasattr(importlib.import_module("examples.models"), "ZOO")
    with pytest.raises(ImportError, match="examples.models"):
        importlib.import_module("tidal.examples.models")
