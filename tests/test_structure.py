"""docs/design.md's structural rules, checked on the sources as they stand:
no module over 500 lines, ``driver/`` never importing ``budget/``, the
layers above the driver never naming an adaptor, no module reading
another package's private names, no import circle between the rooms or
among ``bench/``'s modules, and the vLLM integration's floors (its sides
never importing each other, the floor below them importing no side, one
seam out of the package). What breaks a rule today is
listed with its size; the lists may only shrink (each entry names what is
left to do), and nothing new may join them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "extensible_kv"
MAX_LINES = 500
#: Modules exempt from MAX_LINES: the command line and the benchmarks.
EXEMPT = ("cli.py", "bench/")
#: Modules over MAX_LINES, each with the most lines it may keep until split.
LONG_MODULES: dict[str, int] = {}
#: What the layers above the driver may not name: adaptors are invisible there.
ADAPTOR_WORDS = re.compile(r"PoolingDriver|BudgetDriver|prepaid|drain")
#: Lines naming an adaptor in those layers, per module, until they go through
#: the driver protocol.
ADAPTOR_MENTIONS: dict[str, int] = {}


def modules() -> dict[str, str]:
    return {
        path.relative_to(SRC).as_posix(): path.read_text() for path in sorted(SRC.rglob("*.py"))
    }


def test_no_module_is_over_500_lines_but_those_listed_and_none_grows() -> None:
    for name, text in modules().items():
        lines = len(text.splitlines())
        if name.startswith(EXEMPT) or lines <= MAX_LINES:
            assert name not in LONG_MODULES, f"{name} has {lines} lines: drop it from LONG_MODULES"
            continue
        allowed = LONG_MODULES.get(name)
        assert allowed is not None, f"{name} has {lines} lines, over {MAX_LINES}: split it by idea"
        assert lines <= allowed, f"{name} grew to {lines} lines (at most {allowed} until split)"


def test_the_driver_package_never_imports_the_budget() -> None:
    importing = {
        name
        for name, text in modules().items()
        if name.startswith("driver/") and re.search(r"extensible_kv\.budget|from \.\.budget", text)
    }
    assert importing == set()


def test_the_buffer_tensor_and_kv_layers_name_adaptors_only_where_listed() -> None:
    found = {
        name: sum(1 for line in text.splitlines() if ADAPTOR_WORDS.search(line))
        for name, text in modules().items()
        if name.startswith(("buffer/", "tensor/", "kv/"))
    }
    assert {name: count for name, count in found.items() if count} == ADAPTOR_MENTIONS


def _package(name: str) -> str:
    return name.split("/")[0]


def _private_names_by_package() -> dict[str, set[str]]:
    """Each private name (``_x``, not dunder) a class defines, as a method or
    as an attribute set on ``self``, with the packages defining it."""
    defined: dict[str, set[str]] = {}
    for name, text in modules().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and _is_private(node.name):
                defined.setdefault(node.name, set()).add(_package(name))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and _is_private(node.attr)
            ):
                defined.setdefault(node.attr, set()).add(_package(name))
    return defined


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reads_the_private_names_of_another_package() -> None:
    """A package's modules share its internals (a buffer's chunks, a
    tensor's committed size); across packages only public names are used."""
    defined = _private_names_by_package()
    found = []
    for name, text in modules().items():
        tree = ast.parse(text)
        imported = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"self", "cls", *imported}:
                continue
            owners = defined.get(node.attr, set())
            if owners and _package(name) not in owners:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def _room(name: str) -> str:
    """The room a module is in: its top-level package or module
    (``__init__`` for the package root)."""
    return name.split("/")[0].removesuffix(".py")


def _imported_rooms(text: str, rooms: set[str]) -> list[tuple[str, int]]:
    """The rooms a module's source imports, with the line: every import,
    also inside functions and under ``TYPE_CHECKING``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module]
            if node.module == "extensible_kv":
                targets = [f"extensible_kv.{a.name}" for a in node.names if a.name in rooms]
                targets += ["extensible_kv.__init__"] * (len(targets) < len(node.names))
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "extensible_kv":
                found.append((parts[1] if len(parts) > 1 else "__init__", node.lineno))
    return found


def room_imports() -> dict[str, dict[str, list[str]]]:
    """Per room, the other rooms it imports, with where."""
    sources = modules()
    rooms = {_room(name) for name in sources}
    edges: dict[str, dict[str, list[str]]] = {}
    for name, text in sources.items():
        for other, line in _imported_rooms(text, rooms):
            if other != _room(name):
                edges.setdefault(_room(name), {}).setdefault(other, []).append(f"{name}:{line}")
    return edges


def test_no_import_runs_back_up_between_rooms() -> None:
    """docs/design.md: imports point downward only. The rooms (top-level
    modules and packages) form no circle, counting imports inside functions
    and type-only ones: every circle left is inside one package."""
    edges = room_imports()
    circles = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], {start}
        while stack:
            room, path = stack.pop()
            for other in edges.get(room, {}):
                if other == start:
                    circles.append(" -> ".join([*path, start]) + f" ({edges[room][other][0]})")
                elif other not in seen:
                    seen.add(other)
                    stack.append((other, [*path, other]))
    assert circles == []


#: The vLLM integration (``integrations/vllm/``): one side per process, over
#: a floor every side reads, whose ``seam.py`` alone imports the library.
VLLM = "integrations/vllm/"
VLLM_PACKAGE = "extensible_kv.integrations.vllm"
VLLM_SIDES = {"worker/": "worker", "scheduler/": "scheduler", "endpoints.py": "endpoints"}
VLLM_SEAM = "integrations/vllm/seam.py"


def _imports(name: str, text: str) -> set[str]:
    """The dotted modules (and names) module ``name`` imports anywhere in
    it (in functions and under ``TYPE_CHECKING`` too), relative imports
    resolved; ``from a import b`` counts ``a`` and ``a.b``, and so does
    ``importlib.import_module("a.b")`` given a string."""
    package = f"extensible_kv.{name[: -len('.py')].replace('/', '.')}".rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def _vllm_part(dotted: str) -> str | None:
    """Where an imported name lies in the vLLM package: a side's name, "floor"
    for a module of the floor, "re-export" for a name its ``__init__`` hands
    out (a side's, imported past the side); None outside the package."""
    if not dotted.startswith(f"{VLLM_PACKAGE}."):
        return None
    first = dotted[len(VLLM_PACKAGE) + 1 :].split(".")[0]
    for where, side in VLLM_SIDES.items():
        if first == where.removesuffix("/").removesuffix(".py"):
            return side
    return "floor" if (SRC / VLLM / f"{first}.py").exists() else "re-export"


def _vllm_modules() -> dict[str, tuple[str, set[str]]]:
    """Each module of the vLLM package: its part (a side, or "floor"; the
    package's ``__init__``, which names both sides, is left out) and what it
    imports."""
    found = {}
    for name, text in modules().items():
        if not name.startswith(VLLM) or name == f"{VLLM}__init__.py":
            continue
        inside = name[len(VLLM) :]
        part = next((s for w, s in VLLM_SIDES.items() if inside.startswith(w)), "floor")
        found[name] = (part, _imports(name, text))
    return found


def test_the_vllm_sides_never_import_each_other() -> None:
    """The worker (``worker/``), the scheduler (``scheduler/``) and the HTTP
    routes (``endpoints.py``) run in different processes: none imports
    another, nor the package's re-exports of them."""
    found = _vllm_modules()
    assert {part for part, _ in found.values()} == {"floor", *VLLM_SIDES.values()}
    crossing = sorted(
        f"{name} imports {target}"
        for name, (part, imported) in found.items()
        if part != "floor"
        for target in imported
        if _vllm_part(target) not in (None, "floor", part)
    )
    assert crossing == []


def test_the_vllm_floor_imports_no_side() -> None:
    """The modules below the sides (options, support, client, seam) import
    none of them: what both sides read never depends on either."""
    found = _vllm_modules()
    climbing = sorted(
        f"{name} imports {target}"
        for name, (part, imported) in found.items()
        if part == "floor"
        for target in imported
        if _vllm_part(target) not in (None, "floor")
    )
    assert climbing == []


def test_only_the_seam_leaves_the_vllm_package() -> None:
    """Within ``integrations/vllm/`` only ``seam.py`` imports the rest of
    extensible-kv (kv, budget, devices, driver, tensor, buffer, intervals,
    the package root's helpers); every other module takes it from there."""
    found = _vllm_modules()
    assert VLLM_SEAM in found
    leaving = sorted(
        f"{name} imports {target}"
        for name, (_, imported) in found.items()
        if name != VLLM_SEAM
        for target in imported
        if (target == "extensible_kv" or target.startswith("extensible_kv."))
        and not target.startswith(f"{VLLM_PACKAGE}.")
        and target != VLLM_PACKAGE
    )
    assert leaving == []


def _bench_imports() -> dict[str, set[str]]:
    """Each ``bench/`` module (``__init__`` for the package) with the
    ``bench/`` modules it imports, wherever the import sits: at the top, in
    a function or under ``TYPE_CHECKING``. ``from extensible_kv.bench import
    x`` imports the module ``x`` where there is one, else the package."""
    package = "extensible_kv.bench"
    names = {path.stem for path in (SRC / "bench").glob("*.py")}
    # Dotted name -> module; the package is its ``__init__``.
    modules = {f"{package}.{name}": name for name in names} | {package: "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        targets: set[str] = set()
        for node in ast.walk(ast.parse((SRC / "bench" / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0]
                    base = f"{up}.{base}" if base else up
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                )
        graph[name] = {modules[t] for t in targets if t in modules} - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each module from which an import path leads back to itself, with
    that path."""
    found = []
    for start in sorted(graph):
        paths = [[start, target] for target in sorted(graph[start])]
        seen: set[str] = set()
        while paths:
            path = paths.pop()
            if path[-1] == start:
                found.append(path)
                break
            if path[-1] in seen:
                continue
            seen.add(path[-1])
            paths += [[*path, target] for target in sorted(graph.get(path[-1], ()))]
    return found


def test_no_import_circle_among_the_bench_modules() -> None:
    """What every engine case shares sits below the cases (``bench/child.py``),
    and only the suite that runs them imports the cases: no bench module
    imports, even inside a function, one that imports it back."""
    graph = _bench_imports()
    # The scan sees the suite's imports of its cases (a rule that reads no
    # import would pass on anything).
    assert graph["engine"] >= {"child", "decode", "elastic", "lifecycle", "several"}
    circles = [" -> ".join(path) for path in _circles(graph)]
    assert not circles, "import circles in bench/: " + "; ".join(circles)
