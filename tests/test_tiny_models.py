"""The tiny random models engines load in tests, the example and the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from extensible_kv.demo.tiny_models import ARCHITECTURES, save_tiny_model


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_tiny_model_is_saved_once_with_grouped_kv_heads(
    architecture: str, tmp_path: Path
) -> None:
    path = save_tiny_model(architecture, tmp_path / architecture)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == architecture
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    weights = sorted(path.glob("*.safetensors"))
    assert weights
    stamp = weights[0].stat().st_mtime_ns
    assert save_tiny_model(architecture, path) == path
    assert weights[0].stat().st_mtime_ns == stamp  # kept, not made again


def test_an_unknown_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of llama, qwen3, got 'gpt2'"):
        save_tiny_model("gpt2", tmp_path)
