"""An RL framework's loop on one vLLM engine, in a process of its own, for
tests/test_vllm_users.py.

    python tests/vllm_rl.py '{"model": "/tmp/m", "worker": "ours", "flows": ["openrlhf", "verl"]}'

Each cycle is what an RL framework does between two rollouts (see FLOWS:
OpenRLHF's through the engine at level 1, verl's straight to the workers at
level 2): generate; sleep; wake the weights; push new weights (through
``worker_extension_cls``, the framework's own hook, here
:class:`WeightSync`); reset the prefix cache; wake the KV cache. Settings
(JSON): ``model``, ``worker`` ("ours", "elastic": ours with our scheduler
and ``growth: "elastic"``, or "stock"), ``cycles`` per flow,
``flows``, ``tp`` (tensor parallel size; several ranks run vLLM's default
engine-core and worker processes).
The last line printed is ``RESULT`` and a JSON report: each cycle's tokens,
every rank's process figures after each generation, and (ours) every
rank's KV state after the generation, asleep and after the wake.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from extensible_kv.bench.child import prompt, quiet_vllm_cpu

WORKER = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"


class WeightSync:
    """The RL framework's worker extension: methods vLLM adds to the worker
    (``worker_extension_cls``), here beside our ``worker_cls``."""

    def push_weights(self, step: int) -> None:
        """Load new weights as a trainer sends them: the checkpoint's tensors,
        scaled by a factor of ``step`` (through vLLM's ``reload_weights``,
        which repacks them for the CPU layers)."""
        from safetensors.torch import load_file

        model_dir = Path(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        factor = 1 + 0.02 * step
        weights = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(path))
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=((name, tensor * factor) for name, tensor in weights.items())
        )

    def process_figures(self) -> dict[str, int]:
        """This worker process's resident bytes, open file descriptors and mappings."""
        import psutil

        with open("/proc/self/maps") as maps:
            mappings = sum(1 for _ in maps)
        return {
            "rss": psutil.Process().memory_info().rss,
            "fds": len(os.listdir("/proc/self/fd")),
            "mappings": mappings,
        }


def state(llm: Any) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("extensible_kv_state"))


def openrlhf(llm: Any, step: int, asleep: Any) -> None:
    """OpenRLHF's cycle (``--vllm.enable_sleep``): the engine's own sleep at
    level 1, the weights woken and pushed, the prefix cache reset, the KV
    cache woken."""
    llm.sleep(level=1)
    asleep()
    llm.wake_up(tags=["weights"])
    llm.reset_prefix_cache()
    llm.collective_rpc("push_weights", args=(step,))
    llm.wake_up(tags=["kv_cache"])


def verl(llm: Any, step: int, asleep: Any) -> None:
    """verl's hybrid cycle: every worker's ``sleep(level=2)`` and
    ``wake_up`` called directly (``collective_rpc``, past the engine's
    own sleep), the prefix cache reset after the weights are pushed."""
    llm.collective_rpc("sleep", kwargs={"level": 2})
    asleep()
    llm.collective_rpc("wake_up", kwargs={"tags": ["weights"]})
    llm.collective_rpc("push_weights", args=(step,))
    llm.reset_prefix_cache()
    llm.collective_rpc("wake_up", kwargs={"tags": ["kv_cache"]})


#: Each framework's cycle between two rollouts, by name.
FLOWS = {"openrlhf": openrlhf, "verl": verl}


def main() -> None:
    settings: dict[str, Any] = json.loads(sys.argv[1])
    tp = settings.get("tp", 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if tp > 1 else "0"
    # The workers import this module by name (worker_extension_cls).
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    quiet_vllm_cpu(HF_HUB_OFFLINE="1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ours = settings["worker"] in ("ours", "elastic")
    elastic = settings["worker"] == "elastic"
    llm = LLM(
        settings["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        tensor_parallel_size=tp,
        worker_cls=WORKER if ours else "auto",
        worker_extension_cls="vllm_rl.WeightSync",
        scheduler_cls=SCHEDULER if elastic else None,
        additional_config={"extensible_kv": {"growth": "elastic"}} if elastic else {},
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=prompt(i, 60 + 9 * i, shared=40)) for i in range(6)]
    report: dict[str, Any] = {
        "tokens": [],
        "figures": [],
        "generated": [],
        "asleep": [],
        "woken": [],
    }
    if ours:
        report["start"] = state(llm)
    step = 0
    for flow in settings.get("flows", ["openrlhf"]):
        for _ in range(settings.get("cycles", 20)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            report["tokens"].append([list(o.outputs[0].token_ids) for o in outputs])
            report["figures"].append(llm.collective_rpc("process_figures"))
            if ours:
                report["generated"].append(state(llm))
            step += 1
            FLOWS[flow](llm, step, lambda: report["asleep"].append(state(llm)) if ours else None)
            if ours:
                report["woken"].append(state(llm))
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
