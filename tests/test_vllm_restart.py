"""An engine restarted with its prefix cache in place (option
``keep_prefix_cache_s``): an ``LLM`` program serves prefix-heavy prompts
and ends as a script ends; its KV pages outlive it in a keeper process;
the same program started again adopts them, and its first requests are
served from the prefix cache with stock vLLM's tokens. Real programs, a
real keeper. Runs in ``nox -s vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from extensible_kv.bench.child import prompt
from extensible_kv.demo.tiny_models import save_tiny_model
from extensible_kv.kept import drop, kept_caches
from vllm_program import Program

PROMPTS = [prompt(2000 + i, 300) for i in range(4)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("restart") / "llama"
    return str(save_tiny_model("llama", folder, num_kv_heads=16))


def kept_program(model: str, block_size: int = 32) -> dict[str, object]:
    config = {"extensible_kv": {"growth": "elastic", "keep_prefix_cache_s": 120}}
    return {
        "model": model,
        "multiprocessing": True,
        "additional_config": config,
        "block_size": block_size,
    }


def test_a_restarted_program_serves_its_first_requests_from_the_kept_prefix_cache(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    env = {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    stock = Program({"model": model, "multiprocessing": True, "stock": True}, env)
    try:
        tokens = stock.generate(PROMPTS, NEW_TOKENS)
        _, warm = stock.generate_counting(PROMPTS, NEW_TOKENS)
    finally:
        stock.stop()
    assert sum(warm) > 0
    first = Program(kept_program(model), env)
    try:
        assert first.generate(PROMPTS, NEW_TOKENS) == tokens
        assert first.close() == 0
        (kept,) = kept_caches()
        assert kept.blocks, "the scheduler named the pages"
        second = Program(kept_program(model), env)
        try:
            again, hits = second.generate_counting(PROMPTS, NEW_TOKENS)
        finally:
            second.stop()
    finally:
        first.stop()
        for record in kept_caches():
            drop(record.keeper_pid)
    assert again == tokens
    assert sum(hits) >= 0.9 * sum(warm), (hits, warm)


def test_a_restart_with_another_block_size_adopts_nothing_and_gives_the_pages_back(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    env = {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    first = Program(kept_program(model), env)
    try:
        tokens = first.generate(PROMPTS, NEW_TOKENS)
        assert first.close() == 0
        (kept,) = kept_caches()
        other = Program(kept_program(model, block_size=64), env)
        try:
            again, hits = other.generate_counting(PROMPTS, NEW_TOKENS)
            assert kept.keeper_pid not in {r.keeper_pid for r in kept_caches()}
        finally:
            other.stop()
    finally:
        first.stop()
        for record in kept_caches():
            drop(record.keeper_pid)
    assert again == tokens  # block size changes no token
    assert hits == [0] * len(PROMPTS)
