"""A released vLLM (0.32, CPU build) on extensible-kv, against stock vLLM.

Every engine runs in a process of its own (``tests/vllm_engine.py``), with
tiny random models made here by transformers: a GQA Llama and a Qwen3.
Greedy tokens of 8 prompts in one batch (prefix caching and chunked
prefill on) must equal stock vLLM's, before and after sleep and wake. Runs
in ``nox -s vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from extensible_kv.demo.tiny_models import save_tiny_model

ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"
#: Rounds of new prompts for the on-demand growth: enough for vLLM to hand
#: out ids past one granule of blocks (each round caches a few full blocks).
LOAD_ROUNDS = 10


def run_engine(settings: dict[str, Any], *, expect_failure: bool = False) -> dict[str, Any]:
    """Run one engine and return its report (or, failing as expected, its output)."""
    result = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    if expect_failure:
        assert result.returncode != 0, output[-3000:]
        return {"output": output}
    assert result.returncode == 0, output[-6000:]
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return report


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(save_tiny_model(arch, root / arch)) for arch in ("llama", "qwen3")}


_stock: dict[tuple[str, str], dict[str, Any]] = {}


def stock(models: dict[str, str], arch: str, dtype: str) -> dict[str, Any]:
    """Stock vLLM's run of that model, made once per module."""
    if (arch, dtype) not in _stock:
        _stock[arch, dtype] = run_engine({"model": models[arch], "worker": "stock", "dtype": dtype})
    return _stock[arch, dtype]


def assert_views_in_reservation(report: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every KV tensor vLLM bound lies in our reservation, shaped as stock's."""
    state = report["state_start"]
    (base,) = state["base_ptrs"]
    end = base + state["reserved_bytes"]
    assert report["bound"], "vLLM bound no KV tensor"
    for tensor in report["bound"]:
        assert base <= tensor["ptr"] < tensor["end"] <= end, tensor
    ours = [(t["name"], t["shape"], t["stride"], t["dtype"]) for t in report["bound"]]
    theirs = [(t["name"], t["shape"], t["stride"], t["dtype"]) for t in reference["bound"]]
    assert ours == theirs


@pytest.mark.parametrize(
    ("arch", "dtype", "multiprocessing"),
    [
        ("llama", "float32", False),
        ("llama", "bfloat16", False),
        ("qwen3", "float32", True),
        ("qwen3", "bfloat16", False),
    ],
)
def test_tokens_match_stock_vllm_through_sleep_and_wake(
    models: dict[str, str], arch: str, dtype: str, multiprocessing: bool
) -> None:
    # bfloat16 runs in-process only: in a worker process of its own, vLLM's
    # CPU build dies now and then with SIGILL in its first bf16 step on some
    # hosts, stock's as ours (seen on this project's CI-like machine: 1 in 4
    # stock runs); in-process it has not.
    reference = stock(models, arch, dtype)
    report = run_engine(
        {
            "model": models[arch],
            "worker": "ours",
            "dtype": dtype,
            "multiprocessing": multiprocessing,
            "steps": ["sleep"],
        }
    )
    assert report["tokens"] == reference["tokens"]
    assert report["tokens_again"] == reference["tokens"]  # served partly from the prefix cache
    assert report["tokens_after_wake"] == reference["tokens"]
    assert_views_in_reservation(report, reference)

    before, asleep, awake = (report[f"state_{x}"] for x in ("before_sleep", "asleep", "awake"))
    assert before["physical_bytes"] >= before["committed_bytes"] > 0
    assert not before["asleep"]
    assert asleep["asleep"]
    assert not awake["asleep"]
    assert asleep["physical_bytes"] == asleep["committed_bytes"] == 0
    assert asleep["num_blocks_committed"] == 0
    assert before["base_ptrs"] == asleep["base_ptrs"] == awake["base_ptrs"]
    assert awake["physical_bytes"] == before["physical_bytes"]
    assert awake["num_blocks_committed"] == before["num_blocks_committed"]
    assert before["num_blocks_capacity"] > before["num_blocks_committed"]
    assert report["rss_before_sleep"] - report["rss_asleep"] >= 0.99 * before["physical_bytes"]
    assert report["nonzero_after_wake"] == 0  # the wake's memory is zeroed


def test_stock_vllm_keeps_every_byte_on_cpu_sleep(models: dict[str, str]) -> None:
    """What the docs' table says of stock 0.32 on CPU: sleep frees nothing."""
    report = run_engine({"model": models["llama"], "worker": "stock", "steps": ["sleep"]})
    assert report["rss_before_sleep"] - report["rss_asleep"] < 16 << 20
    assert report["tokens_after_wake"] == report["tokens"]


def test_tags_level_two_discard_and_growth_behave_as_vllm_documents(models: dict[str, str]) -> None:
    reference = stock(models, "llama", "float32")
    # release_kv_cache_memory needs the engine loop of vLLM's engine process.
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "multiprocessing": True,
            "steps": ["tags", "level2", "discard", "again", "grow"],
        }
    )
    weights_only = report["state_weights_only"]
    assert report["fully_awake_weights"] is False  # the KV cache still sleeps
    assert weights_only["asleep"]
    assert weights_only["physical_bytes"] == 0
    assert report["fully_awake_kv"] is True
    assert not report["state_kv_woken"]["asleep"]
    assert report["state_level2"]["physical_bytes"] == 0
    assert report["state_discarded"]["asleep"]
    assert report["state_discarded"]["physical_bytes"] == 0
    rewoken = report["state_rewoken"]
    assert not rewoken["asleep"]
    assert rewoken["base_ptrs"] == report["state_start"]["base_ptrs"]
    assert rewoken["physical_bytes"] == report["state_start"]["physical_bytes"]
    for label in ("after_tags", "after_level2", "after_discard"):
        assert report[f"tokens_{label}"] == reference["tokens"], label
    assert "already reserved" in report["again"]
    assert report["state_after_again"] == rewoken  # the refusal changed nothing
    # A later commit grows every layer in place under vLLM's bound views.
    grown = report["state_grown"]
    assert report["moved"] is False
    assert grown["num_blocks_committed"] == 2 * rewoken["num_blocks_committed"]
    assert grown["physical_bytes"] > rewoken["physical_bytes"]
    assert grown["base_ptrs"] == rewoken["base_ptrs"]
    assert report["tokens_after_grow"] == reference["tokens"]


def test_an_elastic_sleep_that_keeps_the_prefix_cache(models: dict[str, str]) -> None:
    """The same sleep with growth 'elastic': only the units steps wrote to
    are copied, and the wake puts them back at the same block ids; the
    repeated prompts are served from vLLM's prefix cache with stock's tokens."""
    reference = stock(models, "llama", "float32")
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "our_scheduler": True,
            "multiprocessing": True,
            "additional_config": {"extensible_kv": {"growth": "elastic"}},
            "steps": ["keep"],
        }
    )
    start, asleep, awake = (report[f"state_{x}"] for x in ("start", "kept_asleep", "kept_awake"))
    assert asleep["asleep"]
    assert asleep["physical_bytes"] == 0
    assert not awake["asleep"]
    assert awake["base_ptrs"] == start["base_ptrs"]
    assert report["tokens_after_keep"] == reference["tokens"]
    assert report["cached_after_keep"] == reference["cached_again"]
    assert sum(reference["cached_again"]) > 0


@pytest.mark.parametrize("multiprocessing", [False, True])
def test_a_sleep_that_keeps_the_prefix_cache(models: dict[str, str], multiprocessing: bool) -> None:
    """sleep(level=0), sleep_kv_cache(preserve=True), wake_kv_cache,
    wake_up(["scheduling"]): no KV memory while asleep, and the repeated
    prompts are served from vLLM's prefix cache with stock's tokens."""
    reference = stock(models, "llama", "float32")
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "multiprocessing": multiprocessing,
            "steps": ["bad_keep", "trim_refused", "keep", "forget", "unwoken"],
        }
    )
    assert "needs additional_config" in report["trim_refused"]
    start, asleep, awake = (report[f"state_{x}"] for x in ("start", "kept_asleep", "kept_awake"))
    assert "preserve must be a bool" in report["bad_keep"]
    assert report["state_after_bad_keep"] == start
    assert asleep["asleep"]
    assert asleep["physical_bytes"] == 0
    # On the host backend the copy is host memory too: it moves, it does not go.
    assert asleep["host_backup_bytes"] == start["committed_bytes"]
    assert awake["host_backup_bytes"] == 0
    assert not awake["asleep"]
    assert awake["base_ptrs"] == start["base_ptrs"]
    assert awake["physical_bytes"] == start["physical_bytes"]
    assert report["tokens_after_keep"] == reference["tokens"]
    # Served from the prefix cache as stock's warm cache serves them (every
    # whole block of each prompt), as if the sleep had not been.
    assert report["cached_after_keep"] == reference["cached_again"]
    assert sum(reference["cached_again"]) > 0
    assert report["state_forgot_asleep"]["physical_bytes"] == 0
    assert report["tokens_after_forget"] == reference["tokens"]
    assert report["tokens_after_unwoken"] == reference["tokens"]
    assert report["cached_after_unwoken"] == reference["cached_again"]
    assert not report["state_unwoken"]["asleep"]


def test_memory_follows_the_load(models: dict[str, str]) -> None:
    """growth: on_demand. Physical memory is the blocks vLLM has handed out
    (rounded to a granule), far below its count; idle, a trim gives it back;
    a discarding sleep wakes to the first step. Tokens equal stock's."""
    load = {"steps": ["load"], "load_rounds": LOAD_ROUNDS}
    reference = run_engine({"model": models["llama"], "worker": "stock", **load})
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "multiprocessing": True,
            "kv_bytes": 256 << 20,
            "additional_config": {"extensible_kv": {"growth": "on_demand"}},
            "steps": ["load", "trim", "slept"],
            "load_rounds": LOAD_ROUNDS,
        }
    )
    start = report["state_start"]
    assert start["growth"] == "on_demand"
    rounds = [report[f"state_load_{i}"] for i in range(LOAD_ROUNDS)]
    for label in ("tokens", "tokens_again", *(f"tokens_load_{i}" for i in range(LOAD_ROUNDS))):
        assert report[label] == reference[label], label
    committed = [s["num_blocks_committed"] for s in (start, *rounds)]
    assert committed == sorted(committed)  # vLLM hands out fresh ids first
    assert committed[-1] > committed[0]  # and the memory followed them
    assert all(s["num_blocks_committed"] == s["high_water_blocks"] for s in (start, *rounds))
    assert 0 < committed[-1] <= report["engine_blocks"] // 4
    assert rounds[-1]["physical_bytes"] < rounds[-1]["reserved_bytes"] // 4
    trimmed = report["state_trimmed"]
    assert report["trimmed_to"] == trimmed["num_blocks_committed"] < committed[-1]
    assert trimmed["physical_bytes"] < rounds[-1]["physical_bytes"]
    assert trimmed["base_ptrs"] == start["base_ptrs"]
    assert report["tokens_after_trim"] == reference["tokens"]
    assert report["state_after_trim"]["num_blocks_committed"] > trimmed["num_blocks_committed"]
    assert report["state_woke"]["num_blocks_committed"] == trimmed["num_blocks_committed"]
    assert report["tokens_after_woke"] == reference["tokens"]


def test_a_trim_right_after_generate_counts_only_running_requests(
    models: dict[str, str],
) -> None:
    """growth: on_demand, engine in-process: no step runs after generate
    returns, so vLLM's runner still lists the finished requests; they hold
    no memory a trim must keep."""
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "additional_config": {"extensible_kv": {"growth": "on_demand"}},
            "steps": ["trim_zero"],
        }
    )
    start, trimmed = report["state_start"], report["state_trimmed_zero"]
    # Not refused (counting the finished requests, it was: "running
    # requests use up to block 14"): down to the first step.
    assert report["trimmed_zero"] == trimmed["num_blocks_committed"]
    assert trimmed["num_blocks_committed"] <= start["num_blocks_committed"]
    assert report["tokens_after_trim_zero"] == report["tokens"]


def test_without_a_size_the_cache_is_sized_from_what_warm_up_used(models: dict[str, str]) -> None:
    """No kv_cache_memory_bytes: ours reserves, warms up over a small prefix,
    measures everything else and commits what is left, in the same
    reservation; stock measures its process after its own warm-up. Both
    count this process, so the block counts agree closely."""
    sized = {
        "model": models["llama"],
        "kv_bytes": None,
        "gpu_memory_utilization": 0.1,
        "steps": ["blocks"],
    }
    stock_run = run_engine({**sized, "worker": "stock"})
    report = run_engine({**sized, "worker": "ours"})
    assert report["tokens"] == stock_run["tokens"]
    state, sizing = report["state_start"], report["state_start"]["sizing"]
    assert sizing["warm_up_blocks"] >= 1
    assert sizing["available_kv_bytes"] == sizing["budget_bytes"] - sizing["non_kv_bytes"]
    assert 0 < sizing["non_kv_bytes"] < sizing["budget_bytes"]
    assert state["num_blocks_committed"] == report["engine_blocks"]
    assert state["committed_bytes"] <= sizing["available_kv_bytes"]
    ours, theirs = report["engine_blocks"], stock_run["engine_blocks"]
    assert abs(ours - theirs) <= 0.1 * theirs, (ours, theirs)


def test_an_explicit_size_is_committed_exactly(models: dict[str, str]) -> None:
    report = run_engine(
        {"model": models["llama"], "worker": "ours", "kv_bytes": 96 << 20, "steps": ["blocks"]}
    )
    state = report["state_start"]
    assert state["sizing"] is None
    assert state["num_blocks_committed"] == report["engine_blocks"]
    assert (96 << 20) - state["committed_bytes"] < state["committed_bytes"] // state[
        "num_blocks_committed"
    ]  # all of it, to the last whole block


def test_a_discarding_sleep_is_refused_while_a_kv_connector_is_configured(
    models: dict[str, str], tmp_path: Path
) -> None:
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "connector": str(tmp_path / "kv"),
            "steps": ["refused"],
        }
    )
    assert "ExampleConnector has registered" in report["refused"]
    assert report["state_refused"] == report["state_start"]
    # Generation goes on after the wake (vLLM's ExampleConnector then loads
    # saved KV of its own, so the tokens are its business, not compared here).
    assert [len(t) for t in report["tokens_after_refused"]] == [len(t) for t in report["tokens"]]


def test_a_capacity_option_is_reserved_for(models: dict[str, str]) -> None:
    report = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "additional_config": {"extensible_kv": {"num_blocks_capacity": 4096}},
        }
    )
    state = report["state_start"]
    assert state["num_blocks_capacity"] == 4096
    assert state["num_blocks_committed"] < 4096
    assert report["tokens"] == stock(models, "llama", "float32")["tokens"]


@pytest.mark.parametrize(
    ("options", "message", "with_connector"),
    [
        ({"num_blocks_capacity": 1}, "below the", False),
        ({"num_blocks_capacity": "lots"}, "give an int", False),
        ({"growth": "on_demand"}, "cannot serve a KV connector", True),
    ],
)
def test_bad_configuration_is_one_clear_line(
    models: dict[str, str],
    tmp_path: Path,
    options: dict[str, Any],
    message: str,
    with_connector: bool,
) -> None:
    result = run_engine(
        {
            "model": models["llama"],
            "worker": "ours",
            "additional_config": {"extensible_kv": options},
            "connector": str(tmp_path / "kv") if with_connector else None,
        },
        expect_failure=True,
    )
    # Raised by the worker before vLLM builds anything over the memory; vLLM
    # prints it as the last line of its traceback (prefixed "[rank0]: ").
    lines = [line for line in result["output"].splitlines() if "additional_config" in line]
    ours = [line.partition("ValueError: ")[2] for line in lines if "ValueError: " in line]
    assert any(message in line for line in ours), lines


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"capacity": 4096},
            "with num_blocks_capacity, growth, budget_wait_s, cache_bytes, floor_bytes, "
            "cap_bytes, keep_prefix_cache_s only",
        ),
        ({"budget_wait_s": -1}, "budget_wait_s'] is -1"),
        ({"growth": "lazy"}, "give one of 'static', 'on_demand', 'elastic'"),
        ({"cache_bytes": 1 << 20}, "of growth 'elastic' only"),
        ({"growth": "elastic", "cache_bytes": -1}, "cache_bytes'] is -1"),
        ({"keep_prefix_cache_s": 60}, "of growth 'elastic' only"),
        ({"growth": "elastic", "keep_prefix_cache_s": 0}, "a positive number"),
        (
            {"growth": "elastic"},
            "'elastic' needs scheduler_cls='extensible_kv.integrations.vllm.ExtensibleKVScheduler'",
        ),
    ],
)
def test_every_option_is_checked_in_one_line_against_vllms_own_config(
    models: dict[str, str], options: dict[str, Any], message: str
) -> None:
    """The options' rules on the ``VllmConfig`` vLLM makes from its
    arguments: what the worker and the scheduler check first at start, an
    error of which reaches the user as the test above shows."""
    from vllm.engine.arg_utils import EngineArgs

    from extensible_kv.integrations.vllm.options import options_of

    config = EngineArgs(
        models["llama"], skip_tokenizer_init=True, additional_config={"extensible_kv": options}
    ).create_engine_config()
    with pytest.raises(ValueError, match="additional_config") as raised:
        options_of(config)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_without_vmm_it_falls_back_to_stock_with_one_warning(models: dict[str, str]) -> None:
    report = run_engine({"model": models["llama"], "worker": "ours", "fallback": True})
    assert len(report["warnings"]) == 1
    assert "vLLM allocates its KV cache itself" in report["warnings"][0]
    assert report["tokens"] == stock(models, "llama", "float32")["tokens"]
    assert report["state_start"]["enabled"] is False
    assert report["state_start"]["base_ptrs"] == []


def test_the_sleep_wake_example_runs_and_checks_itself() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "vllm_sleep_wake.py"
    result = subprocess.run(
        [sys.executable, str(example), "--kv-mib", "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "asleep:     0.0 MiB of KV memory" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("ok: ")


def test_two_vllm_engines_switch_under_one_budget(tmp_path: Path) -> None:
    """Two LLMs (a Llama and a Qwen3) in two processes, a limit that holds one
    KV cache: each serve's tokens equal the engine's first, a wake while the
    other holds the budget is refused, a waiting one succeeds after its sleep."""
    example = Path(__file__).resolve().parent.parent / "examples" / "switch_models.py"
    result = subprocess.run(
        [sys.executable, str(example), "--engine", "vllm", "--kv-mib", "64"],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path / "untouched")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ok: every serve's tokens were right"
    (refusal,) = [line for line in lines if "refused: " in line]
    assert refusal.split()[:2] == ["B", "wake"]
    assert sum("tokens right" in line for line in lines) == 6
    assert not (tmp_path / "untouched").exists()


def test_the_serve_several_example_moves_memory_between_servers(tmp_path: Path) -> None:
    """Two OpenAI servers under one limit, a burst on each in turn: every
    request answered, the idle server's prefix cache given to the other's
    want, a plot written, and no server or state left behind."""
    import psutil

    example = Path(__file__).resolve().parent.parent / "examples" / "serve_several.py"
    plot = tmp_path / "several.png"
    result = subprocess.run(
        [sys.executable, str(example), "--bursts", "2", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path / "untouched")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("ok: 32 requests on 2 servers"), lines[-1]
    assert sum("16/16 completed" in line for line in lines) == 2
    # B's burst (about 65 MiB) needs more than A's 44 MiB (unit 0 and its
    # cache) leaves of the 96 MiB limit: A gives way.
    assert any("B wanted" in line and "the room was there within" in line for line in lines)
    assert plot.stat().st_size > 10_000
    assert not (tmp_path / "untouched").exists()
    left = []
    for process in psutil.process_iter(["cmdline"]):
        if '"cache_bytes": 41943040' in " ".join(process.info["cmdline"] or ()):
            left.append(process.pid)
    assert not left, f"servers left running: {left}"
