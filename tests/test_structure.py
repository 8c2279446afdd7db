"""docs/design.md's structural rules, checked on the sources as they stand:
no module over 500 lines, ``driver/`` never importing ``budget/``, and the
layers above the driver never naming an adaptor. What breaks a rule today is
listed with its size; the lists may only shrink (each entry names what is
left to do), and nothing new may join them."""

from __future__ import annotations

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
        if name == "tensor.py" or name.startswith(("buffer/", "tensor/", "kv/"))
    }
    assert {name: count for name, count in found.items() if count} == ADAPTOR_MENTIONS
