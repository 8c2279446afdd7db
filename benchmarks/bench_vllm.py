"""Stock vLLM and vLLM on extensible-kv, side by side in one run, on one tiny model.

    nox -s vllm -- --bench            # or, where vLLM is installed:
    python benchmarks/bench_vllm.py --rounds 3 --out bench-results/vllm.json

Each round starts one engine of each kind, in turn, each in a process of
its own (so neither inherits the other's memory), and measures: the engine's
start (``LLM(...)``), decode tokens per second (8 sequences of 128 new
tokens), the time of ``llm.sleep(level=1)`` and of ``llm.wake_up()``, and
the worker's resident memory before the sleep, asleep and after the wake.
The table gives the median of the rounds, and ours over stock as a ratio.
On CPU stock vLLM's sleep does nothing (it logs "not supported"), so its
memory stays where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OURS = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
MiB = 1 << 20
FIGURES = (
    ("start_s", "engine start", "s"),
    ("decode_tok_s", "decode", "tok/s"),
    ("sleep_s", "sleep(level=1)", "s"),
    ("wake_s", "wake_up()", "s"),
    ("rss_before", "resident before sleep", "MiB"),
    ("rss_asleep", "resident asleep", "MiB"),
    ("rss_awake", "resident after wake", "MiB"),
)


def resident_bytes(worker: Any) -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(model: str, worker: str, kv_bytes: int) -> dict[str, Any]:
    """One engine: the figures of :data:`FIGURES`."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=kv_bytes,
        worker_cls=worker,
    )
    figures: dict[str, Any] = {"start_s": time.perf_counter() - start}
    prompts = [
        TokensPrompt(prompt_token_ids=[(5 * i + j) % 500 + 1 for j in range(8)]) for i in range(8)
    ]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    figures["decode_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
    figures["rss_before"] = llm.collective_rpc(resident_bytes)[0] / MiB
    start = time.perf_counter()
    llm.sleep(level=1)
    figures["sleep_s"] = time.perf_counter() - start
    figures["rss_asleep"] = llm.collective_rpc(resident_bytes)[0] / MiB
    start = time.perf_counter()
    llm.wake_up()
    figures["wake_s"] = time.perf_counter() - start
    figures["rss_awake"] = llm.collective_rpc(resident_bytes)[0] / MiB
    return figures


def run_child(model: str, worker: str, kv_bytes: int) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", model, worker, str(kv_bytes)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise SystemExit(f"the {worker} engine failed:\n{result.stderr[-4000:]}")
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith("FIGURES "))
    figures: dict[str, Any] = json.loads(line.removeprefix("FIGURES "))
    return figures


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Medians side by side. Where stock's sleep freed nothing (its CPU
    build), its sleep and wake did no work, and no ratio is given."""
    median = {
        kind: {key: statistics.median(run[key] for run in runs[kind]) for key, _, _ in FIGURES}
        for kind in runs
    }
    stock_sleeps = median["stock"]["rss_asleep"] < 0.99 * median["stock"]["rss_before"]
    rows = ["| figure | stock vLLM | extensible-kv | ours / stock |", "| --- | --- | --- | --- |"]
    for key, label, unit in FIGURES:
        stock, ours = median["stock"][key], median["ours"][key]
        if key in ("sleep_s", "wake_s") and not stock_sleeps:
            ratio = "- (stock frees nothing)"
        else:
            ratio = f"{ours / stock:.2f}" if stock else "-"
        rows.append(f"| {label} ({unit}) | {stock:.4g} | {ours:.4g} | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, worker, kv_bytes = sys.argv[2], sys.argv[3], int(sys.argv[4])
        print("FIGURES " + json.dumps(child(model, worker, kv_bytes)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="engines of each kind (default 3)")
    parser.add_argument("--kv-mib", type=int, default=512, help="KV cache size (default 512)")
    parser.add_argument("--out", type=Path, help="write the runs and the table as JSON here")
    args = parser.parse_args()
    from extensible_kv.demo.tiny_models import save_tiny_model

    model = str(save_tiny_model("llama", Path(tempfile.gettempdir()) / "extensible-kv-tiny-llama"))
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
    for round_ in range(args.rounds):
        for kind, worker in (("stock", "auto"), ("ours", OURS)):
            print(f"round {round_ + 1}/{args.rounds}: {kind} vLLM", flush=True)
            runs[kind].append(run_child(model, worker, args.kv_mib * MiB))
    text = table(runs)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"kv_mib": args.kv_mib, "runs": runs, "table": text}, indent=2)
        )


if __name__ == "__main__":
    main()
