"""An engine restarted with its prefix cache in place (option
``keep_prefix_cache_s``): an ``LLM`` program serves prefix-heavy prompts
and ends as a script ends; its KV pages outlive it in a keeper process;
the same program started again adopts them, and its first requests are
served from the prefix cache with stock vLLM's tokens; another model or
block size adopts nothing and the pages go back; under a limit each page
is counted once; a killed keeper leaves nothing held. Real programs, a
real keeper. Runs in ``nox -s vllm``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from extensible_kv.bench.child import prompt
from extensible_kv.budget import Ledger
from extensible_kv.budget.snapshot import snapshot
from extensible_kv.demo.tiny_models import save_tiny_model
from extensible_kv.kept import drop, kept_caches
from vllm_program import Program
from vllm_server import SCHEDULER, WORKER, Server

PROMPTS = [prompt(2000 + i, 300) for i in range(4)]
NEW_TOKENS = 16
MiB = 1 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("restart") / "llama"
    return str(save_tiny_model("llama", folder, num_kv_heads=16))


@pytest.fixture(scope="module")
def stock(model: str) -> tuple[list[list[int]], list[int]]:
    """Stock vLLM's tokens for :data:`PROMPTS`, and its prefix-cache hits
    (tokens) when it serves them again, warm."""
    program = Program({"model": model, "multiprocessing": True, "stock": True}, {})
    try:
        tokens = program.generate(PROMPTS, NEW_TOKENS)
        _, warm = program.generate_counting(PROMPTS, NEW_TOKENS)
    finally:
        program.stop()
    assert sum(warm) > 0
    return tokens, warm


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A state folder of the test's own, for this process and the programs
    (their environment); the kept pages left in it dropped after."""
    monkeypatch.setenv("EXTENSIBLE_KV_STATE_DIR", str(tmp_path))
    yield {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    for record in kept_caches():
        drop(record.keeper_pid)


def kept_program(model: str, block_size: int = 32, tp: int = 1) -> dict[str, object]:
    config = {"extensible_kv": {"growth": "elastic", "keep_prefix_cache_s": 120}}
    return {
        "model": model,
        "multiprocessing": True,
        "additional_config": config,
        "block_size": block_size,
        "tp": tp,
    }


def served_and_closed(settings: dict[str, object], env: dict[str, str]) -> list[list[int]]:
    """A program of ``settings`` serves :data:`PROMPTS` and ends as a script
    ends; its tokens."""
    program = Program(settings, env)
    try:
        tokens = program.generate(PROMPTS, NEW_TOKENS)
        assert program.close() == 0
    finally:
        program.stop()
    return tokens


def set_limit(state: dict[str, str], nbytes: int) -> None:
    """``extensible-kv limit cpu`` in the programs' state folder."""
    limit = subprocess.run(
        [str(Path(sys.executable).parent / "extensible-kv"), "limit", "cpu", f"{nbytes}B"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **state},
    )
    assert limit.returncode == 0, limit.stderr


def served_counting(
    settings: dict[str, object], env: dict[str, str]
) -> tuple[list[list[int]], list[int]]:
    """A program of ``settings`` serves :data:`PROMPTS` as its first
    requests, and is stopped: their tokens and prefix-cache hits (tokens)."""
    program = Program(settings, env)
    try:
        return program.generate_counting(PROMPTS, NEW_TOKENS)
    finally:
        program.stop()


def claimed(state_dir: str) -> dict[int, int]:
    """Bytes each process claims on the device, by pid."""
    return {
        p["pid"]: p["claimed_bytes"]
        for d in snapshot(Path(state_dir))["devices"]
        for p in d["processes"]
        if p["claimed_bytes"]
    }


def until(done: Callable[[], object], what: str, seconds: float = 20) -> None:
    """Wait for ``done()`` to be true, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_restarted_program_serves_its_first_requests_from_the_kept_prefix_cache(
    model: str, stock: tuple[list[list[int]], list[int]], state: dict[str, str], tp: int
) -> None:
    """With ``tp`` tensor-parallel ranks, each keeping its own pages (the
    stock reference runs on one: these fp32 models give the same tokens)."""
    tokens, warm = stock
    assert served_and_closed(kept_program(model, tp=tp), state) == tokens
    kept = kept_caches()
    assert sorted(record.fingerprint["rank"] for record in kept) == list(range(tp))
    assert all(record.blocks == kept[0].blocks for record in kept), "every rank named alike"
    assert kept[0].blocks, "the scheduler named the pages"
    again, hits = served_counting(kept_program(model, tp=tp), state)
    assert again == tokens
    assert sum(hits) >= 0.9 * sum(warm), (hits, warm)
    until(lambda: not kept_caches(), "every rank adopted its pages and its keeper went")


def kept_server(model: str, state: dict[str, str], shutdown_timeout: int = 10) -> Server:
    """An OpenAI server with :func:`kept_program`'s options (not waited for)."""
    config = {"extensible_kv": {"growth": "elastic", "keep_prefix_cache_s": 120}}
    flags = ["--worker-cls", WORKER, "--scheduler-cls", SCHEDULER]
    flags += ["--additional-config", json.dumps(config), "--enable-prompt-tokens-details"]
    return Server(model, [*flags, "--shutdown-timeout", str(shutdown_timeout)], state)


def test_a_server_that_would_kill_its_engine_at_its_stop_is_refused(
    model: str, state: dict[str, str]
) -> None:
    """vLLM's server with ``--shutdown-timeout 0``, its default, kills its
    engine at once at its stop: nothing could be kept, and it says so."""
    server = kept_server(model, state, shutdown_timeout=0)
    try:
        assert server.wait_exit(300) != 0
        message = "kills its engine at once when it stops, and nothing would be kept; start it"
        assert message in server.stderr(), server.stderr()[-4000:]
    finally:
        server.stop()


@pytest.mark.parametrize(
    "stop",
    ["SIGTERM to the server", "SIGTERM to its process group", "SIGINT to its process group"],
)
def test_a_restarted_server_serves_its_first_requests_from_the_kept_prefix_cache(
    model: str, stock: tuple[list[list[int]], list[int]], state: dict[str, str], stop: str
) -> None:
    """An OpenAI server stopped as a container's stop or ``kill`` stops it
    (SIGTERM to the server alone), as systemd's default stop does (SIGTERM
    to every process at once) or as Ctrl-C in a terminal does (SIGINT to
    every process of the group, workers included), keeps its prefix cache;
    started again, its first requests hit it, with stock's tokens. (With
    a signal to the group, the server's own SIGTERM to its engine kills
    it before its scheduler names the pages: the keepers take the names
    the scheduler wrote as its loop stopped.)"""
    tokens, warm = stock
    server = kept_server(model, state).wait_healthy()
    try:
        assert server.complete(PROMPTS, NEW_TOKENS) == tokens
        sent = signal.SIGINT if stop.startswith("SIGINT") else signal.SIGTERM
        (os.killpg if stop.endswith("group") else os.kill)(server.process.pid, sent)
        assert server.wait_exit(60) == 0, server.stderr()[-4000:]
    finally:
        server.stop()
    until(lambda: any(record.blocks for record in kept_caches()), "no pages kept and named")
    server = kept_server(model, state).wait_healthy()
    try:
        # One prompt a request: a completion's usage counts its last prompt's hits.
        answers = [server.completion([prompt], NEW_TOKENS) for prompt in PROMPTS]
    finally:
        server.stop()
    assert [a["choices"][0]["token_ids"] for a in answers] == tokens
    hits = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert sum(hits) >= 0.9 * sum(warm), (hits, warm)


@pytest.mark.parametrize("other", ["block size", "model"])
def test_a_restart_with_another_fingerprint_adopts_nothing_and_gives_the_pages_back(
    model: str,
    stock: tuple[list[list[int]], list[int]],
    state: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    other: str,
) -> None:
    """The same model with another block size can never adopt the pages,
    and gives them back at once. An engine of another model adopts nothing
    and leaves them be (they may be another engine's, to restart) until a
    process wants the memory they hold: here a claim under a limit the
    pages fill."""
    tokens, _ = stock
    assert served_and_closed(kept_program(model), state) == tokens
    (kept,) = kept_caches()
    if other == "block size":
        settings, expected = kept_program(model, block_size=64), tokens  # the same tokens
    else:
        folder = tmp_path_factory.mktemp("other") / "qwen3"
        qwen = str(save_tiny_model("qwen3", folder, num_kv_heads=16))
        reference = Program({"model": qwen, "multiprocessing": True, "stock": True}, {})
        try:
            expected = reference.generate(PROMPTS, NEW_TOKENS)
        finally:
            reference.stop()
        settings = kept_program(qwen)
    program = Program(settings, state)
    try:
        again, hits = program.generate_counting(PROMPTS, NEW_TOKENS)
        if other == "block size":
            assert kept_caches() == []
        else:
            assert kept_caches() == [kept]
    finally:
        program.stop()
    assert again == expected
    assert hits == [0] * len(PROMPTS)
    if other == "model":
        want_what_the_pages_hold(state, kept.nbytes)
        until(lambda: not kept_caches(), "the keeper gave way but kept its record")


def want_what_the_pages_hold(state: dict[str, str], nbytes: int) -> None:
    """Under a limit of the kept pages' ``nbytes``, claim as much from this
    process, waiting for room (a want): granted once the keeper gave way
    (a process that ended, the engine's, holds nothing)."""
    (device,) = snapshot(Path(state["EXTENSIBLE_KV_STATE_DIR"]))["devices"]
    ledger = Ledger(Path(state["EXTENSIBLE_KV_STATE_DIR"]), device["device"])
    try:
        ledger.set_limit(nbytes)
        ledger.claim(nbytes, timeout_s=20)
        ledger.give_back(nbytes)
    finally:
        ledger.close()


def test_under_a_limit_each_kept_page_counts_once_and_a_killed_keeper_leaves_nothing(
    model: str, stock: tuple[list[list[int]], list[int]], state: dict[str, str]
) -> None:
    """The keeper's claim is the pages' bytes; the engine that adopts them
    claims them instead, never both at once in the ledger's total; the
    keeper of the next stop, killed, leaves no claim and no record, and the
    engine started after adopts nothing."""
    tokens, _ = stock
    set_limit(state, 96 * MiB)
    state_dir = state["EXTENSIBLE_KV_STATE_DIR"]
    assert served_and_closed(kept_program(model), state) == tokens
    (kept,) = kept_caches()
    assert claimed(state_dir) == {kept.keeper_pid: kept.nbytes}
    second = Program(kept_program(model), state)
    try:
        until(lambda: not kept_caches(), "the keeper outlived the adoption")
        family = second.family()
        held = second.ask({"op": "state"})["state"]["physical_bytes"]
        claims = claimed(state_dir)
        assert set(claims) <= set(family), (claims, family)
        assert sum(claims.values()) == held >= kept.nbytes  # the adopted pages, once
        again, hits = second.generate_counting(PROMPTS, NEW_TOKENS)
        assert second.close() == 0
    finally:
        second.stop()
    assert again == tokens
    assert sum(hits) > 0
    (left,) = kept_caches()
    os.kill(left.keeper_pid, signal.SIGKILL)
    until(lambda: not kept_caches(), "a killed keeper's record stayed")
    until(lambda: not claimed(state_dir), "a killed keeper's claim stayed")
    last, hits = served_counting(kept_program(model), state)
    assert last == tokens
    assert hits == [0] * len(PROMPTS)


def test_the_restart_benchmark_runs_side_by_side(tmp_path: Path) -> None:
    """``bench_vllm.py --only restart``, one round: stock cold and warm, ours
    restarted, the offloading connector tried; its JSON and table."""
    from extensible_kv.bench.restart import DOCUMENT_TOKENS, DOCUMENTS

    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vllm.py"
    out = tmp_path / "restart.json"
    result = subprocess.run(
        [sys.executable, str(bench), "--only", "restart", "--rounds", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    saved = json.loads(out.read_text())["restart"]
    (stock,), (ours,) = saved["runs"]["stock"], saved["runs"]["ours"]
    every_document = DOCUMENTS * DOCUMENT_TOKENS
    # Stock's first requests miss, its second ones hit every document;
    # ours hit them from the first request after the restart.
    assert (stock["first_hits"], stock["warm_hits"]) == (0, every_document)
    assert (ours["first_hits"], ours["warm_hits"]) == (every_document, every_document)
    assert len(ours["first_ttft_s"]) == len(stock["warm_ttft_s"]) == DOCUMENTS
    ratio = saved["ratios"]["ours after a restart / stock warm"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert "only supported on CUDA" in saved["connector"]["refused"]  # vLLM 0.32's CPU build
    assert "| ours after a restart / stock warm |" in result.stdout
