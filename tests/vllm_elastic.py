"""One vLLM engine replaying a load trace, for tests/test_vllm_elastic.py
and the ``elastic`` benchmark, in a process of its own.

    python tests/vllm_elastic.py '{"model": "/tmp/m", "worker": "ours", "trace": "bursty"}'

Settings (JSON): ``model``, ``worker`` ("ours": our worker and scheduler
with ``growth: "elastic"``; "static": our worker with static growth;
"stock"), ``trace`` (see TRACES), ``multiprocessing`` (vLLM's default
engine-core process; else stepped in this process), ``cache_bytes``,
``kv_bytes``, ``watch_modules`` (record every vLLM module attribute before
the engine and check none was replaced). The last line printed is
``RESULT`` and a JSON report: every request's tokens by name, and memory
samples ``[label, physical_bytes, blocks_in_use]``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from typing import Any

from extensible_kv.bench.child import prompt, quiet_vllm_cpu

settings: dict[str, Any] = json.loads(sys.argv[1])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings.get("multiprocessing") else "0"
quiet_vllm_cpu(HF_HUB_OFFLINE="1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

WORKER = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def vllm_attributes() -> dict[tuple[str, str], int]:
    """The code of every vLLM module imported so far, by identity: its
    functions and classes, and every class's methods (what a patch would
    replace; vLLM's own state, such as its process groups, changes freely)."""
    code: dict[tuple[str, str], int] = {}
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) or inspect.isclass(value):
                code[name, attr] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for method, member in list(vars(value).items()):
                    if inspect.isfunction(member):
                        code[name, f"{attr}.{method}"] = id(member)
    return code


class Trace:
    def __init__(self, llm: LLM, ours: bool) -> None:
        self.llm = llm
        self.ours = ours
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.samples: list[list[Any]] = []
        self.started = time.perf_counter()

    def state(self) -> dict[str, Any]:
        states = self.llm.collective_rpc("extensible_kv_state")
        return {
            "physical_bytes": [s["physical_bytes"] for s in states],
            "blocks": states[0]["num_blocks_committed"],
            "bytes_per_block": states[0]["committed_bytes"]
            // max(1, states[0]["num_blocks_committed"]),
        }

    def sample(self, label: str) -> None:
        if not self.ours:
            return
        state = self.state()
        self.samples.append(
            [label, time.perf_counter() - self.started, state["physical_bytes"], state["blocks"]]
        )

    def settle(self, label: str, seconds: float = 1.0) -> None:
        """Let the engine core's own loop run (multiprocessing), then sample."""
        if settings.get("multiprocessing"):
            time.sleep(seconds)
        self.sample(label)

    def generate(self, names: list[str], prompts: list[list[int]], max_tokens: int) -> None:
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params(max_tokens), use_tqdm=False
        )
        for name, output in zip(names, outputs, strict=True):
            self.tokens[name] = list(output.outputs[0].token_ids)
            self.cached[name] = int(output.num_cached_tokens or 0)

    # -- traces -----------------------------------------------------------------

    def bursty(self) -> None:
        """Rounds that rise, peak, fall and idle; prompts share a prefix."""
        sizes = [1, 2, 4, 8, 12, 16, 16, 12, 8, 4, 2, 1, 0, 0, 1]
        for round_, size in enumerate(sizes):
            names = [f"r{round_}q{i}" for i in range(size)]
            prompts = [prompt(100 * round_ + i, 100 + 23 * i, shared=64) for i in range(size)]
            if size:
                self.generate(names, prompts, 16)
            self.settle(f"round {round_} ({size} requests)")

    def rl(self) -> None:
        """An RL loop with the same load every cycle."""
        prompts = [prompt(i, 60 + 31 * i, shared=32) for i in range(8)]
        for cycle in range(15):
            self.generate([f"c{cycle}q{i}" for i in range(8)], prompts, 16)
            self.settle(f"cycle {cycle} generated", 0.5)
            self.llm.sleep(level=1)
            self.llm.wake_up(tags=["weights"])
            self.llm.wake_up(tags=["kv_cache"])
            self.llm.reset_prefix_cache()
            self.sample(f"cycle {cycle} woken")

    def long(self) -> None:
        """A long request that starts at the peak (the highest ids) and
        outlives the burst; stepped one step at a time (in-process)."""
        engine = self.llm.llm_engine
        for i in range(12):
            short = TokensPrompt(prompt_token_ids=prompt(i, 300))
            engine.add_request(f"short{i}", short, params(4))
        engine.add_request("long", TokensPrompt(prompt_token_ids=prompt(99, 20)), params(400))
        done: set[str] = set()
        peak_sampled = False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    self.tokens[output.request_id] = list(output.outputs[0].token_ids)
                    done.add(output.request_id)
            if not peak_sampled and len(done) >= 12:
                peak_sampled = True
                self.sample("burst done")
            elif peak_sampled and "long" not in done and len(self.samples) < 4:
                self.sample("long runs")
        self.sample("idle")

    def limit(self) -> None:
        """A burst larger than the device's limit allows at once."""
        names = [f"q{i}" for i in range(16)]
        self.generate(names, [prompt(i, 200 + 13 * i) for i in range(16)], 24)
        self.settle("after the burst")


def main() -> None:
    worker = settings["worker"]
    before = vllm_attributes() if settings.get("watch_modules") else None
    extensible: dict[str, Any] = {}
    if worker == "ours":
        extensible = {"growth": "elastic"}
        if "cache_bytes" in settings:
            extensible["cache_bytes"] = settings["cache_bytes"]
    llm = LLM(
        settings["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        block_size=32,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        kv_cache_memory_bytes=settings.get("kv_bytes", 128 << 20),
        worker_cls=WORKER if worker in ("ours", "static") else "auto",
        scheduler_cls=SCHEDULER if worker == "ours" else None,
        additional_config={"extensible_kv": extensible},
    )
    trace = Trace(llm, worker == "ours")
    trace.sample("start")
    getattr(trace, settings["trace"])()
    report: dict[str, Any] = {
        "tokens": trace.tokens,
        "cached": trace.cached,
        "samples": trace.samples,
    }
    if worker == "ours":
        report["state"] = llm.collective_rpc("extensible_kv_state")
    if before is not None:
        after = vllm_attributes()
        report["replaced"] = sorted(
            f"{m}.{a}" for (m, a), ident in before.items() if after.get((m, a), ident) != ident
        )
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
