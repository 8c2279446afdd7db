"""ExtensibleCache inside Hugging Face transformers: greedy, padded, beam and
assisted generation give DynamicCache's tokens; addresses never move; memory
follows the sequence; a chat can sleep between turns."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from extensible_kv import (  # noqa: E402
    FaultInjectingDriver,
    StatisticsDriver,
    get_driver,
    granule_size,
)
from extensible_kv.integrations.transformers import ExtensibleCache  # noqa: E402

VOCAB = 96
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
}
ARCHITECTURES: dict[str, Callable[[], Any]] = {
    "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=4)),
    "qwen3-gqa": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8)),
    "mistral-gqa": lambda: MistralForCausalLM(
        MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None)
    ),
}


def model_of(name: str, device: str = "cpu") -> Any:
    torch.manual_seed(0)
    return ARCHITECTURES[name]().to(device).eval()


def prompts(batch: int, length: int = 9, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, left-padded: row ``i`` has ``i`` padding tokens."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :row] = 0
        ids[row, :row] = 0
    return ids.to(device), mask.to(device)


def generate(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        # transformers 5.2x renames past_key_values to cache; both work.
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_are_dynamic_caches(
    name: str, batch: int, real_device: str, static_shapes: bool
) -> None:
    model = model_of(name, real_device)
    ids, mask = prompts(batch, device=real_device)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=40)
    cache = ExtensibleCache(max_cache_len=64, config=model.config, static_shapes=static_shapes)
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=40), expected)
    assert cache.get_seq_length() == ids.shape[1] + 40 - 1
    cache.free()


class Watch(LogitsProcessor):  # type: ignore[misc]
    """Looks at the cache after every step of generate."""

    def __init__(self, cache: ExtensibleCache, look: Callable[[ExtensibleCache], None]) -> None:
        self.cache = cache
        self.look = look

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.look(self.cache)
        return scores


def test_a_thousand_tokens_at_fixed_addresses_with_the_memory_of_the_sequence(
    real_device: str,
) -> None:
    # Rows of 1 KiB a token per tensor, and room for 8x the sequence: a
    # cache that committed ahead of the tokens would show.
    torch.manual_seed(0)
    config = Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=64)
    model = Qwen3ForCausalLM(config).to(real_device).eval()
    ids, mask = prompts(2, device=real_device)
    new = 1000
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=new)
    cache = ExtensibleCache(max_cache_len=8 * (ids.shape[1] + new), config=model.config)
    assert cache.physical_bytes == 0, "before the first token: reservations only"
    text = model.config
    token_bytes = 2 * text.num_key_value_heads * text.head_dim * 4  # batch 2, float32
    granule = granule_size(real_device)
    addresses: set[tuple[int, ...]] = set()
    steps = 0

    def look(cache: ExtensibleCache) -> None:
        nonlocal steps
        steps += 1
        addresses.add(tuple(p for layer in cache.layers for p in pointers(layer)))
        dynamic = 2 * len(cache.layers) * cache.get_seq_length() * token_bytes
        # DynamicCache's bytes, plus at most one granule per tensor (K, V) per layer.
        assert cache.physical_bytes <= dynamic + 2 * len(cache.layers) * granule
        for layer in cache.layers:  # kernels see committed positions only
            assert layer.keys.shape[-2] == layer.get_seq_length()

    out = generate(
        model,
        cache,
        ids,
        mask,
        max_new_tokens=new,
        logits_processor=LogitsProcessorList([Watch(cache, look)]),
    )
    assert torch.equal(out, expected)
    assert steps == new
    assert len(addresses) == 1, "keys and values never moved"
    cache.free()


def pointers(layer: Any) -> tuple[int, int]:
    return layer.keys.data_ptr(), layer.values.data_ptr()


@pytest.mark.parametrize("static_shapes", [False, True])
def test_beam_search_reorders_in_place(real_device: str, static_shapes: bool) -> None:
    model = model_of("llama-mha", real_device)
    ids, mask = prompts(2, device=real_device)
    expected = generate(
        model, DynamicCache(config=model.config), ids, mask, max_new_tokens=12, num_beams=3
    )
    cache = ExtensibleCache(max_cache_len=32, config=model.config, static_shapes=static_shapes)
    out = generate(model, cache, ids, mask, max_new_tokens=12, num_beams=3)
    assert torch.equal(out, expected)
    cache.free()


@pytest.mark.parametrize("static_shapes", [False, True])
def test_assisted_decoding_crops(real_device: str, static_shapes: bool) -> None:
    model = model_of("llama-mha", real_device)
    torch.manual_seed(5)
    assistant = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": 1}))
    assistant = assistant.to(real_device).eval()
    ids, mask = prompts(1, device=real_device)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=24)
    cache = ExtensibleCache(max_cache_len=64, config=model.config, static_shapes=static_shapes)
    cropped: list[int] = []
    crop = cache.crop

    def recording_crop(tokens_to_remove: int) -> None:
        cropped.append(tokens_to_remove)
        crop(tokens_to_remove)

    cache.crop = recording_crop  # type: ignore[method-assign]
    out = generate(model, cache, ids, mask, max_new_tokens=24, assistant_model=assistant)
    assert torch.equal(out, expected), "assisted greedy decoding is greedy decoding"
    assert any(n < 0 for n in cropped), "the assistant's rejected tokens were cropped"
    cache.free()


@pytest.mark.parametrize("static_shapes", [False, True])
def test_reset_gives_memory_back_and_the_cache_serves_again(
    real_device: str, static_shapes: bool
) -> None:
    model = model_of("mistral-gqa", real_device)
    ids, mask = prompts(1, device=real_device)
    cache = ExtensibleCache(max_cache_len=64, config=model.config, static_shapes=static_shapes)
    first = generate(model, cache, ids, mask, max_new_tokens=20)
    pointers_before = [pointers(layer) for layer in cache.layers]
    cache.reset()
    assert cache.physical_bytes == 0
    assert cache.get_seq_length() == 0
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=20), first)
    assert [pointers(layer) for layer in cache.layers] == pointers_before
    cache.free()


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("preserve", [True, False])
def test_a_chat_sleeps_between_turns(preserve: bool, real_device: str, static_shapes: bool) -> None:
    model = model_of("qwen3-gqa", real_device)
    ids, mask = prompts(1, device=real_device)
    follow_up = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    follow_up = follow_up.to(real_device)

    def chat(cache: ExtensibleCache, sleep: bool) -> torch.Tensor:
        turn1 = generate(model, cache, ids, mask, max_new_tokens=15)
        if sleep:
            cache.release_physical(preserve=preserve)
            assert cache.physical_bytes == 0
            cache.recommit()
        turn2_ids = torch.cat([turn1, follow_up], dim=1)
        return generate(model, cache, turn2_ids, torch.ones_like(turn2_ids), max_new_tokens=15)

    awake = ExtensibleCache(max_cache_len=128, config=model.config, static_shapes=static_shapes)
    expected = chat(awake, sleep=False)
    slept = ExtensibleCache(max_cache_len=128, config=model.config, static_shapes=static_shapes)
    assert torch.equal(chat(slept, sleep=True), expected)
    awake.free()
    slept.free()


def test_what_it_cannot_do_is_named() -> None:
    model = model_of("llama-mha")
    ids, mask = prompts(1)
    cache = ExtensibleCache(max_cache_len=12, config=model.config)
    with pytest.raises(ValueError, match="max_cache_len=12"):
        generate(model, cache, ids, mask, max_new_tokens=10)
    layer = cache.layers[0]
    with pytest.raises(NotImplementedError, match="batch_repeat_interleave"):
        layer.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError, match="offload"):
        layer.offload()
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(3)
    with pytest.raises(ValueError, match="max_cache_len must be positive"):
        ExtensibleCache(max_cache_len=0)
    cache.free()


def test_layers_made_as_the_model_reaches_them() -> None:
    model = model_of("llama-mha")
    ids, mask = prompts(2)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=10)
    cache = ExtensibleCache(max_cache_len=32)
    assert len(cache.layers) == 0
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=10), expected)
    assert len(cache.layers) == model.config.num_hidden_layers
    cache.free()


def test_early_initialization_reserves_and_commits_nothing(real_device: str) -> None:
    """As for export: the layers reserve before the first forward, and the
    generation then runs at those addresses."""
    model = model_of("qwen3-gqa", real_device)
    ids, mask = prompts(2, device=real_device)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=10)
    cache = ExtensibleCache(max_cache_len=32, config=model.config)
    config = model.config
    heads, dim = config.num_key_value_heads, config.head_dim
    cache.early_initialization(2, heads, dim, torch.float32, torch.device(real_device))
    assert cache.physical_bytes == 0
    reserved = [buffer.base_ptr for buffer, _ in cache.buffers.tensors]
    assert len(reserved) == 2 * config.num_hidden_layers
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=10), expected)
    assert [buffer.base_ptr for buffer, _ in cache.buffers.tensors] == reserved
    assert [layer.keys.data_ptr() for layer in cache.layers] == reserved[::2]
    cache.free()


def test_sliding_window_layers_keep_every_token_and_the_same_tokens() -> None:
    """A sliding-window model's mask limits what attention sees; the cache
    keeps every token (the memory of a full layer)."""
    torch.manual_seed(0)
    config = MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=8)
    model = MistralForCausalLM(config).eval()
    ids, mask = prompts(1, length=12)
    expected = generate(model, DynamicCache(config=config), ids, mask, max_new_tokens=30)
    cache = ExtensibleCache(max_cache_len=64, config=config)
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=30), expected)
    assert cache.layers[0].keys.shape[-2] == 12 + 30 - 1
    cache.free()


def test_a_layer_that_cannot_reserve_leaves_nothing_behind() -> None:
    """Keys reserved, values refused: the keys' reservation goes too."""
    model = model_of("llama-mha")
    ids, mask = prompts(1)
    stats = StatisticsDriver(get_driver("cpu"))
    faulty = FaultInjectingDriver(stats)
    cache = ExtensibleCache(max_cache_len=32, config=model.config, driver=faulty)
    faulty.fail_at("reserve", nth=2)
    with pytest.raises(Exception, match="injected"):
        generate(model, cache, ids, mask, max_new_tokens=4)
    assert len(cache.buffers.tensors) == 0
    assert stats.live.reservations == 0
    cache.free()


def test_batch_select_keeps_the_rows_in_place() -> None:
    """Cache.batch_select_indices (no generate path of 5.2x calls it, code
    that filters a batch does): the kept rows move to the front, in place,
    and later tokens go to the kept rows."""
    cache = ExtensibleCache(max_cache_len=16)
    keys = torch.arange(3 * 2 * 4 * 8, dtype=torch.float32).view(3, 2, 4, 8)
    cache.update(keys, -keys, 0)
    base = cache.layers[0].keys.data_ptr()
    cache.batch_select_indices(torch.tensor([2, 0]))
    layer = cache.layers[0]
    assert torch.equal(layer.keys, keys[[2, 0]])
    assert torch.equal(layer.values, -keys[[2, 0]])
    assert layer.keys.data_ptr() == base
    more = torch.ones(2, 2, 1, 8)
    out_keys, _ = cache.update(more, more, 0)
    assert out_keys.shape == (2, 2, 5, 8)
    assert torch.equal(out_keys[:, :, 4], more[:, :, 0])
    cache.free()


def test_static_shapes_need_the_config() -> None:
    with pytest.raises(ValueError, match="static_shapes=True needs the model's config"):
        ExtensibleCache(max_cache_len=16, static_shapes=True)


def test_a_compiled_decode_step_is_one_graph_replayed_as_the_cache_grows(
    real_device: str,
) -> None:
    """One graph, no graph break, no recompile, over 200 steps that commit
    memory as they go; DynamicCache's tokens; reads past the tokens are zeros.

    On the host the step is traced by dynamo (backend "eager"); on a GPU it
    is generate's own compile: inductor with CUDA graphs ("reduce-overhead").
    """
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    from extensible_kv.driver.host import HostDriver

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=64))
    model = model.to(real_device).eval()
    ids, mask = prompts(2, device=real_device)
    new = 200
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=new)
    if real_device == "cpu":
        # 64 KiB granules hold 64 tokens of 1 KiB: the step commits as it goes.
        driver: Any = HostDriver(granularity=1 << 16)
        config = CompileConfig(backend="eager", mode=None, fullgraph=True)
        config._compile_all_devices = True
    else:
        driver, config = None, CompileConfig(fullgraph=True)
    cache = ExtensibleCache(
        max_cache_len=512, config=model.config, static_shapes=True, driver=driver
    )
    seen: list[tuple[int, int, tuple[int, int]]] = []

    def look(c: ExtensibleCache) -> None:
        seen.append((int(c.get_seq_length()), c.physical_bytes, pointers(c.layers[0])))

    torch._dynamo.reset()
    counters.clear()
    out = generate(
        model,
        cache,
        ids,
        mask,
        max_new_tokens=new,
        compile_config=config,
        logits_processor=LogitsProcessorList([Watch(cache, look)]),
    )
    assert torch.equal(out, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert len({p for _, _, p in seen}) == 1, "keys and values never moved"
    granule = cache.buffers.tensors[0][0].buffer.granularity
    tensors = 2 * model.config.num_hidden_layers
    for tokens, physical, _ in seen:
        dynamic = tensors * tokens * 2 * 2 * 64 * 4
        assert physical <= dynamic + tensors * granule
    assert seen[-1][1] > seen[0][1], "the compiled steps committed memory"
    layer = cache.layers[0]
    held = int(cache.get_seq_length())
    assert layer.keys.shape[2] == 512
    assert int(layer.keys[:, :, held:].count_nonzero()) == 0, "past the tokens: zeros"
    assert int(layer.keys[:, :, :held].count_nonzero()) > 0
    cache.free()


def test_prepare_commits_ahead_for_a_step_captured_by_hand() -> None:
    """A step captured by hand replays without its host side: prepare(n)
    commits n positions from the host, for layers made later too."""
    from extensible_kv.driver.host import HostDriver

    model = model_of("llama-mha")
    ids, mask = prompts(1)
    # 4 KiB granules hold 32 tokens of 128 bytes (4 heads of 8 floats).
    cache = ExtensibleCache(
        max_cache_len=64, config=model.config, static_shapes=True, driver=HostDriver(4096)
    )
    with pytest.raises(ValueError, match="num_tokens must be 0 to max_cache_len=64"):
        cache.prepare(65)
    cache.prepare(20)
    assert cache.physical_bytes == 0, "no layer is made before the first token"
    generate(model, cache, ids, mask, max_new_tokens=2)
    tensors = 2 * model.config.num_hidden_layers
    assert cache.physical_bytes == tensors * 4096, "20 positions: 1 granule a tensor"
    cache.prepare(40)
    assert cache.physical_bytes == tensors * 2 * 4096, "40 positions: 2 granules a tensor"
    cache.reset()
    assert cache.physical_bytes == 0
    cache.free()
