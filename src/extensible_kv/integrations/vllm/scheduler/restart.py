"""A restart that keeps the prefix cache (option ``keep_prefix_cache_s``):
the scheduler's side.

vLLM stops the workers before the scheduler (``EngineCore.shutdown``), and
only the scheduler knows what the pages the workers left hold: as it
stops, it names each rank's keeper with the full blocks vLLM's pool names
(id, hash, tokens). In case the engine is killed before that (the OpenAI
server stopped with Ctrl-C: :meth:`ExtensibleKVScheduler._name_at_stop`),
it has written the same names to a file as its loop stopped, for the
keepers to take. An engine started again is built after its workers
adopted pages (vLLM makes the scheduler once the KV cache is initialized):
the scheduler reads what each rank adopted, and seeds vLLM's prefix cache
with the blocks every rank holds, free and cached, in units its plan
counts as held.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any

import psutil  # vLLM's dependency
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from extensible_kv.integrations.vllm.kept_files import adopted_path, names_path
from extensible_kv.integrations.vllm.scheduler.plan import ElasticPlan
from extensible_kv.integrations.vllm.seam import (
    drop,
    kept_caches,
    kept_dir,
    name,
    ranges_of,
    units_of,
)

__all__ = ["check_stop_keeps", "forget_names", "name_kept", "seed_adopted", "write_names"]

logger = logging.getLogger(__name__)


def check_stop_keeps(vllm_config: Any) -> None:
    """Refuse ``keep_prefix_cache_s`` where the engine's stop can keep
    nothing: vLLM's OpenAI server with ``--shutdown-timeout 0``, its default.

    At its stop (SIGTERM, Ctrl-C) that server gives its engine-core process
    ``shutdown_timeout`` seconds to exit before it kills it and every
    worker, and 0 kills them at once: no worker hands its pages to its
    keeper, and no scheduler names them (vLLM 0.32's
    ``entrypoints/launchers/launcher.py``; an ``LLM`` gives its engine 5 s
    whatever the option). Raises ValueError naming the flag."""
    if int(vllm_config.shutdown_timeout) > 0 or not _client_is_vllm_server():
        return
    raise ValueError(
        "additional_config['extensible_kv']['keep_prefix_cache_s'] is set, but vLLM's OpenAI "
        "server started with --shutdown-timeout 0 (its default) kills its engine at once when "
        "it stops, and nothing would be kept; start it with --shutdown-timeout 10"
    )


def _client_is_vllm_server() -> bool:
    """Whether this engine core's parent process is vLLM's OpenAI server
    (``vllm serve ...``, ``python -m vllm.entrypoints.openai.api_server``)."""
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return False
    if any(arg.startswith("vllm.entrypoints.") for arg in argv):
        return True
    return any(
        os.path.basename(arg) == "vllm" and nxt == "serve" for arg, nxt in itertools.pairwise(argv)
    )


def _engine(vllm_config: Any) -> tuple[int, int]:
    """This engine as its workers name it (``worker/restart.py``'s ``owner``)."""
    return os.getpid(), int(vllm_config.parallel_config.data_parallel_index)


def name_kept(pool: Any, block_size: int, vllm_config: Any) -> None:
    """Name the pages this engine's workers left with the full blocks the
    pool names in their units; drop them if a rank left none (a partial
    set can never be adopted alike on every rank)."""
    engine, dp = _engine(vllm_config)
    mine = [
        r
        for r in kept_caches()
        if isinstance(r.owner, dict) and (r.owner.get("engine"), r.owner.get("dp")) == (engine, dp)
    ]
    if not mine:
        return
    if len(mine) != int(vllm_config.parallel_config.world_size):
        for record in mine:
            drop(record.keeper_pid)
        logger.warning("extensible-kv: not every rank kept its prefix cache; none is kept")
        return
    units = set.intersection(*(set(units_of(r.owner["units"])) for r in mine))
    per = int(mine[0].owner["blocks_per_unit"])
    blocks = [b for b in _full_blocks(pool, block_size) if b[0] // per in units]
    for record in mine:
        name(record, blocks)
    forget_names(vllm_config)
    logger.info("extensible-kv: %d prefix-cache blocks kept for a restart", len(blocks))


def _full_blocks(pool: Any, block_size: int) -> list[list[Any]]:
    """``[block id, hash (hex), tokens]`` of each full block vLLM's prefix
    cache names (``pool``: its ``BlockPool``)."""
    blocks = []
    for block in pool.blocks:
        key, tokens = block.block_hash, block.block_hash_num_tokens
        if key is None or block.is_null or get_group_id(key) != 0:
            continue
        if tokens and not tokens % block_size:
            blocks.append([block.block_id, get_block_hash(key).hex(), int(tokens)])
    return blocks


def write_names(pool: Any, block_size: int, vllm_config: Any) -> None:
    """Write the full blocks vLLM's prefix cache names, in every unit, to
    this engine's :func:`names_path`, whole or not at all: a keeper whose
    scheduler exited before it named the pages names them from there (an
    adopting engine seeds only the blocks in units every rank kept)."""
    engine, dp = _engine(vllm_config)
    path = names_path(engine, dp)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(_full_blocks(pool, block_size)))
    os.replace(partial, path)


def forget_names(vllm_config: Any) -> None:
    """Remove this engine's :func:`write_names` file (named, or gone stale)."""
    names_path(*_engine(vllm_config)).unlink(missing_ok=True)


def _forget_names_of_the_dead() -> None:
    """Remove the names files of engines that have exited (their keepers
    read them when those exited)."""
    for path in kept_dir().glob("names-*-*.json"):
        engine = int(path.name.split("-")[1])
        if not psutil.pid_exists(engine):
            path.unlink(missing_ok=True)


def seed_adopted(plan: ElasticPlan, pool: Any, block_size: int, vllm_config: Any) -> int:
    """Seed vLLM's prefix cache with what every rank's worker adopted
    (before the first step); the blocks seeded."""
    engine, dp = _engine(vllm_config)
    world = int(vllm_config.parallel_config.world_size)
    _forget_names_of_the_dead()
    paths = [adopted_path(engine, dp, rank) for rank in range(world)]
    told = []
    for path in paths:
        if path.exists():
            told.append(json.loads(path.read_text()))
            os.unlink(path)
    if len(told) != world or any(t["blocks_per_unit"] != plan.blocks_per_unit for t in told):
        return 0  # the first orders give back whatever some rank adopted
    units = set.intersection(*(set(units_of(t["units"])) for t in told)) - {0}
    per, seen, cached = plan.blocks_per_unit, set(), []
    for block_id, hex_hash, tokens in sorted(told[0]["blocks"], key=lambda b: -b[2]):
        if not 0 < block_id < len(pool.blocks) or block_id in seen:
            continue
        if block_id // per not in units | {0} or tokens <= 0 or tokens % block_size:
            continue
        block = pool.blocks[block_id]
        if block.is_null or block.ref_cnt or block.block_hash is not None:
            continue
        seen.add(block_id)
        cached.append((block, bytes.fromhex(hex_hash), tokens))
    plan.adopt(ranges_of(units), ())
    for block, digest, tokens in cached:
        # BlockPool has no public way in; vLLM's own offloading manager
        # inserts hashes through this method too (simple_kv_offload).
        pool._insert_block_hash(make_block_hash_with_group_id(digest, 0), block, num_tokens=tokens)
    plan.adopt((), [block for block, _, _ in cached])
    logger.info("extensible-kv: %d prefix-cache blocks adopted from a stopped engine", len(cached))
    return len(cached)
