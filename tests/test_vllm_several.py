"""Several vLLM engines serving at once on one device, under one limit:
memory flows to the engine with the load (docs/budget.md, "Several engines
on one device").

Two OpenAI servers with ``growth: "elastic"`` share a state directory, so
one device budget: A with our endpoint plug-in switched on
(``VLLM_PLUGINS=extensible_kv``), B without it, as a server is started by
default, so that B gives way as an idle engine of ours does however it is
run (its scheduler wakes its own idle loop); a stock server answers the
same requests first, and every answer must carry its tokens. B is then
killed as it gives way, and its turns go to ``LLM`` programs: on one rank,
on two tensor-parallel ranks, and stepped in the program's own process;
last, a program sleeps keeping its prefix cache while A serves. A
thread reads the ledger every 20 ms for the whole module: the engines'
claims together never pass the limit. Runs in ``nox -s vllm``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import psutil  # vLLM's dependency

from extensible_kv.bench.child import prompt
from extensible_kv.budget import STALLED_S, Ledger, snapshot
from extensible_kv.demo.tiny_models import save_tiny_model
from extensible_kv.integrations.vllm.scheduler.pressure import STALL_EVERY_S
from extensible_kv.integrations.vllm.scheduler.scheduler import LINGER_S
from vllm_program import Program
from vllm_server import SCHEDULER, WORKER, MiB, Server

#: 16 KV heads: a block of 32 tokens is 256 KiB over the 2 layers, a unit
#: (16 blocks) 4 MiB.
LIMIT = 64 * MiB
#: B's floor: three units kept for it whatever A wants.
FLOOR = 12 * MiB
#: A unit of blocks (16 blocks of 32 tokens), and what an idle engine keeps
#: of its memory whatever the others want: its unit 0.
UNIT = 4 * MiB
PROMPTS = {
    # B's burst leaves its prefix cache full (16 MiB, the default eighth).
    "b_burst": [prompt(i, 300) for i in range(8)],
    # A's burst needs about 56 MiB: more than the limit less what B holds idle.
    "a_burst": [prompt(100 + i, 400) for i in range(16)],
    "b_after": [prompt(200 + i, 200) for i in range(2)],
    "a_alone": [prompt(300 + i, 400) for i in range(16)],
    # The same turns with B as an LLM in a Python program.
    "p_burst": [prompt(500 + i, 300) for i in range(8)],
    "a_program": [prompt(600 + i, 400) for i in range(16)],
    "p_after": [prompt(700 + i, 200) for i in range(2)],
    # And as a program on two tensor-parallel ranks.
    "t_burst": [prompt(800 + i, 300) for i in range(8)],
    "a_tp": [prompt(1100 + i, 400) for i in range(16)],
    "t_after": [prompt(1000 + i, 200) for i in range(2)],
    # One request of more than a unit, with all of A's memory but unit 0 taken.
    "a_stall": [prompt(1200, 480)],
    # A program's prefix cache kept over its sleep while A serves.
    "k_first": [prompt(1300 + i, 300) for i in range(4)],
    "k_burst": [prompt(1400 + i, 400) for i in range(8)],
}
NEW_TOKENS = {
    **{"b_burst": 16, "a_burst": 32, "b_after": 8, "a_alone": 32},
    **{"p_burst": 16, "a_program": 32, "p_after": 8},
    **{"t_burst": 16, "a_tp": 32, "t_after": 8, "a_stall": 32},
    **{"k_first": 16, "k_burst": 32},
}
#: Seconds a want may take to be met, here on 2 loaded cores (the benchmark
#: measures it; docs/performance.md).
WANT_MET_S = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("several") / "llama"
    return str(save_tiny_model("llama", folder, num_kv_heads=16))


def elastic_flags(**options: int) -> list[str]:
    config = {"extensible_kv": {"growth": "elastic", **options}}
    return [
        "--worker-cls",
        WORKER,
        "--scheduler-cls",
        SCHEDULER,
        "--additional-config",
        json.dumps(config),
    ]


class Watch:
    """Every engine's claim and the device's total, read every 20 ms."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.highest_total = 0
        self._stop = threading.Event()
        self._ledger: Ledger | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, device: str) -> None:
        self._ledger = Ledger(self.state, device)
        self._thread.start()

    def _run(self) -> None:
        assert self._ledger is not None
        while not self._stop.wait(0.02):
            claims = {key.pid: value for key, value in self._ledger.read().claims.items()}
            self.highest_total = max(self.highest_total, sum(claims.values()))
            self.samples.append((time.monotonic(), claims))

    def claims(self, pid: int, since: float) -> list[int]:
        return [claims.get(pid, 0) for at, claims in self.samples if at >= since]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._ledger is not None:
            self._ledger.close()


@pytest.fixture(scope="module")
def engines(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Stock's tokens for every prompt, then our two servers under the limit."""
    state = tmp_path_factory.mktemp("state")
    env = {"EXTENSIBLE_KV_STATE_DIR": str(state)}
    stock = Server(model, [])
    a = Server(model, elastic_flags(), {**env, "VLLM_PLUGINS": "extensible_kv"})
    b = Server(model, elastic_flags(floor_bytes=FLOOR), env)  # no plug-in
    watch = Watch(state)
    try:
        with stock.wait_healthy():
            tokens = {name: stock.complete(p, NEW_TOKENS[name]) for name, p in PROMPTS.items()}
        a.wait_healthy()
        b.wait_healthy()
        (device,) = snapshot(state)["devices"]
        ledger = Ledger(state, device["device"])
        ledger.set_limit(LIMIT)
        ledger.close()
        watch.start(device["device"])
        yield {
            "a": a,
            "b": b,
            "stock": tokens,
            "state": state,
            "device": device["device"],
            "watch": watch,
            "pid": {"a": worker_pid(a, state), "b": worker_pid(b, state)},
        }
    finally:
        watch.stop()
        for server in (a, b):
            server.stop()
        stock.stop()
    assert watch.highest_total <= LIMIT


def worker_pid(server: Server, state: Path) -> int:
    """The server's process that claims on the device (its engine core)."""
    return claimer(server.children(), state)


def claimer(family: list[int], state: Path) -> int:
    """The one process of ``family`` that claims on the device."""
    (pid,) = claimers(family, state)
    return pid


def claimers(family: list[int], state: Path) -> list[int]:
    """The processes of ``family`` that claim on the device (its ranks)."""
    return [
        p["pid"]
        for d in snapshot(state)["devices"]
        for p in d["processes"]
        if p["pid"] in family and p["claimed_bytes"]
    ]


def held(engines: dict[str, Any], name: str) -> int:
    return claim_of(engines, engines["pid"][name])


def claim_of(engines: dict[str, Any], pid: int) -> int:
    ledger = Ledger(engines["state"], engines["device"])
    try:
        claims = {key.pid: value for key, value in ledger.read().claims.items()}
    finally:
        ledger.close()
    return claims.get(pid, 0)


def wait_for(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not so after {timeout_s} s"
        time.sleep(0.05)


def test_a_burst_takes_the_idle_engines_memory_down_to_its_floor(engines: dict[str, Any]) -> None:
    a, b, stock, watch = engines["a"], engines["b"], engines["stock"], engines["watch"]
    assert b.complete(PROMPTS["b_burst"], NEW_TOKENS["b_burst"]) == stock["b_burst"]
    wait_for(lambda: held(engines, "b") > FLOOR, 5)  # B keeps its prefix cache idle
    time.sleep(0.5)  # the last empty step's orders are out
    b_idle = held(engines, "b")
    time.sleep(1)
    assert held(engines, "b") == b_idle  # nobody wants it: it stays
    started = time.monotonic()
    assert a.complete(PROMPTS["a_burst"], NEW_TOKENS["a_burst"]) == stock["a_burst"]
    a_peak = max(watch.claims(engines["pid"]["a"], started))
    b_low = min(watch.claims(engines["pid"]["b"], started))
    assert a_peak > LIMIT - b_idle  # A used memory B held idle
    assert FLOOR <= b_low < b_idle  # B gave back, down to its floor and no further
    assert watch.highest_total <= LIMIT
    assert b.complete(PROMPTS["b_after"], NEW_TOKENS["b_after"]) == stock["b_after"]


def test_an_engine_killed_as_it_gives_way_leaves_its_memory_to_the_other(
    engines: dict[str, Any],
) -> None:
    """B is killed once A wants its idle memory: as soon as A's want shows
    in the ledger or B's claim falls, whichever comes first (B has begun
    to give way). Nothing of B stays claimed or wanted, and A's request,
    already waiting, is served with all the limit but nothing more."""
    a, b, stock, watch = engines["a"], engines["b"], engines["stock"], engines["watch"]
    a_pid, b_pid = engines["pid"]["a"], engines["pid"]["b"]
    wait_for(lambda: held(engines, "b") > FLOOR, 5)  # its prefix cache, idle
    # A's blocks kept ahead from its last burst go back: its burst needs
    # more than the limit less B's floor from there.
    time.sleep(LINGER_S + 0.5)
    b_idle = held(engines, "b")
    started = time.monotonic()
    asking = a.complete_later(PROMPTS["a_alone"], NEW_TOKENS["a_alone"])
    try:
        wait_for(lambda: wanted_of(engines, a_pid) > 0 or held(engines, "b") < b_idle, 60)
    finally:
        os.killpg(b.process.pid, signal.SIGKILL)
        b.process.wait(60)
    assert asking.result() == stock["a_alone"]
    wait_for(lambda: not psutil.pid_exists(b_pid), 30)
    (device,) = snapshot(engines["state"])["devices"]
    assert b_pid not in {p["pid"] for p in device["processes"]}  # nothing of B held
    assert wanted_of(engines, a_pid) == 0
    a_peak = max(watch.claims(a_pid, started))
    assert a_peak > LIMIT - FLOOR  # B's floor and memory went with B
    assert watch.highest_total <= LIMIT


def wanted_of(engines: dict[str, Any], pid: int) -> int:
    """Bytes process ``pid`` wants on the engines' device (0: none)."""
    (device,) = snapshot(engines["state"])["devices"]
    return sum(p["wanted_bytes"] for p in device["processes"] if p["pid"] == pid)


def elastic_program(
    engines: dict[str, Any], model: str, *, multiprocessing: bool, tp: int = 1
) -> Program:
    """An ``LLM`` program with B's options (its floor shared by its ``tp``
    ranks), on the engines' budget."""
    options = {"extensible_kv": {"growth": "elastic", "floor_bytes": FLOOR // tp}}
    settings = {
        "model": model,
        "multiprocessing": multiprocessing,
        "additional_config": options,
        "tp": tp,
    }
    return Program(settings, {"EXTENSIBLE_KV_STATE_DIR": str(engines["state"])})


def test_an_idle_llm_program_gives_way_with_no_plug_in(engines: dict[str, Any], model: str) -> None:
    """B's turns again, as an ``LLM`` in a Python program idle between
    ``generate`` calls (B is gone: the last test killed it)."""
    a, stock, watch = engines["a"], engines["stock"], engines["watch"]
    program = elastic_program(engines, model, multiprocessing=True)
    try:
        assert program.generate(PROMPTS["p_burst"], NEW_TOKENS["p_burst"]) == stock["p_burst"]
        pid = claimer(program.family(), engines["state"])
        wait_for(lambda: claim_of(engines, pid) > FLOOR, 5)  # its prefix cache, idle
        time.sleep(0.5)
        p_idle = claim_of(engines, pid)
        started = time.monotonic()
        assert a.complete(PROMPTS["a_program"], NEW_TOKENS["a_program"]) == stock["a_program"]
        p_low = min(watch.claims(pid, started))
        assert FLOOR <= p_low < p_idle  # the idle program gave back, down to its floor
        assert watch.highest_total <= LIMIT
        assert program.generate(PROMPTS["p_after"], NEW_TOKENS["p_after"]) == stock["p_after"]
    finally:
        program.stop()


def test_the_tensor_parallel_ranks_of_an_idle_program_give_way_together(
    engines: dict[str, Any], model: str
) -> None:
    """The turns of the test before, with the program's engine on two
    tensor-parallel ranks: each rank claims half of every block, and both
    give way, down to their floors, as the one scheduler orders."""
    a, stock, watch = engines["a"], engines["stock"], engines["watch"]
    program = elastic_program(engines, model, multiprocessing=True, tp=2)
    try:
        assert program.generate(PROMPTS["t_burst"], NEW_TOKENS["t_burst"]) == stock["t_burst"]
        ranks = claimers(program.family(), engines["state"])
        assert len(ranks) == 2
        wait_for(lambda: all(claim_of(engines, pid) > FLOOR // 2 for pid in ranks), 5)
        time.sleep(0.5)
        idle = [claim_of(engines, pid) for pid in ranks]
        assert idle[0] == idle[1]  # the ranks hold alike
        started = time.monotonic()
        assert a.complete(PROMPTS["a_tp"], NEW_TOKENS["a_tp"]) == stock["a_tp"]
        for pid, was in zip(ranks, idle, strict=True):
            assert FLOOR // 2 <= min(watch.claims(pid, started)) < was
        assert watch.highest_total <= LIMIT
        assert program.generate(PROMPTS["t_after"], NEW_TOKENS["t_after"]) == stock["t_after"]
    finally:
        program.stop()


def test_an_engine_stepped_in_its_programs_process_says_it_gives_way_only_in_generate(
    engines: dict[str, Any], model: str
) -> None:
    program = elastic_program(engines, model, multiprocessing=False)
    try:
        said = program.stderr()
        assert "it gives memory back to other processes' wants only while generate() runs" in said
        assert (
            program.generate(PROMPTS["p_after"], NEW_TOKENS["p_after"])
            == engines["stock"]["p_after"]
        )
    finally:
        program.stop()


def test_a_request_that_can_never_fit_is_refused_naming_the_limit(
    engines: dict[str, Any],
) -> None:
    """This test's process takes a floor of the limit less 6 MiB: A could
    never hold more than 6 MiB (24 blocks). A request of 400 prompt tokens
    and 100 new ones needs 17 blocks and the null block, two units (8 MiB):
    vLLM's "length" finish, no tokens, the limit named in its stop reason
    and once in A's log, instead of a wait for ever. A serves again once
    the floor is gone."""
    a, stock = engines["a"], engines["stock"]
    ledger = Ledger(engines["state"], engines["device"])
    try:
        ledger.claim(MiB)  # a slot: a floor is for a process that claims
        ledger.set_floor_and_cap(LIMIT - 6 * MiB, None)
        (choice,) = a.completion([prompt(900, 400)], max_tokens=100)["choices"]
    finally:
        ledger.set_floor_and_cap(0, None)
        ledger.give_back(ledger.held)
        ledger.close()
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == []
    said = choice["stop_reason"]
    assert "can never finish on this engine" in said, said
    assert "the device's limit of 64.0 MiB less the other processes' floors (58.0 MiB)" in said
    assert "need 8.00 MiB of KV memory (32 blocks)" in said, said
    assert a.stderr().count("can never finish on this engine") == 1
    assert a.complete(PROMPTS["b_after"], NEW_TOKENS["b_after"]) == stock["b_after"]


def test_a_want_that_stalls_is_logged_once_naming_the_holder(engines: dict[str, Any]) -> None:
    """This test's process takes all the memory but A's unit 0 (A, idle,
    gives the rest way) and keeps it while A serves a request of 480 + 32
    tokens, which needs two units: A's log says once who holds the memory;
    once it is given back, A serves the request with stock's tokens."""
    a, stock = engines["a"], engines["stock"]
    ledger = Ledger(engines["state"], engines["device"])
    try:
        ledger.claim(LIMIT - UNIT, timeout_s=WANT_MET_S)
        waiting = a.complete_later(PROMPTS["a_stall"], NEW_TOKENS["a_stall"])
        wait_for(lambda: "has waited" in a.stderr(), STALLED_S + 60)
        time.sleep(2 * STALL_EVERY_S)  # the same want, looked at again
        assert not waiting.done()
    finally:
        ledger.give_back(ledger.held)
        ledger.close()
    assert waiting.result() == stock["a_stall"]
    (line,) = [x for x in a.stderr().splitlines() if "has waited" in x]
    assert re.search(rf"pid {os.getpid()} \([^)]*\) holds 60\.0 MiB, floor none", line), line


def test_a_program_asleep_with_its_prefix_cache_wakes_with_it_once_a_has_served(
    engines: dict[str, Any], model: str
) -> None:
    """An elastic ``LLM`` program sleeps keeping its prefix cache: under a
    limit with no room for the copy the sleep is refused and nothing
    changes; with room, its claim falls to the copy of the units its steps
    wrote, A serves a burst, and the program wakes (A gives way) to the
    same prefix-cache hits as before the sleep, with stock's tokens."""
    a, stock = engines["a"], engines["stock"]
    settings = {
        "model": model,
        "multiprocessing": True,
        "additional_config": {"extensible_kv": {"growth": "elastic"}},
    }
    program = Program(settings, {"EXTENSIBLE_KV_STATE_DIR": str(engines["state"])})
    ledger = Ledger(engines["state"], engines["device"])
    try:
        first, new = PROMPTS["k_first"], NEW_TOKENS["k_first"]
        assert program.generate(first, new) == stock["k_first"]
        tokens, warm = program.generate_counting(first, new)
        assert tokens == stock["k_first"]
        assert sum(warm) > 0
        pid = claimer(program.family(), engines["state"])
        time.sleep(LINGER_S + 1)  # the blocks kept ahead of the last step are given back
        idle = claim_of(engines, pid)
        ledger.set_limit(idle)  # A holds its unit 0 too: no room for any copy
        try:
            refused = program.ask({"op": "sleep"})
        finally:
            ledger.set_limit(LIMIT)
        said = refused["error"] or ""
        assert "BUDGET_EXCEEDED" in said, refused
        assert "extensible-kv limit" in said
        assert not refused["state"]["asleep"]
        assert refused["state"]["host_backup_bytes"] == 0
        assert claim_of(engines, pid) == idle
        assert program.ask({"op": "resume"})["error"] is None
        asleep = program.ask({"op": "sleep"})
        assert asleep["error"] is None
        copy = asleep["state"]["host_backup_bytes"]
        assert asleep["state"]["asleep"]
        assert asleep["state"]["physical_bytes"] == 0
        assert 0 < copy <= claim_of(engines, pid) < copy + UNIT  # the copy, whole granules
        assert a.complete(PROMPTS["k_burst"], NEW_TOKENS["k_burst"]) == stock["k_burst"]
        awake = program.ask({"op": "wake"})
        assert awake["error"] is None
        assert not awake["state"]["asleep"]
        assert awake["state"]["host_backup_bytes"] == 0
        tokens, hits = program.generate_counting(first, new)
        assert tokens == stock["k_first"]
        assert sum(hits) >= 0.9 * sum(warm)
    finally:
        ledger.close()
        program.stop()
