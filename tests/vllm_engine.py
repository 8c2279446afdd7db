"""One vLLM engine run for tests/test_vllm_engine.py, in a process of its own.

    python tests/vllm_engine.py '{"model": "/tmp/m", "worker": "ours", ...}'

Settings (JSON): ``model`` (a directory), ``worker`` ("ours" or "stock"),
``dtype``, ``multiprocessing`` (vLLM's default worker process, else engine
and worker in this process), ``runner`` (None, "v1" or "v2"), ``steps``
(sleep and wake sequences run after the first two generations, see STEPS),
``kv_bytes`` (vLLM's ``kv_cache_memory_bytes``; null: no explicit
size), ``gpu_memory_utilization``, ``additional_config``, ``load_rounds``
(rounds of new prompts in the "load" step), ``connector`` (a directory for vLLM's ExampleConnector)
and ``fallback`` (the driver probe answers "no VMM":
a labelled mock of the one boundary a CPU machine cannot reach, in-process
only). The last line printed is ``RESULT`` and a JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

settings: dict[str, Any] = json.loads(sys.argv[1])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings.get("multiprocessing") else "0"
if settings.get("runner"):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if settings["runner"] == "v2" else "0"
for name, value in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_CI_ENV": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    # Lets collective_rpc send the checks below (functions) to a worker process.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}.items():
    os.environ.setdefault(name, value)

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

OURS = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
NEW_TOKENS = 16


def prompts(variant: int = 0) -> list[TokensPrompt]:
    """8 prompts of 3 to 200 tokens; the last four share a 48-token prefix
    (prefix caching) and the long ones span several prefill chunks. Each
    ``variant`` has other tokens (no prefix shared with the others)."""
    shared = [(11 * j + variant) % 509 + 1 for j in range(48)]
    lengths = (3, 17, 33, 64, 90, 129, 150, 200)
    out = []
    for i, length in enumerate(lengths):
        body = [(7 * i + 13 * j + 5 * variant) % 503 + 1 for j in range(length)]
        ids = (shared + body)[:length] if i >= 4 else body
        out.append(TokensPrompt(prompt_token_ids=ids))
    return out


def generate(llm: LLM, variant: int = 0) -> tuple[list[list[int]], float]:
    tokens, _, elapsed = generate_counting(llm, variant)
    return tokens, elapsed


def generate_counting(llm: LLM, variant: int = 0) -> tuple[list[list[int]], list[int], float]:
    """Greedy tokens of :func:`prompts`, the tokens each prompt found in
    vLLM's prefix cache, and the seconds taken."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts(variant), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cached = [int(o.num_cached_tokens or 0) for o in outputs]
    return [list(o.outputs[0].token_ids) for o in outputs], cached, elapsed


def worker_rss(worker: Any) -> int:
    """The worker process's resident bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bound_tensors(worker: Any) -> list[dict[str, Any]]:
    """Every KV tensor vLLM bound: the runner's list and each layer's."""
    import torch

    found = [("runner", tensor) for tensor in worker.model_runner.kv_caches]
    for name, layer in worker.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, torch.Tensor):
            found.append((name, cache))
    return [
        {
            "name": name,
            "ptr": tensor.data_ptr(),
            "end": tensor.data_ptr()
            + (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1)
            * tensor.element_size(),
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
            "dtype": str(tensor.dtype),
        }
        for name, tensor in found
    ]


def reserve_again(worker: Any) -> str:
    """What a second reservation on this worker says."""
    worker = getattr(worker, "worker", worker)  # collective_rpc may hand us vLLM's wrapper
    try:
        worker.initialize_from_config(worker.model_runner.kv_cache_config)
    except ValueError as exc:
        return str(exc)
    return "no error"


def grow(worker: Any) -> bool:
    """Commit twice vLLM's blocks under the worker's cache (its private
    handle: vLLM itself keeps its count); whether any bound view moved."""
    worker = getattr(worker, "worker", worker)
    buffers = worker._kv.cache
    before = [tensor.data_ptr() for tensor in worker.model_runner.kv_caches]
    buffers.commit(min(buffers.num_blocks_capacity, 2 * buffers.num_blocks_committed))
    return before != [tensor.data_ptr() for tensor in worker.model_runner.kv_caches]


def engine_blocks(worker: Any) -> int:
    """The block count vLLM's scheduler was given."""
    worker = getattr(worker, "worker", worker)
    return int(worker.model_runner.kv_cache_config.num_blocks)


def kv_nonzero(worker: Any) -> int:
    """Nonzero elements in the layers' KV views (vLLM's block count)."""
    return sum(int(tensor.count_nonzero()) for tensor in worker.model_runner.kv_caches)


class Run:
    def __init__(self, llm: LLM, ours: bool) -> None:
        self.llm = llm
        self.ours = ours
        self.report: dict[str, Any] = {}

    def rpc(self, method: str | Callable[[Any], Any]) -> Any:
        return self.llm.collective_rpc(method)[0]

    def snapshot(self, label: str) -> None:
        self.report[f"rss_{label}"] = self.rpc(worker_rss)
        if self.ours:
            self.report[f"state_{label}"] = self.rpc("extensible_kv_state")

    def timed(self, label: str, call: Callable[[], Any]) -> None:
        start = time.perf_counter()
        call()
        self.report[f"{label}_s"] = time.perf_counter() - start

    def tokens(self, label: str) -> None:
        self.report[f"tokens_{label}"], _ = generate(self.llm)

    def step_sleep(self) -> None:
        self.snapshot("before_sleep")
        self.timed("sleep", lambda: self.llm.sleep(level=1))
        self.snapshot("asleep")
        self.timed("wake", self.llm.wake_up)
        self.snapshot("awake")
        self.report["nonzero_after_wake"] = self.rpc(kv_nonzero)
        self.tokens("after_wake")

    def step_tags(self) -> None:
        self.llm.sleep(level=1)
        self.report["fully_awake_weights"] = self.llm.wake_up(tags=["weights"])
        self.snapshot("weights_only")
        self.report["fully_awake_kv"] = self.llm.wake_up(tags=["kv_cache"])
        self.snapshot("kv_woken")
        self.tokens("after_tags")

    def step_level2(self) -> None:
        self.llm.sleep(level=2)
        self.snapshot("level2")
        self.llm.wake_up()
        self.tokens("after_level2")

    def step_grow(self) -> None:
        self.report["moved"] = self.rpc(grow)
        self.snapshot("grown")
        self.tokens("after_grow")

    def step_again(self) -> None:
        self.report["again"] = self.rpc(reserve_again)
        self.snapshot("after_again")

    def step_refused(self) -> None:
        try:
            self.llm.sleep(level=1)
        except RuntimeError as exc:
            self.report["refused"] = str(exc)
        self.snapshot("refused")
        self.llm.wake_up()  # resumes the scheduler the refused sleep paused
        self.tokens("after_refused")

    def step_discard(self) -> None:
        self.llm.sleep(level=0)
        self.llm.release_kv_cache_memory()
        self.snapshot("discarded")
        self.llm.wake_up(tags=["kv_cache"])
        self.snapshot("rewoken")
        self.tokens("after_discard")

    def step_keep(self) -> None:
        """The sleep that keeps the prefix cache: scheduler paused, KV
        blocks copied to the host and every byte released, then back."""
        self.llm.sleep(level=0)
        self.llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": True})
        self.snapshot("kept_asleep")
        self.llm.collective_rpc("wake_kv_cache")
        self.llm.wake_up(tags=["scheduling"])
        self.snapshot("kept_awake")
        self.report["tokens_after_keep"], self.report["cached_after_keep"], _ = generate_counting(
            self.llm
        )

    def step_forget(self) -> None:
        """A discarding KV sleep at level 0, the prefix cache reset before resuming."""
        self.llm.sleep(level=0)
        self.llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": False})
        self.snapshot("forgot_asleep")
        self.llm.collective_rpc("wake_kv_cache")
        self.llm.reset_prefix_cache()
        self.llm.wake_up(tags=["scheduling"])
        self.report["tokens_after_forget"], _ = generate(self.llm)

    def step_unwoken(self) -> None:
        """The scheduler resumed with the KV cache still asleep: the next
        step wakes it (with what it kept) instead of faulting."""
        self.llm.sleep(level=0)
        self.llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": True})
        self.llm.wake_up(tags=["scheduling"])
        self.report["tokens_after_unwoken"], self.report["cached_after_unwoken"], _ = (
            generate_counting(self.llm)
        )
        self.snapshot("unwoken")

    def step_load(self) -> None:
        """Rounds of new prompts (``load_rounds``): memory follows the ids vLLM hands out."""
        self.report["engine_blocks"] = self.rpc(engine_blocks)
        for round_ in range(settings["load_rounds"]):
            self.report[f"tokens_load_{round_}"], _ = generate(self.llm, variant=1 + round_)
            self.snapshot(f"load_{round_}")

    def step_trim(self) -> None:
        """Idle: the prefix cache reset, then the memory past the first step given back."""
        self.llm.reset_prefix_cache()
        self.report["trimmed_to"] = self.rpc("trim_kv_cache")
        self.snapshot("trimmed")
        self.report["tokens_after_trim"], _ = generate(self.llm)
        self.snapshot("after_trim")

    def step_slept(self) -> None:
        """A discarding sleep (level 1): the wake commits only the first step."""
        self.llm.sleep(level=1)
        self.llm.wake_up()
        self.snapshot("woke")
        self.report["tokens_after_woke"], _ = generate(self.llm)

    def step_trim_zero(self) -> None:
        """Right after generate, in-process: the runner still lists the
        finished requests, and a trim to 0 keeps only the first step."""
        self.llm.reset_prefix_cache()
        self.report["trimmed_zero"] = self.llm.collective_rpc("trim_kv_cache", args=(0,))[0]
        self.snapshot("trimmed_zero")
        self.report["tokens_after_trim_zero"], _ = generate(self.llm)

    def step_blocks(self) -> None:
        self.report["engine_blocks"] = self.rpc(engine_blocks)

    def step_trim_refused(self) -> None:
        try:
            self.rpc("trim_kv_cache")
        except Exception as exc:  # vLLM wraps what the worker raised
            self.report["trim_refused"] = str(exc)

    def step_bad_keep(self) -> None:
        try:
            self.llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": "yes"})
        except Exception as exc:  # vLLM wraps what the worker raised
            self.report["bad_keep"] = str(exc)
        self.snapshot("after_bad_keep")


STEPS = {
    "blocks": Run.step_blocks,
    "load": Run.step_load,
    "trim": Run.step_trim,
    "trim_zero": Run.step_trim_zero,
    "slept": Run.step_slept,
    "trim_refused": Run.step_trim_refused,
    "keep": Run.step_keep,
    "forget": Run.step_forget,
    "unwoken": Run.step_unwoken,
    "bad_keep": Run.step_bad_keep,
    "sleep": Run.step_sleep,
    "tags": Run.step_tags,
    "level2": Run.step_level2,
    "discard": Run.step_discard,
    "again": Run.step_again,
    "grow": Run.step_grow,
    "refused": Run.step_refused,
}


def connector(path: str | None) -> dict[str, Any] | None:
    """vLLM's ExampleConnector (KV saved to and loaded from ``path``)."""
    if path is None:
        return None
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": path},
    }


def main() -> None:
    ours = settings["worker"] == "ours"
    if settings.get("fallback"):
        import extensible_kv.integrations.vllm.worker.worker as integration

        integration.unavailable_reason = lambda device: "no VMM here (a test's mock)"
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(
            settings["model"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=settings.get("dtype", "float32"),
            max_model_len=256,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            kv_cache_memory_bytes=settings.get("kv_bytes", 64 << 20),
            gpu_memory_utilization=settings.get("gpu_memory_utilization", 0.9),
            worker_cls=OURS if ours else "auto",
            additional_config=settings.get("additional_config", {}),
            kv_transfer_config=connector(settings.get("connector")),
            **({"scheduler_cls": SCHEDULER} if settings.get("our_scheduler") else {}),
        )
    run = Run(llm, ours)
    run.report["start_s"] = time.perf_counter() - start
    run.report["warnings"] = [str(w.message) for w in caught if "extensible-kv" in str(w.message)]
    run.report["bound"] = run.rpc(bound_tensors)
    run.report["tokens"], first = generate(llm)
    run.report["tokens_again"], run.report["cached_again"], again = generate_counting(llm)
    run.report["generate_s"] = [first, again]
    run.snapshot("start")
    for step in settings.get("steps", []):
        STEPS[step](run)
    print("RESULT " + json.dumps(run.report), flush=True)


if __name__ == "__main__":
    main()
