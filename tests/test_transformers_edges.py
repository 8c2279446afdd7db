"""ExtensibleCache at its edges (issue 24): what a static cache reads past
its tokens, what a refused step leaves, what a sleeping or freed cache
survives, what a sleep and a reset give back, and which beam indices a
reorder takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig  # noqa: E402

from child import run_python  # noqa: E402
from extensible_kv import (  # noqa: E402
    ExtensibleTensor,
    PoolingDriver,
    StatisticsDriver,
    get_driver,
)
from extensible_kv.driver import Driver, HostDriver  # noqa: E402
from extensible_kv.integrations.transformers import ExtensibleCache  # noqa: E402
from gpusim import SimMachine  # noqa: E402
from test_transformers import SMALL, generate, model_of, prompts  # noqa: E402

GRANULE = 4096
#: Two layers of 4 heads of 8: as the tiny Llama of ``model_of``.
TINY = LlamaConfig(**SMALL, num_key_value_heads=4)


def states(batch: int, tokens: int, seed: int, heads: int = 4, dim: int = 8) -> torch.Tensor:
    """Random keys (or values) of ``tokens`` positions, ``[batch, heads, tokens, dim]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, dim, generator=generator)


def step(cache: ExtensibleCache, new: torch.Tensor) -> None:
    """One forward's updates: every layer, in order, as a model makes them."""
    for layer in range(len(cache.layers)):
        cache.update(new + layer, -new - layer, layer)


def past_the_tokens(cache: ExtensibleCache) -> list[int]:
    """Per layer, the nonzero (or NaN) elements of keys and values at the
    positions past the tokens held."""
    held = int(cache.get_seq_length())
    return [
        int(layer.keys[:, :, held:].count_nonzero() + layer.values[:, :, held:].count_nonzero())
        for layer in cache.layers
    ]


def dirty_pool(granule: int) -> PoolingDriver:
    """A pool over the host driver whose idle handles hold NaN, as reused
    memory holds whatever its last user wrote."""
    pool = PoolingDriver(HostDriver(granule))
    dirty = ExtensibleTensor(64 * granule, "cpu", driver=pool, chunk_bytes=granule)
    dirty.resize_(64 * granule).view(torch.float32).fill_(float("nan"))
    dirty.free()
    assert pool.idle_handles == 64
    return pool


# -- item 3: a static cache reads zeros past its tokens, always ---------------


def test_static_shapes_over_reused_memory_read_zeros_past_the_tokens() -> None:
    """Batch 3 of 4 heads of 8 floats: 384-byte positions, so position 10
    straddles the end of a 4 KiB granule; the pool's handles hold NaN. A mask
    cannot cancel NaN: before the fix every generated token was 0."""
    model = model_of("llama-mha")
    ids, mask = prompts(3)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=10)
    pool = dirty_pool(GRANULE)
    cache = ExtensibleCache(
        max_cache_len=64, config=model.config, static_shapes=True, driver=pool, chunk_bytes=GRANULE
    )
    out = generate(model, cache, ids, mask, max_new_tokens=10)
    assert pool.hits > 0, "the cache reused the dirty handles"
    assert past_the_tokens(cache) == [0, 0]
    assert torch.equal(out, expected)
    cache.free()


def test_static_shapes_on_the_simulator_read_zeros_past_the_tokens(
    simulated: tuple[Driver, SimMachine],
) -> None:
    """New GPU memory holds garbage (the simulator's 0xA5). Positions of 48
    KiB (batch 3, 4 heads of 1024 floats): position 42 straddles the end of
    the first 2 MiB granule, 85 the second's. Checked after the prefill (for
    the layer that commits and for the one that joins at that count), after
    growing past a granule, and after a preserving sleep (the wake maps
    fresh memory too)."""
    driver, machine = simulated
    cache = ExtensibleCache(max_cache_len=128, config=TINY, static_shapes=True, driver=driver)
    step(cache, states(3, 9, seed=0, dim=1024))
    assert past_the_tokens(cache) == [0, 0], "the prefill's granule"
    for seed in range(1, 40):
        step(cache, states(3, 1, seed=seed, dim=1024))
    assert int(cache.get_seq_length()) == 48
    assert past_the_tokens(cache) == [0, 0], "the second granule"
    cache.release_physical(preserve=True)
    cache.recommit()
    assert past_the_tokens(cache) == [0, 0], "after the wake"
    assert machine.sticky is None
    cache.free()


def test_a_static_crop_zeroes_the_positions_it_forgets() -> None:
    cache = ExtensibleCache(max_cache_len=32, config=TINY, static_shapes=True)
    step(cache, states(2, 10, seed=0))
    cache.crop(-4)
    assert int(cache.get_seq_length()) == 6
    assert past_the_tokens(cache) == [0, 0]
    step(cache, states(2, 1, seed=1))
    assert int(cache.get_seq_length()) == 7
    assert past_the_tokens(cache) == [0, 0]
    cache.free()


# -- item 6: a refused step changes nothing -----------------------------------


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize(
    ("batch", "heads", "dim"), [(2, 4, 8), (3, 2, 8), (3, 4, 16)], ids=["batch", "heads", "dim"]
)
def test_a_refused_step_changes_nothing(
    static_shapes: bool, batch: int, heads: int, dim: int
) -> None:
    """A step of the wrong shape is refused before the count moves: the
    next correct generate gives the tokens of a cache that never saw it."""
    model = model_of("llama-mha")
    ids, mask = prompts(3)
    refused = ExtensibleCache(max_cache_len=64, config=model.config, static_shapes=static_shapes)
    clean = ExtensibleCache(max_cache_len=64, config=model.config, static_shapes=static_shapes)
    first = generate(model, refused, ids, mask, max_new_tokens=4)
    assert torch.equal(generate(model, clean, ids, mask, max_new_tokens=4), first)
    held = int(refused.get_seq_length())
    bad = states(batch, 1, seed=3, heads=heads, dim=dim)
    with pytest.raises(ValueError, match="the cache holds"):
        refused.update(bad, bad, 0)
    assert int(refused.get_seq_length()) == held
    longer = torch.ones_like(first)
    assert torch.equal(
        generate(model, refused, first, longer, max_new_tokens=6),
        generate(model, clean, first, longer, max_new_tokens=6),
    )
    refused.free()
    clean.free()


def test_a_static_step_of_another_dtype_is_refused_before_the_count_moves() -> None:
    """``index_copy_`` converts no dtype: the step is refused up front."""
    cache = ExtensibleCache(max_cache_len=16, config=TINY, static_shapes=True)
    step(cache, states(2, 5, seed=0))
    wide = states(2, 1, seed=1).double()
    with pytest.raises(ValueError, match=r"the cache holds keys of torch\.float32"):
        cache.update(wide, wide, 0)
    assert int(cache.get_seq_length()) == 5
    assert past_the_tokens(cache) == [0, 0]
    cache.free()


# -- item 7: no call kills the process while asleep (or after free) -----------


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_cache_put_to_sleep_before_its_first_token_serves(static_shapes: bool) -> None:
    """The first update wakes it, as any update does."""
    model = model_of("llama-mha")
    ids, mask = prompts(2)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=6)
    cache = ExtensibleCache(max_cache_len=32, config=model.config, static_shapes=static_shapes)
    cache.release_physical(preserve=True)
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=6), expected)
    cache.free()


#: Every public call of the cache and its layers that a sleeping (or freed)
#: cache may see, on a cache holding 5 positions of a batch of 2 in 2 layers.
#: Run in a child: before the fix, touching the released memory was SIGSEGV.
ASLEEP_AND_FREED = """
import torch
from transformers import LlamaConfig
from extensible_kv.integrations.transformers import ExtensibleCache

config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)

def new(tokens, seed):
    return torch.randn(2, 4, tokens, 8, generator=torch.Generator().manual_seed(seed))

def step(cache, states):
    for layer in range(2):
        cache.update(states + layer, -states - layer, layer)

def filled(static):
    cache = ExtensibleCache(16, config, static_shapes=static)
    step(cache, new(5, 0))
    return cache

CALLS = {
    "update": lambda c: step(c, new(1, 1)),
    "reorder_cache": lambda c: c.reorder_cache(torch.tensor([1, 0])),
    "layer.reorder_cache": lambda c: c.layers[1].reorder_cache(torch.tensor([1, 0])),
    "batch_select_indices": lambda c: c.batch_select_indices(torch.tensor([1])),
    "layer.batch_select_indices": lambda c: c.layers[0].batch_select_indices(torch.tensor([1])),
    "crop": lambda c: c.crop(-2),
    "reset": lambda c: c.reset(),
    "prepare": lambda c: c.prepare(8),
    "get_seq_length": lambda c: c.get_seq_length(),
    "get_mask_sizes": lambda c: c.get_mask_sizes(1, 0),
    "batch_repeat_interleave": lambda c: c.batch_repeat_interleave(2),
    "release_physical": lambda c: c.release_physical(),
    "recommit": lambda c: c.recommit(),
}

def outcome(call, cache):
    try:
        call(cache)
    except (ValueError, NotImplementedError) as error:
        return type(error).__name__
    return "done"

def contents(cache):
    held = int(cache.get_seq_length())
    return [(layer.keys[:, :, :held].clone(), layer.values[:, :, :held].clone())
            for layer in cache.layers if layer.is_initialized]

for static in (False, True):
    for name, call in CALLS.items():
        awake, slept = filled(static), filled(static)
        slept.release_physical(preserve=True)
        expected, got = outcome(call, awake), outcome(call, slept)
        assert got == expected, (static, name, got, expected)
        slept.recommit()
        assert int(slept.get_seq_length()) == int(awake.get_seq_length()), (static, name)
        for (k1, v1), (k2, v2) in zip(contents(awake), contents(slept), strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), (static, name)
        print("asleep", static, name, got, flush=True)
        freed = filled(static)
        freed.free()
        print("freed", static, name, outcome(call, freed), flush=True)
"""


def test_no_call_kills_the_process_while_asleep_or_freed() -> None:
    """Asleep, every call does what it does on a cache that never slept
    (those that touch the memory wake it first); freed, every call that
    would touch the memory raises ValueError naming the free."""
    child = run_python(ASLEEP_AND_FREED)
    assert child.returncode == 0, child.stdout + child.stderr
    lines = child.stdout.splitlines()
    assert len(lines) == 2 * 2 * 13, child.stdout
    touching = ("update", "reorder_cache", "batch_select_indices", "prepare", "recommit")
    for line in lines:
        state, _, name, outcome = line.split()
        if state == "freed" and name.removeprefix("layer.") in touching:
            assert outcome in ("ValueError", "NotImplementedError"), line
    # A crop with static shapes zeroes the positions it forgets; without,
    # it only moves the count.
    assert "freed True crop ValueError" in lines
    assert "freed True update ValueError" in lines
    assert "freed False reorder_cache ValueError" in lines


# -- item 10: a sleep gives every byte back -------------------------------------


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("preserve", [False, True])
def test_a_sleep_leaves_no_idle_handle_in_the_pool_under_the_cache(
    static_shapes: bool, preserve: bool
) -> None:
    model = model_of("llama-mha")
    ids, mask = prompts(2)
    stats = StatisticsDriver(get_driver("cpu"))
    pool = PoolingDriver(stats)
    cache = ExtensibleCache(
        max_cache_len=64, config=model.config, static_shapes=static_shapes, driver=pool
    )
    generate(model, cache, ids, mask, max_new_tokens=6)
    assert stats.live.handles > 0
    cache.release_physical(preserve=preserve)
    assert cache.physical_bytes == 0
    assert pool.idle_handles == 0
    assert stats.live.handles == 0, "every byte went back to the driver"
    cache.free()


# -- item 11: a reset forgets, asleep or not ----------------------------------


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_reset_during_a_preserving_sleep_forgets(static_shapes: bool) -> None:
    """The host copy goes at the reset, and the next update brings back
    nothing old: the memory holds its tokens only, as a fresh cache's."""
    cache = ExtensibleCache(
        max_cache_len=64, config=TINY, static_shapes=static_shapes, driver=HostDriver(GRANULE)
    )
    fresh = ExtensibleCache(
        max_cache_len=64, config=TINY, static_shapes=static_shapes, driver=HostDriver(GRANULE)
    )
    step(cache, states(2, 40, seed=0))
    cache.release_physical(preserve=True)
    assert cache.buffers.host_backup_bytes > 0
    cache.reset()
    assert cache.buffers.host_backup_bytes == 0
    assert cache.physical_bytes == 0
    assert int(cache.get_seq_length()) == 0
    one = states(2, 1, seed=1)
    step(cache, one)
    step(fresh, one)
    assert cache.physical_bytes == fresh.physical_bytes
    for tensor, row in cache.buffers.tensors:
        committed = tensor.full_view()[row : tensor.bytes_per_segment]
        assert int(committed.count_nonzero()) == 0, "no old token came back"
    cache.recommit()
    assert cache.physical_bytes == fresh.physical_bytes, "nothing left to wake"
    cache.free()
    fresh.free()


# -- item 12: a beam index gives every row a row -------------------------------


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("beams", [[1], [2, 0], [0, 1, 2, 0], [0, 3, 1], [0, -1, 1], [[0, 1, 2]]])
def test_a_reorder_needs_one_beam_index_per_row(static_shapes: bool, beams: Any) -> None:
    cache = ExtensibleCache(max_cache_len=16, config=TINY, static_shapes=static_shapes)
    step(cache, states(3, 5, seed=0))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with pytest.raises(ValueError, match="one beam index in 0 to 2 per row of the batch of 3"):
        cache.reorder_cache(torch.tensor(beams))
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys)
        assert torch.equal(layer.values, values)
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.layers[1].keys, before[1][0][[2, 2, 0]])
    cache.free()


# -- one word: release_physical is a sleep, preserving or not --------------------


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_discarding_release_is_a_sleep_and_the_next_step_wakes_it_empty(
    static_shapes: bool,
) -> None:
    """``release_physical()`` without ``preserve`` puts the cache to sleep
    (asleep, no memory, no tokens); the next step wakes it with only what
    that step needs, as a fresh cache holds."""
    cache = ExtensibleCache(
        max_cache_len=64, config=TINY, static_shapes=static_shapes, driver=HostDriver(GRANULE)
    )
    fresh = ExtensibleCache(
        max_cache_len=64, config=TINY, static_shapes=static_shapes, driver=HostDriver(GRANULE)
    )
    step(cache, states(2, 40, seed=0))
    cache.release_physical()
    assert (cache.cache.asleep, cache.physical_bytes, int(cache.get_seq_length())) == (True, 0, 0)
    one = states(2, 1, seed=1)
    step(cache, one)
    step(fresh, one)
    assert not cache.cache.asleep
    assert cache.physical_bytes == fresh.physical_bytes
    cache.free()
    fresh.free()
