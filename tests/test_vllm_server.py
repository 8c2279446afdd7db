"""vLLM's OpenAI server (0.32, CPU build) with our worker, as users run it,
against a stock server doing the same: completions, the dev-mode sleep and
wake routes (levels 1 and 2, tag-staged wakes, ``mode=keep`` and
``mode=wait``, a request sent while asleep), memory and addresses through
``/collective_rpc``, our endpoint plug-in, and a bad option.

Each server runs in a process group of its own (``tests/vllm_server.py``)
and is stopped with its engine processes. Runs in ``nox -s vllm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import psutil  # vLLM's dependency
from prometheus_client.parser import text_string_to_metric_families

from extensible_kv.demo.tiny_models import save_tiny_model
from vllm_server import SCHEDULER, WORKER, MiB, Server, token_prompts

#: The token prompts, by the name of the step that sends them.
PROMPTS = {
    "first": token_prompts(4),
    "asleep": token_prompts(2, seed=1),
    "kept": token_prompts(1, seed=2)[0],
    "waited": token_prompts(1, seed=3)[0],
    "level2": token_prompts(3, seed=4),
    "kept_cache": token_prompts(1, seed=5),
}
#: Tokens of a streamed request: enough that a sleep lands while it runs.
LONG = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("server") / "llama"))


@pytest.fixture(scope="module")
def stock(model: str) -> dict[str, Any]:
    """A stock server's tokens for every step's prompts, asked as ours asks them."""
    with Server(model, []) as server:
        return {
            "first": server.complete(PROMPTS["first"]),
            "asleep": server.complete(PROMPTS["asleep"]),
            "kept": server.stream_later(PROMPTS["kept"], LONG).result(),
            "waited": server.stream_later(PROMPTS["waited"], LONG).result(),
            "level2": server.complete(PROMPTS["level2"]),
            "kept_cache": server.complete(PROMPTS["kept_cache"]),
        }


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def server(model: str, stock: dict[str, Any], state_dir: Path) -> Iterator[Server]:
    """Our server, with the endpoint plug-in, on a budget of its own."""
    env = {"VLLM_PLUGINS": "extensible_kv", "EXTENSIBLE_KV_STATE_DIR": str(state_dir)}
    flags = ["--worker-cls", WORKER, "--enable-prompt-tokens-details"]
    with Server(model, flags, env) as started:
        yield started


def awake(server: Server) -> dict[str, Any]:
    """The one worker's state, checked awake (after each test's last wake)."""
    (state,) = server.state()
    assert not state["asleep"]
    assert state["physical_bytes"] > 0
    assert server.get("/is_sleeping") == {"is_sleeping": False}
    return state


def test_completions_equal_stock(server: Server, stock: dict[str, Any]) -> None:
    assert server.complete(PROMPTS["first"]) == stock["first"]
    state = awake(server)
    assert state["enabled"]
    assert state["committed_bytes"] > 0


def test_a_level_one_sleep_frees_the_kv_memory_until_its_tag_wakes_it(
    server: Server, stock: dict[str, Any]
) -> None:
    before = awake(server)
    rss = server.rss()
    server.post("/sleep", level=1)
    (asleep,) = server.state()
    assert asleep["asleep"]
    assert asleep["physical_bytes"] == 0
    # The server's processes give the memory back (stock's sleep frees
    # nothing on CPU).
    assert rss - server.rss() >= 0.9 * before["physical_bytes"]
    assert server.get("/is_sleeping") == {"is_sleeping": True}

    waiting = server.complete_later(PROMPTS["asleep"])
    time.sleep(1)
    assert not waiting.done()  # queued while asleep
    assert server.post("/wake_up", tags="weights")["status"] == "sleeping"
    assert server.state()[0]["physical_bytes"] == 0
    assert not waiting.done()
    assert server.post("/wake_up", tags="kv_cache")["status"] == "awake"
    woken = awake(server)
    assert woken["physical_bytes"] == before["physical_bytes"]
    assert woken["base_ptrs"] == before["base_ptrs"]  # captured graphs stay valid
    assert waiting.result() == stock["asleep"]


def test_a_sleep_that_keeps_a_running_request_serves_it_after_the_wake(
    server: Server, stock: dict[str, Any]
) -> None:
    streaming = server.stream_later(PROMPTS["kept"], LONG)
    assert streaming.started.wait(60)
    server.post("/sleep", level=1, mode="keep")
    assert server.state()[0]["physical_bytes"] == 0
    assert not streaming.done()  # paused, kept; vLLM recomputes it after the wake
    server.post("/wake_up")
    assert streaming.result() == stock["kept"]
    awake(server)


def test_a_sleep_that_waits_lets_a_running_request_finish_first(
    server: Server, stock: dict[str, Any]
) -> None:
    streaming = server.stream_later(PROMPTS["waited"], LONG)
    assert streaming.started.wait(60)
    server.post("/sleep", level=1, mode="wait")
    assert streaming.done()
    assert streaming.result() == stock["waited"]
    assert server.state()[0]["physical_bytes"] == 0
    server.post("/wake_up")
    awake(server)


def test_a_level_two_sleep_and_a_full_wake(server: Server, stock: dict[str, Any]) -> None:
    before = awake(server)
    server.post("/sleep", level=2)
    assert server.state()[0]["physical_bytes"] == 0
    server.post("/wake_up")
    assert awake(server)["base_ptrs"] == before["base_ptrs"]
    assert server.complete(PROMPTS["level2"]) == stock["level2"]


def test_the_sleep_that_keeps_the_prefix_cache_over_http(
    server: Server, stock: dict[str, Any]
) -> None:
    assert server.complete(PROMPTS["kept_cache"]) == stock["kept_cache"]
    before = awake(server)
    server.post("/sleep", level=0)  # pauses; vLLM keeps its prefix cache
    server.rpc("sleep_kv_cache", preserve=True)
    (asleep,) = server.state()
    assert asleep["physical_bytes"] == 0
    assert asleep["host_backup_bytes"] > 0
    server.rpc("wake_kv_cache")
    server.post("/wake_up", tags="scheduling")
    assert awake(server)["base_ptrs"] == before["base_ptrs"]
    answer = server.completion(PROMPTS["kept_cache"])
    assert answer["choices"][0]["token_ids"] == stock["kept_cache"][0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def wait_for(condition: Any, timeout_s: float = 10) -> Any:
    """``condition()``'s first truthy value, polled for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not seen in {timeout_s} s"
        time.sleep(0.1)
    return value


def engine_caches(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for d in state["devices"] for p in d["processes"] for c in p["caches"]]


def test_the_endpoint_plugin_shows_this_instances_kv_memory_and_the_devices_budget(
    server: Server, state_dir: Path
) -> None:
    env = {**os.environ, "EXTENSIBLE_KV_STATE_DIR": str(state_dir)}
    # Another process on the same device: in the device's totals, not in the instance.
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, extensible_kv as e; t = e.ExtensibleTensor(64 << 20, 'cpu'); "
            "t.resize_(8 << 20); print('ready', flush=True); sys.stdin.read()",
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        assert other.stdout.readline() == "ready\n"
        physical = awake(server)["physical_bytes"]

        def settled() -> dict[str, Any] | None:
            state: dict[str, Any] = server.get("/extensible_kv/state")
            caches = engine_caches(state)
            figures = [c["physical_bytes"] for c in caches]
            devices = state["devices"]
            seen = devices and devices[0]["claimed_bytes"] >= physical + (8 << 20)
            return state if figures == [physical] and seen else None

        state = wait_for(settled)
        (device,) = state["devices"]
        (process,) = device["processes"]
        assert process["pid"] in server.children()  # the engine core
        assert other.pid not in {p["pid"] for p in device["processes"]}
        # The schema and data of `extensible-kv top --once --json`.
        top = subprocess.run(
            [str(Path(sys.executable).parent / "extensible-kv"), "top", "--once", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert top.returncode == 0, top.stderr
        whole = json.loads(top.stdout)
        assert whole.keys() == state.keys()
        assert whole["schema_version"] == state["schema_version"]
        (whole_device,) = whole["devices"]
        assert {p["pid"] for p in whole_device["processes"]} == {process["pid"], other.pid}
        assert [p for p in whole_device["processes"] if p["pid"] == process["pid"]] == [process]

        metrics = {
            (sample.name, sample.labels.get("pid")): sample.value
            for family in text_string_to_metric_families(
                server.request("GET", "/extensible_kv/metrics").decode()
            )
            for sample in family.samples
        }
        pid = str(process["pid"])
        assert metrics["extensible_kv_cache_physical_bytes", pid] == physical
        assert metrics["extensible_kv_cache_asleep", pid] == 0
        assert metrics["extensible_kv_device_claimed_bytes", None] == device["claimed_bytes"]
        assert ("extensible_kv_process_claimed_bytes", str(other.pid)) not in metrics

        server.post("/sleep", level=1)
        wait_for(lambda: engine_caches(server.get("/extensible_kv/state"))[0]["asleep"])
        server.post("/wake_up")
    finally:
        other.kill()
        other.wait(timeout=60)
    awake(server)


def test_elastic_growth_takes_the_scheduler_flag_too(model: str, stock: dict[str, Any]) -> None:
    config = json.dumps({"extensible_kv": {"growth": "elastic", "cache_bytes": 16 * MiB}})
    flags = ["--worker-cls", WORKER, "--scheduler-cls", SCHEDULER, "--additional-config", config]
    with Server(model, flags) as elastic:
        assert elastic.complete(PROMPTS["first"]) == stock["first"]
        assert awake(elastic)["growth"] == "elastic"


def test_a_bad_option_stops_the_server_with_one_clear_line(model: str) -> None:
    config = json.dumps({"extensible_kv": {"growth": "sideways"}})
    server = Server(model, ["--worker-cls", WORKER, "--additional-config", config])
    try:
        assert server.wait_exit(300) != 0
        message = "additional_config['extensible_kv']['growth'] is 'sideways'; give one of"
        assert message in server.stderr(), server.stderr()[-4000:]
    finally:
        server.stop()


def test_a_killed_server_leaves_no_engine_and_no_claim_behind(model: str, tmp_path: Path) -> None:
    """vLLM's engine core outlives a killed client, stock's as ours; our
    workers see the client go and shut the engine down."""
    env = {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path)}
    with Server(model, ["--worker-cls", WORKER], env) as server:
        engine = [psutil.Process(pid) for pid in server.children()]
        assert any("EngineCore" in " ".join(p.cmdline()) for p in engine)
        server.process.kill()  # the server alone, as the OOM killer would
        server.process.wait(timeout=60)
        _, alive = psutil.wait_procs(engine, timeout=90)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    claims = json.loads(
        subprocess.run(
            [str(Path(sys.executable).parent / "extensible-kv"), "top", "--once", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            check=True,
        ).stdout
    )
    assert all(d["claimed_bytes"] == 0 and not d["processes"] for d in claims["devices"])
