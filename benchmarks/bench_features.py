"""Benchmarks of the features beyond the in-tree cache, each against a baseline
measured in the same run (medians of interleaved repeats):

1. chunk policy: committing N bytes as one chunk per run vs fixed-size
   chunks (time, driver calls), then trimming to a third (time, bytes given
   back, bytes copied to map a straddling chunk again);
2. content-preserving sleep: ``release_physical(preserve=True)`` +
   ``recommit()`` of a cache vs a plain ``copy_`` of the same bytes to host
   memory and back (the roof);
3. background commit: a compute loop that needs a commit halfway, with the
   commit made synchronously vs with ``commit_async`` issued ahead.

    python benchmarks/bench_features.py [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from extensible_kv import ExtensibleTensor, StatisticsDriver, get_driver
from extensible_kv.bench.measure import MiB, timed
from extensible_kv.kv import KVCacheBuffers


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def chunk_policy(device: torch.device, size: int, repeats: int) -> dict[str, object]:
    granule = get_driver(device).granularity(device.index or 0, False)
    rows: dict[str, object] = {}
    for name, chunk in (
        ("one chunk per run", None),
        ("2-granule chunks", 2 * granule),
        ("16-granule chunks", 16 * granule),
    ):
        commit_s, trim_s, calls, released = [], [], 0, 0
        for _ in range(repeats):
            stats = StatisticsDriver(get_driver(device))
            et = ExtensibleTensor(size, device, driver=stats, chunk_bytes=chunk)
            commit_s.append(timed(lambda et=et: et.resize_(size), device))
            calls = sum(s.calls for s in stats.calls.values())
            before = et.physical_bytes
            trim_s.append(timed(lambda et=et: et.shrink_per_segment_(size // 3), device))
            released = before - et.physical_bytes
            et.free()
        rows[name] = {
            "commit_s": median(commit_s),
            "driver_calls_to_commit": calls,
            "trim_to_a_third_s": median(trim_s),
            "bytes_given_back": released,
        }
    return rows


def preserving_sleep(device: torch.device, size: int, repeats: int) -> dict[str, float]:
    """Sleep + wake with contents kept, with a fresh host copy each time and
    with the copy kept between sleeps, vs copying the bytes out and back."""
    per_block = 256 * 1024
    blocks = size // (3 * per_block)
    fresh, kept, roof = [], [], []
    for _ in range(repeats):
        buffers = [
            (ExtensibleTensor(blocks * per_block * 2, device, num_segments=2), per_block),
            (ExtensibleTensor(blocks * per_block, device), per_block),
        ]
        cache = KVCacheBuffers(buffers, blocks)
        cache.commit(blocks)
        fresh.append(
            timed(lambda c=cache: (c.release_physical(preserve=True), c.recommit()), device)
        )
        cache.release_physical(preserve=True)
        cache.recommit(keep_host_memory=True)
        kept.append(
            timed(
                lambda c=cache: (
                    c.release_physical(preserve=True),
                    c.recommit(keep_host_memory=True),
                ),
                device,
            )
        )
        cache.free()
        source = torch.ones(blocks * per_block * 3, dtype=torch.uint8, device=device)
        host = torch.zeros(source.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
        roof.append(timed(lambda s=source, h=host: (h.copy_(s), s.copy_(h)), device))
        del source, host
    moved = 2 * blocks * per_block * 3
    return {
        "bytes_each_way": moved // 2,
        "fresh_copy_s": median(fresh),
        "kept_copy_s": median(kept),
        "plain_copy_s": median(roof),
        "fresh_GBps": moved / median(fresh) / 1e9,
        "kept_GBps": moved / median(kept) / 1e9,
        "plain_copy_GBps": moved / median(roof) / 1e9,
        "fresh_fraction_of_roof": median(roof) / median(fresh),
        "kept_fraction_of_roof": median(roof) / median(kept),
    }


def background_commit(device: torch.device, repeats: int) -> dict[str, float]:
    per_block = 1 * MiB
    work = torch.randn(512, 512, device=device)

    def compute() -> None:
        out = work
        for _ in range(30):
            out = out @ work
            out = out / out.norm()

    sync_s, async_s = [], []
    for _ in range(repeats):
        for mode, samples in (("sync", sync_s), ("async", async_s)):
            cache = KVCacheBuffers([(ExtensibleTensor(512 * per_block, device), per_block)], 512)
            cache.commit(1)

            def step(cache: KVCacheBuffers = cache, mode: str = mode) -> None:
                if mode == "async":
                    future = cache.commit_async(384)
                    compute()
                    future.result().wait()
                else:
                    compute()
                    cache.commit(384)
                compute()

            samples.append(timed(step, device))
            cache.free()
    return {
        "sync_s": median(sync_s),
        "async_s": median(async_s),
        "speedup": median(sync_s) / median(async_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=384, help="bytes committed / slept (MiB)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = ExtensibleTensor(1, args.device).device
    torch.ones(2 * args.mib * MiB, dtype=torch.uint8, device=device)  # first touch, for both sides
    size = args.mib * MiB
    results: dict[str, object] = {"device": str(device), "torch": torch.__version__}
    print(f"device {device}, torch {torch.__version__}, {args.repeats} repeats, medians")

    print(f"\n1. committing {args.mib} MiB, then trimming to a third, by chunk policy")
    chunks = chunk_policy(device, size, args.repeats)
    for name, row in chunks.items():
        assert isinstance(row, dict)
        print(
            f"   {name:<18} commit {row['commit_s'] * 1e3:7.1f} ms in "
            f"{row['driver_calls_to_commit']:>4} driver calls; trim "
            f"{row['trim_to_a_third_s'] * 1e3:6.1f} ms, "
            f"{row['bytes_given_back'] / MiB:6.1f} MiB back"
        )
    results["chunk_policy"] = chunks

    print(f"\n2. preserving sleep + wake of {args.mib} MiB vs a plain copy out and back")
    sleep = preserving_sleep(device, size, args.repeats)
    print(
        f"   plain copy_ out and back {sleep['plain_copy_s'] * 1e3:7.1f} ms "
        f"({sleep['plain_copy_GBps']:.2f} GB/s)"
    )
    for label, key in (("fresh host copy", "fresh"), ("host copy kept", "kept")):
        print(
            f"   ours, {label:<16} {sleep[key + '_copy_s'] * 1e3:7.1f} ms "
            f"({sleep[key + '_GBps']:.2f} GB/s) -> {sleep[key + '_fraction_of_roof']:.0%} of it"
        )
    results["preserving_sleep"] = sleep

    print("\n3. a commit of 383 MiB halfway through compute: synchronous vs commit_async")
    overlap = background_commit(device, args.repeats)
    print(
        f"   synchronous {overlap['sync_s'] * 1e3:7.1f} ms, commit_async "
        f"{overlap['async_s'] * 1e3:7.1f} ms -> {overlap['speedup']:.2f}x"
    )
    results["background_commit"] = overlap
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
