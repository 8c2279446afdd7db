"""Generate with transformers on an ExtensibleCache: DynamicCache's tokens,
fixed addresses, memory that follows the sequence, a sleep between turns.

    pip install 'extensible-kv[transformers]'
    python examples/transformers_generate.py              # a tiny random Llama, CPU
    python examples/transformers_generate.py --new-tokens 500 --device cuda
    python examples/transformers_generate.py --static-shapes  # compiled on a GPU

The model is built from a small random-weight config (nothing is
downloaded). The same greedy generation runs twice, on DynamicCache and on
ExtensibleCache; the tokens must be equal. Then the chat sleeps (its cache
copied to host memory and released), wakes and answers a second turn, which
must match the turn of a cache that never slept. With ``--static-shapes``
the cache has StaticCache's shapes (uncommitted positions read zeros), and
on a GPU generate compiles its decode step once (CUDA graphs).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from extensible_kv.integrations.transformers import ExtensibleCache

MiB = 1 << 20


def generate(model: LlamaForCausalLM, cache: object, ids: torch.Tensor, new: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values is renamed in 5.2x
        out: torch.Tensor = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens per turn (200)")
    parser.add_argument(
        "--static-shapes", action="store_true", help="StaticCache's shapes, for a compiled step"
    )
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    )
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(1, config.vocab_size, (1, 16), device=device)
    follow_up = torch.randint(1, config.vocab_size, (1, 8), device=device)
    # Reserve for the model's whole context, as StaticCache would allocate:
    # only what the tokens take is committed.
    max_len = config.max_position_embeddings

    start = time.perf_counter()
    expected = generate(model, DynamicCache(config=config), prompt, args.new_tokens)
    dynamic_s = time.perf_counter() - start

    static = args.static_shapes
    cache = ExtensibleCache(max_cache_len=max_len, config=config, static_shapes=static)
    print(f"before the first token: {cache.physical_bytes} bytes of memory")
    start = time.perf_counter()
    turn1 = generate(model, cache, prompt, args.new_tokens)
    extensible_s = time.perf_counter() - start
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    print(
        f"turn 1: {int(cache.get_seq_length())} tokens, {cache.physical_bytes / MiB:.1f} MiB "
        f"committed of {sum(b.capacity_bytes for b, _ in cache.cache.tensors) / MiB:.1f} "
        f"MiB reserved; {extensible_s:.2f} s (DynamicCache {dynamic_s:.2f} s)"
    )
    if not torch.equal(turn1, expected):
        raise SystemExit("MISMATCH: tokens differ from DynamicCache's")

    cache.release_physical(preserve=True)  # sleep: tokens to host memory
    print(f"asleep: {cache.physical_bytes} bytes of memory")
    cache.recommit()  # wake, at the same addresses
    turn2_ids = torch.cat([turn1, follow_up], dim=1)
    turn2 = generate(model, cache, turn2_ids, args.new_tokens)
    if [layer.keys.data_ptr() for layer in cache.layers] != addresses:
        raise SystemExit("MOVED: the keys changed address")

    never_slept = ExtensibleCache(max_cache_len=max_len, config=config, static_shapes=static)
    generate(model, never_slept, prompt, args.new_tokens)
    if not torch.equal(turn2, generate(model, never_slept, turn2_ids, args.new_tokens)):
        raise SystemExit("MISMATCH: the second turn differs from a cache that never slept")
    print(f"turn 2: {int(cache.get_seq_length())} tokens, {cache.physical_bytes / MiB:.1f} MiB")
    print("ok: DynamicCache's tokens, fixed addresses, same second turn after a sleep")
    cache.free()
    never_slept.free()


if __name__ == "__main__":
    main()
