"""Imports go one way (``../shared/DESIGN.md``), read from the AST of every library file.

Layers: ``ir`` imports nothing of tidal, ``passes`` and ``runtime`` import only ``ir``, ``sim``
(the simulator, which runs the runtime's Program objects with the ir cost models) imports ``ir``
and ``runtime``, ``compiler`` imports those four and the package root; nothing below
``compiler`` imports ``tidal`` itself (``import tidal``, ``from tidal import compile``), and
nothing imports ``examples``.

What counts as an import: every ``import`` statement at any depth (inside functions and
``if TYPE_CHECKING:`` blocks too), and every string that names a tidal module, alone or as a
``"module:attribute"`` reference (what ``importlib.import_module``, ``__import__`` and the
registries' tables import), or starts one in an f-string (``f"tidal.passes.{name}"``).

Rooms of ``runtime/``: the execution core (``runtime/*.py`` and ``runtime/scheduling/``:
backends, lowering, the program interpreter, the scheduler, distributed launch; and
``runtime/programs/``, the program builders) and the technique runtimes, each in its own
subpackage. What each room may import of the others (``ir`` is open to all of them; a dotted
name allows that one module only; this table is as strict as the tree allows)::

    core       runtime/*.py, runtime/scheduling/              programs
    programs   runtime/programs/                              core, comm, weights
    comm       compressors, DDP hooks, grad sync, Accordion   runtime.distributed
    weights    weight store, loader, residency, memory probe  nothing
    chai       CHAI cache, decoding, generation               nothing
    switching  PipeSwitch task switching                      weights, runtime.program,
                                                              runtime.programs.layer_group_steps,
                                                              runtime.programs.layer_group_loads
    bagpipe    Bagpipe oracle, servers, trainer, launch       runtime.distributed,
                                                              runtime.peer_failures

Inside a folder no module imports itself back through others (a file-level cycle, function-level
imports included), and no module imports a private name (``_x``) of another tidal module, by
``from tidal.x import _y`` or as ``module._y``."""
import ast
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tidal"
LAYERS = ("ir", "passes", "runtime", "sim", "compiler")
MAY_IMPORT = {
    "ir": set(),
    "passes": {"ir"},
    "runtime": {"ir"},
    "sim": {"ir", "runtime"},
    "compiler": {"ir", "passes", "runtime", "sim", PACKAGE},
}
TECHNIQUE_ROOMS = ("comm", "weights", "chai", "switching", "bagpipe")
CORE_SUBPACKAGES = ("scheduling",)   # parts of the core in a folder of their own
ROOM_MAY_IMPORT = {   # the table of the module docstring
    "core": {"programs"},
    "programs": {"core", "comm", "weights"},
    "comm": {"tidal.runtime.distributed"},
    "weights": set(),
    "chai": set(),
    "switching": {"weights", "tidal.runtime.program", "tidal.runtime.programs.layer_group_steps",
                  "tidal.runtime.programs.layer_group_loads"},
    "bagpipe": {"tidal.runtime.distributed", "tidal.runtime.peer_failures"},
}
_MODULE_TEXT = re.compile(rf"{PACKAGE}(\.\w+)+(:[\w.]+)?")


class Import(NamedTuple):
    """One import of a tidal module (or of ``examples``) by a library file."""

    module: str   # dotted name, ``tidal.ir.meta``; ``tidal`` for the package root
    line: int
    names: tuple[str, ...] = ()   # what a ``from module import ...`` takes from it


def library_files() -> list[Path]:
    """Every Python file of the five layers."""
    return [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]


def module_of(path: Path) -> str:
    """The dotted module name of a library file (a package's ``__init__`` names the package)."""
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _path_of(module: str) -> Path | None:
    """The file of a tidal module name, or None when it names none."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if len(parts) > 1 and candidate.is_file():
            return candidate
    return ROOT / "__init__.py" if len(parts) == 1 else None


def is_module(module: str) -> bool:
    return _path_of(module) is not None


def _strings(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Module names held in strings: ``"tidal.a.b"``, ``"tidal.a.b:attr"``, and the constant
    ``tidal.a.`` head of an f-string (the module that prefix names)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_TEXT.fullmatch(node.value):
                name = node.value.partition(":")[0]
                if is_module(name):
                    yield name, node.lineno
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith(f"{PACKAGE}."):
                name = str(head.value).rpartition(".")[0]
                if is_module(name):
                    yield name, node.lineno


def imports(path: Path) -> list[Import]:
    """Every import of a tidal module (or ``examples``) in the file, at any depth, ``from a
    import b`` counting as an import of ``a.b`` where ``b`` is a module."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = tuple(a.name for a in node.names)
            subs = [f"{node.module}.{n}" for n in names if is_module(f"{node.module}.{n}")]
            if len(subs) < len(names):
                out.append(Import(node.module, node.lineno, names))
            out += [Import(s, node.lineno) for s in subs]
    out += [Import(name, line) for name, line in _strings(tree)]
    return [i for i in out if i.module.split(".")[0] in (PACKAGE, "examples")]


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to: ``tidal`` for the package root, ``examples``
    for the zoo, '' for another top-level tidal module (``tidal.hooks``)."""
    parts = module.split(".")
    if parts[0] == "examples":
        return "examples"
    if len(parts) == 1:
        return PACKAGE
    return parts[1] if parts[1] in LAYERS else ""


def wrong_edges() -> list[str]:
    """Imports that go the wrong way between layers."""
    out = []
    for path in library_files():
        layer, rel = path.relative_to(ROOT).parts[0], path.relative_to(ROOT).as_posix()
        for imp in imports(path):
            dst = layer_of(imp.module)
            if dst and dst != layer and dst not in MAY_IMPORT[layer]:
                out.append(f"{rel}:{imp.line} imports {imp.module}")
    return out


def test_imports_go_one_way():
    edges = wrong_edges()
    assert not edges, "imports that go the wrong way:\n" + "\n".join(edges)


def room_of(module: str) -> str:
    """The room of a ``tidal.runtime`` module: ``programs`` or a technique subpackage's name,
    else ``core``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ("programs", *TECHNIQUE_ROOMS) else "core"


def room_edges(path: Path, module: str) -> list[str]:
    """Imports of the file ``path`` (the module ``module`` of ``runtime/``) into other rooms of
    ``runtime/`` that ``ROOM_MAY_IMPORT`` does not allow."""
    room, out = room_of(module), []
    for imp in imports(path):
        if layer_of(imp.module) != "runtime":
            continue
        dst = room_of(imp.module)
        if dst != room and not {dst, imp.module} & ROOM_MAY_IMPORT[room]:
            out.append(f"{path.name}:{imp.line} ({room}) imports {imp.module} ({dst})")
    return out


def wrong_room_edges() -> list[str]:
    """Imports between the rooms of ``runtime/`` that ``ROOM_MAY_IMPORT`` does not allow."""
    return [f"{path.parent.relative_to(ROOT).as_posix()}/{line}"
            for path in sorted((ROOT / "runtime").rglob("*.py"))
            for line in room_edges(path, module_of(path))]


def test_runtime_rooms_import_as_the_table_says():
    assert set(ROOM_MAY_IMPORT) == {"core", "programs", *TECHNIQUE_ROOMS}
    assert {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").is_file()} \
        == {"programs", *CORE_SUBPACKAGES, *TECHNIQUE_ROOMS}, \
        "a new runtime subpackage needs a row in the table"
    edges = wrong_room_edges()
    assert not edges, "imports between runtime rooms the table does not allow:\n" + \
        "\n".join(edges)


def folder_graphs() -> dict[Path, dict[str, dict[str, int]]]:
    """Per folder: module -> {module of the same folder it imports: first line}."""
    graphs: dict[Path, dict[str, dict[str, int]]] = {}
    for path in library_files():
        graph = graphs.setdefault(path.parent, {})
        me = module_of(path)
        edges = graph.setdefault(me, {})
        for imp in imports(path):
            target = _path_of(imp.module)
            if target is not None and target.parent == path.parent and imp.module != me:
                edges.setdefault(imp.module, imp.line)
    return graphs


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_cycles() -> list[str]:
    """Each file-level import cycle inside a folder, with the imports that close it."""
    out = []
    for graph in folder_graphs().values():
        for component in cycles(graph):
            members = set(component)
            lines = [f"{_path_of(a).relative_to(ROOT)}:{line} imports {b}"
                     for a in component for b, line in graph[a].items() if b in members]
            out.append(" <-> ".join(m.rpartition(".")[2] for m in component) + "\n    "
                       + "\n    ".join(lines))
    return out


def test_no_import_cycles_inside_a_folder():
    found = import_cycles()
    assert not found, "file-level import cycles:\n" + "\n".join(found)


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the tidal module it is bound to (``import tidal.x.y as m``, ``from tidal.x
    import y`` where ``y`` is a module)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else PACKAGE
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """Private names of other tidal modules the file imports or reads as attributes."""
    tree = ast.parse(path.read_text(), str(path))
    inside = path.is_relative_to(ROOT)
    me = module_of(path) if inside else ""
    rel = path.relative_to(ROOT).as_posix() if inside else path.name
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == PACKAGE and node.module != me:
            out += [f"{rel}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names if _private(a.name)]
    aliases = _module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            head = _dotted(node.value)
            if head is None or head.split(".")[0] not in aliases:
                continue
            first, _, rest = head.partition(".")
            module = f"{aliases[first]}.{rest}" if rest else aliases[first]
            if is_module(module) and module != me:
                out.append(f"{rel}:{node.lineno} reads {module}.{node.attr}")
    return out


def test_no_private_names_across_modules():
    found = [line for path in library_files() for line in private_imports(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_relative_imports_are_not_used():
    # the walk reads absolute imports only; a relative one would slip past it
    rel = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in library_files()
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not rel, rel


def _scan(source: str, tmp_path: Path, name: str = "probe.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


@pytest.mark.parametrize("source, module", [
    ("import tidal\n", "tidal"),
    ("from tidal import compile\n", "tidal"),
    ("from tidal import ir\n", "tidal.ir"),
    ("def f():\n    from tidal.ir import meta\n", "tidal.ir.meta"),
    ("import importlib\nimportlib.import_module('tidal.compiler.api')\n", "tidal.compiler.api"),
    ("__import__('tidal.sim.engine')\n", "tidal.sim.engine"),
    ("TABLE = ('tidal.passes.tick_tock:TickTock',)\n", "tidal.passes.tick_tock"),
    ("def f(n):\n    return f'tidal.passes.{n}'\n", "tidal.passes"),
])
def test_the_walk_sees_every_way_to_import(source, module, tmp_path):
    assert module in {i.module for i in imports(_scan(source, tmp_path))}
    assert layer_of("tidal") == PACKAGE and PACKAGE not in MAY_IMPORT["sim"]


def test_the_walk_ignores_what_is_not_an_import(tmp_path):
    source = '"""Example:\n    >>> import tidal\n"""\nKEY = "tidal.layer"\nX = "tidal.ir.meta is it"\n'
    assert imports(_scan(source, tmp_path)) == []


def test_the_checks_see_cycles_and_private_names(tmp_path):
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    source = ("from tidal.ir.meta import _LAYER\nfrom tidal.ir import capture\n"
              "import tidal.ir.cost as cost\nx = capture._as_inputs\ny = cost._rebatch\n"
              "z = capture.__name__\n")
    found = private_imports(_scan(source, tmp_path))
    assert [f.split(" ", 1)[1] for f in found] == [
        "imports tidal.ir.meta._LAYER", "reads tidal.ir.capture._as_inputs",
        "reads tidal.ir.cost._rebatch"]


def test_the_room_check_sees_a_room_importing_another(tmp_path):
    probe = _scan("from tidal.runtime.switching import task\nimport tidal.runtime.distributed\n"
                  "from tidal.runtime.weights.store import WeightStore\n", tmp_path)
    assert room_edges(probe, "tidal.runtime.comm.probe") == [
        "probe.py:1 (comm) imports tidal.runtime.switching.task (switching)",
        "probe.py:3 (comm) imports tidal.runtime.weights.store (weights)"]
    assert room_edges(probe, "tidal.runtime.switching.probe") == [
        "probe.py:2 (switching) imports tidal.runtime.distributed (core)"]  # its program only
    assert len(room_edges(probe, "tidal.runtime.scheduling.probe")) == 2  # the core


def test_the_zoo_has_one_import_name():
    import importlib

    assert hasattr(importlib.import_module("examples.models"), "ZOO")
    with pytest.raises(ImportError, match="examples.models"):
        importlib.import_module("tidal.examples.models")


BUILDER_LINES, FUNCTION_LINES = 400, 80
"""Issue 33's sizes: no builder module (``runtime/programs/``) over 400 lines, no function of
the library over 80 (docstring included)."""


def test_builders_and_functions_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "runtime" / "programs")
                                                              .glob("*.py"))
           if (n := len(p.read_text().splitlines())) > BUILDER_LINES]
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
            for p in library_files() for f in ast.walk(ast.parse(p.read_text()))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > FUNCTION_LINES]
    assert not big and not long, "\n".join(big + long)
