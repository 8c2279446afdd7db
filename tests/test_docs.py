"""The README as a newcomer reads it: its snippet runs as written, it says
each thing once, every file it names exists, its commands run every test
they should, its numbers are the docs'."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_first_snippet_runs_as_written() -> None:
    snippet = re.search(r"```python\n(.*?)```", README, re.S)
    assert snippet is not None
    exec(compile(snippet.group(1), "README.md", "exec"), {})


def test_each_section_appears_once() -> None:
    for text in (README, *(path.read_text() for path in DOCS)):
        headings = re.findall(r"^#{1,3} .+$", text, re.M)
        assert len(headings) == len(set(headings)), [h for h in headings if headings.count(h) > 1]


def test_every_file_named_exists() -> None:
    named = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|examples|scripts|tests|src)/[\w./-]+)")
    for path, text in [(ROOT / "README.md", README), *((p, p.read_text()) for p in DOCS)]:
        for name in named.findall(text):
            name = name.rstrip(".)")
            assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"


def test_the_engine_users_command_runs_every_engine_test() -> None:
    """``nox -s vllm`` (the README's command for engine users) names its
    modules one by one: a new test module that needs vLLM must join the
    list (the benchmark's end-to-end test runs in CI, beside it)."""
    noxfile = (ROOT / "noxfile.py").read_text()
    needs_vllm = re.compile(r'^pytest\.importorskip\("vllm"\)', re.M)
    engine_tests = sorted(
        p.name for p in (ROOT / "tests").glob("test_*.py") if needs_vllm.search(p.read_text())
    )
    assert "test_vllm_engine.py" in engine_tests
    missing = [
        t for t in engine_tests if f'"tests/{t}"' not in noxfile and t != "test_vllm_bench.py"
    ]
    assert not missing, f"nox -s vllm does not run {missing}"


def test_the_readme_numbers_are_the_docs_numbers() -> None:
    spec = importlib.util.spec_from_file_location("sync_readme", ROOT / "scripts/sync_readme.py")
    assert spec is not None
    assert spec.loader is not None
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    source = (ROOT / "docs" / "performance.md").read_text()
    assert set(sync.blocks(README)) == {"host-numbers", "feature-numbers"}
    assert sync.synced(source, README) == README, "run python3 scripts/sync_readme.py"


def test_the_integration_guide_runs_as_written() -> None:
    """docs/integration.md's blocks are one program, run in order."""
    guide = (ROOT / "docs" / "integration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guide shows no call that warns
        exec(compile("\n".join(blocks), "docs/integration.md", "exec"), namespace)
