"""Tiny random Hugging Face models, made offline, for engines to load.

Nothing is downloaded: the weights are random, from a fixed seed, so every
run of an engine on them is comparable token for token. Needs the
``transformers`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: The architectures on offer: a GQA Llama and a Qwen3 (q/k norms), each
#: with heads of 32 (a size vLLM's CPU attention accepts).
ARCHITECTURES = ("llama", "qwen3")


def save_tiny_model(
    architecture: str, directory: str | Path, *, num_layers: int = 2, num_kv_heads: int = 2
) -> Path:
    """Write a tiny random ``architecture`` model (one of :data:`ARCHITECTURES`)
    to ``directory`` (made if missing) and return it; an existing model there
    is kept. Twice ``num_kv_heads`` query heads share ``num_kv_heads`` KV
    heads of 32 (more KV heads: more KV bytes per token, the same small
    hidden size); vocabulary of 512."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}"
        )
    path = Path(directory)
    if (path / "config.json").exists():
        return path
    shape: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2 * num_kv_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": 32,
        "max_position_embeddings": 1024,
    }
    torch.manual_seed(0)
    model: LlamaForCausalLM | Qwen3ForCausalLM
    if architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=False))
    model.save_pretrained(path)
    return path
