"""A restart that keeps the prefix cache (option ``keep_prefix_cache_s``):
the scheduler's side.

vLLM stops the workers before the scheduler (``EngineCore.shutdown``), and
only the scheduler knows what the pages the workers left hold: as it
stops, it names each rank's keeper with the full blocks vLLM's pool names
(id, hash, tokens). An engine started again is built after its workers
adopted pages (vLLM makes the scheduler once the KV cache is initialized):
the scheduler reads what each rank adopted, and seeds vLLM's prefix cache
with the blocks every rank holds, free and cached, in units its plan
counts as held.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from extensible_kv.integrations.vllm.scheduler.plan import ElasticPlan
from extensible_kv.integrations.vllm.seam import (
    drop,
    kept_caches,
    kept_dir,
    name,
    ranges_of,
    units_of,
)

__all__ = ["name_kept", "seed_adopted"]

logger = logging.getLogger(__name__)


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
    blocks = []
    for block in pool.blocks:
        key, tokens = block.block_hash, block.block_hash_num_tokens
        if key is None or block.is_null or get_group_id(key) != 0:
            continue
        if not tokens or tokens % block_size or block.block_id // per not in units:
            continue
        blocks.append([block.block_id, get_block_hash(key).hex(), int(tokens)])
    for record in mine:
        name(record, blocks)
    logger.info("extensible-kv: %d prefix-cache blocks kept for a restart", len(blocks))


def seed_adopted(plan: ElasticPlan, pool: Any, block_size: int, vllm_config: Any) -> int:
    """Seed vLLM's prefix cache with what every rank's worker adopted
    (before the first step); the blocks seeded."""
    engine, dp = _engine(vllm_config)
    world = int(vllm_config.parallel_config.world_size)
    paths = [Path(kept_dir()) / f"adopted-{engine}-{dp}-{rank}.json" for rank in range(world)]
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
