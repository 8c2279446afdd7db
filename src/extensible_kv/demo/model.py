"""A tiny decoder-only transformer with paged attention, in plain torch.

Random weights (seeded), a few layers, grouped-query attention over a paged
KV cache: each layer's cache is a K/V-split tensor ``(2, num_blocks,
block_size, kv_heads, head_size)`` and each sequence owns a table of block
ids. One decode step has static shapes, so it can be captured in a CUDA
graph. It exists to drive the KV cache the way an engine does; the tokens it
makes mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from extensible_kv.kv.layouts.spec import AttentionSpec


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 32
    ffn: int = 256
    block_size: int = 16
    max_positions: int = 1024
    seed: int = 0

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.block_size, self.kv_heads, self.head_size, torch.float32)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyDecoder:
    """Weights and one decode step; the KV caches are passed in, never owned."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)

        # Gains chosen so that tokens vary and depend on the cache's contents:
        # a corrupted KV cache changes what the model says.
        def weight(*shape: int, gain: float = 3.0) -> torch.Tensor:
            values: torch.Tensor = torch.randn(*shape, generator=gen) * gain / shape[0] ** 0.5
            return values.to(device)

        c = config
        self.embed = weight(c.vocab, c.hidden, gain=0.5 * c.vocab**0.5)
        self.positions = weight(c.max_positions, c.hidden, gain=1.0)
        self.blocks = [
            {
                "q": weight(c.hidden, c.heads * c.head_size),
                "k": weight(c.hidden, c.kv_heads * c.head_size),
                "v": weight(c.hidden, c.kv_heads * c.head_size),
                "o": weight(c.heads * c.head_size, c.hidden),
                "up": weight(c.hidden, c.ffn),
                "down": weight(c.ffn, c.hidden),
            }
            for _ in range(c.layers)
        ]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Logits for one new token per sequence, writing its K and V.

        Shapes: tokens and positions ``(batch,)``, block tables ``(batch,
        max_blocks)``; each cache ``(2, num_blocks, block_size, kv_heads,
        head_size)``. Every block id in the tables must be committed.
        """
        c = self.config
        batch = tokens.shape[0]
        span = block_tables.shape[1] * c.block_size
        visible = torch.arange(span, device=tokens.device)[None, :] <= positions[:, None]
        slot_block = block_tables.gather(1, (positions // c.block_size)[:, None])[:, 0]
        slot_offset = positions % c.block_size
        x = self.embed[tokens] + self.positions[positions]
        for weights, cache in zip(self.blocks, caches, strict=True):
            h = _rms_norm(x)
            q = (h @ weights["q"]).view(batch, c.heads, c.head_size)
            k = (h @ weights["k"]).view(batch, c.kv_heads, c.head_size)
            v = (h @ weights["v"]).view(batch, c.kv_heads, c.head_size)
            cache[0][slot_block, slot_offset] = k
            cache[1][slot_block, slot_offset] = v
            keys = cache[0][block_tables].reshape(batch, span, c.kv_heads, c.head_size)
            values = cache[1][block_tables].reshape(batch, span, c.kv_heads, c.head_size)
            group = c.heads // c.kv_heads
            keys = keys.repeat_interleave(group, dim=2)
            values = values.repeat_interleave(group, dim=2)
            scores = torch.einsum("bhd,bshd->bhs", q, keys) / c.head_size**0.5
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            attended = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), values)
            x = x + attended.reshape(batch, -1) @ weights["o"]
            x = x + torch.relu(_rms_norm(x) @ weights["up"]) @ weights["down"]
        return _rms_norm(x) @ self.embed.T


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eager_step(model: TinyDecoder, caches: Sequence[torch.Tensor]) -> StepFn:
    def run(tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        return model.step(tokens, positions, tables, caches)

    return run


def graphed_step(
    model: TinyDecoder, caches: Sequence[torch.Tensor], batch: int, max_blocks: int
) -> StepFn:
    """The decode step captured once in a CUDA graph over ``caches``.

    The graph holds the caches' addresses: it stays valid while the KV cache
    grows, sleeps and wakes, since those addresses never change. Replays
    copy the inputs into the graph's static tensors.
    """
    device = caches[0].device
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    tables = torch.zeros(batch, max_blocks, dtype=torch.long, device=device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        model.step(tokens, positions, tables, caches)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.step(tokens, positions, tables, caches)

    def run(
        new_tokens: torch.Tensor, new_positions: torch.Tensor, new_tables: torch.Tensor
    ) -> torch.Tensor:
        tokens.copy_(new_tokens)
        positions.copy_(new_positions)
        tables.copy_(new_tables)
        graph.replay()
        return logits.clone()

    return run


def generate(
    step: StepFn,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    block_size: int,
    max_blocks: int,
    device: torch.device,
    ensure_blocks: Callable[[int], object] | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Greedy decoding of equal-length prompts, one position per step.

    Block ids are handed out lowest first, as an engine's allocator does:
    the ``j``-th block of sequence ``i`` is ``j * batch + i``, taken when the
    sequence first reaches it. ``ensure_blocks`` is called with the number of
    blocks in use before each step, as a runner's warm-up does.
    """
    batch, length = len(prompts), len(prompts[0])
    tables = torch.zeros(batch, max_blocks, dtype=torch.long)
    highest = 0
    out: list[list[int]] = [[] for _ in prompts]
    current = torch.tensor([p[0] for p in prompts])
    for position in range(length + new_tokens - 1):
        block = position // block_size
        if block >= max_blocks:
            raise ValueError(
                f"position {position} needs more than {max_blocks} blocks per sequence"
            )
        for i in range(batch):
            tables[i, block] = block * batch + i
        highest = max(highest, int(tables.max()) + 1)
        if ensure_blocks is not None:
            ensure_blocks(highest)
        logits = step(
            current.to(device),
            torch.full((batch,), position, device=device),
            tables.to(device),
        )
        chosen = logits.argmax(-1).cpu()
        if position + 1 < length:
            current = torch.tensor([p[position + 1] for p in prompts])
        else:
            current = chosen
            for i in range(batch):
                out[i].append(int(chosen[i]))
        if on_step is not None:
            on_step()
    return out
