"""Time per generated token as the sequence grows, and KV memory, for
ExtensibleCache against DynamicCache and StaticCache, side by side in one
run (repeats interleaved, medians and min/max of the repeats).

    pip install 'extensible-kv[transformers]'
    python benchmarks/bench_transformers.py [--device cpu] [--new-tokens 1024]
        [--repeats 3] [--json out.json] [--plot docs/img/transformers.png]

The model is a small random-weight Llama (nothing is downloaded), greedy,
batch 1. Per-token time is read between consecutive steps of generate (a
logits processor takes the time; on a GPU after a synchronize) and averaged
over windows of positions. KV memory is what each cache holds: DynamicCache
and StaticCache the bytes of their tensors, ExtensibleCache its committed
granules. StaticCache and ExtensibleCache are given the same
``max_cache_len``, the model's context. ``ext-static`` is ExtensibleCache
with ``static_shapes=True``: on a GPU generate compiles its decode step as
it does StaticCache's (CUDA graphs); on the host neither is compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
)

from extensible_kv.integrations.transformers import ExtensibleCache

MiB = 1 << 20
KINDS = ("dynamic", "static", "extensible", "ext-static")


class StepClock(LogitsProcessor):  # type: ignore[misc]
    """Takes the time, and the cache's KV bytes, at every step."""

    def __init__(self, device: torch.device, kv_bytes: Callable[[], int]) -> None:
        self.device = device
        self.kv_bytes = kv_bytes
        self.times: list[float] = []
        self.bytes: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        self.bytes.append(self.kv_bytes())
        return scores


def tensor_bytes(cache: Any) -> int:
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None and layer.keys.numel()
    )


def make_cache(kind: str, config: LlamaConfig) -> tuple[Any, Callable[[], int]]:
    if kind == "dynamic":
        dynamic = DynamicCache(config=config)
        return dynamic, lambda: tensor_bytes(dynamic)
    if kind == "static":
        static = StaticCache(config=config, max_cache_len=config.max_position_embeddings)
        return static, lambda: tensor_bytes(static)
    extensible = ExtensibleCache(
        max_cache_len=config.max_position_embeddings,
        config=config,
        static_shapes=kind == "ext-static",
    )
    return extensible, lambda: extensible.physical_bytes


def run_once(
    kind: str, model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int
) -> tuple[list[float], list[int]]:
    """Seconds of each step after the first, and KV bytes after each step."""
    cache, kv_bytes = make_cache(kind, model.config)
    clock = StepClock(prompt.device, kv_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past_key_values is renamed in 5.2x
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    if isinstance(cache, ExtensibleCache):
        cache.free()
    return steps, clock.bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=128, help="positions per row (128)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(1, config.vocab_size, (1, 32), device=device)
    run_once("dynamic", model, prompt, 8)  # warm-up: kernels, allocator

    steps: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    held: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for kind in KINDS:  # interleaved, so drift hits every kind alike
            print(f"repeat {repeat + 1}/{args.repeats}: {kind}", flush=True)
            times, kv = run_once(kind, model, prompt, args.new_tokens)
            steps[kind].append(times)
            held[kind] = kv

    rows = []
    n = min(len(t) for runs in steps.values() for t in runs)
    for start in range(0, n, args.window):
        end = min(n, start + args.window)
        per_kind = {}
        for kind in KINDS:
            means = [statistics.fmean(t[start:end]) * 1e3 for t in steps[kind]]
            per_kind[kind] = {
                "median_ms": statistics.median(means),
                "min_ms": min(means),
                "max_ms": max(means),
            }
        rows.append({"positions": [start + prompt.shape[1], end + prompt.shape[1]], **per_kind})
    memory = {
        kind: {"end_mib": held[kind][-1] / MiB, "max_mib": max(held[kind]) / MiB} for kind in KINDS
    }

    print(f"\nper-token time (ms), median of {args.repeats} [min-max]; device {device}")
    ratios = "  ext/dyn  ext/static  ext-static/static"
    print(f"{'positions':>12} " + " ".join(f"{k:>22}" for k in KINDS) + ratios)
    for row in rows:
        cells = " ".join(
            f"{row[k]['median_ms']:>8.2f} [{row[k]['min_ms']:.2f}-{row[k]['max_ms']:.2f}]".rjust(22)
            for k in KINDS
        )
        ext, static = row["extensible"]["median_ms"], row["static"]["median_ms"]
        print(
            f"{row['positions'][0]:>5}-{row['positions'][1]:<6} {cells}  "
            f"{ext / row['dynamic']['median_ms']:>7.2f}  {ext / static:>10.2f}  "
            f"{row['ext-static']['median_ms'] / static:>17.2f}"
        )
    print("\nKV memory (MiB) at the end [most held]:")
    for kind in KINDS:
        print(f"  {kind:<10} {memory[kind]['end_mib']:>8.2f} [{memory[kind]['max_mib']:.2f}]")

    result = {"device": str(device), "torch": torch.__version__, "rows": rows, "memory": memory}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(rows, memory, args.plot)


def plot(rows: list[dict[str, Any]], memory: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    middle = [sum(row["positions"]) / 2 for row in rows]
    for kind in KINDS:
        left.plot(middle, [row[kind]["median_ms"] for row in rows], marker="o", label=kind)
    left.set_xlabel("position in the sequence")
    left.set_ylabel("ms per token (median)")
    left.set_title("time per generated token")
    left.legend()
    right.bar(list(KINDS), [memory[kind]["end_mib"] for kind in KINDS])
    right.set_ylabel("MiB")
    right.set_title("KV memory at the end")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
