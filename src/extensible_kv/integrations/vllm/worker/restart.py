"""A restart that keeps the prefix cache (option ``keep_prefix_cache_s``):
the worker's side.

At KV init the worker starts a keeper ahead (vLLM gives an engine 5 s to
stop, and a keeper takes one or two to start). As the engine stops, the
worker gives back every unit no step wrote since its commit (free blocks
kept ahead: nothing the prefix cache names) and leaves the rest to the
keeper, unnamed; the scheduler, which vLLM stops after the workers, names
them with vLLM's block hashes (``scheduler/restart.py``). An engine started
again with the same :func:`fingerprint` adopts the pages before it commits
anything, books their units, and writes what it adopted where its
scheduler reads it at construction, to seed vLLM's prefix cache.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from extensible_kv.integrations.vllm.kept_files import adopted_path, names_path
from extensible_kv.integrations.vllm.options import Options
from extensible_kv.integrations.vllm.seam import (
    ElasticBlocks,
    KVCacheBuffers,
    SpareKeeper,
    adopt,
    drop,
    kept_caches,
    ranges_of,
    start_keeper,
    units_of,
)

__all__ = ["Restart", "adopter", "fingerprint", "owner"]

logger = logging.getLogger(__name__)


def fingerprint(vllm_config: Any, kv_cache_config: Any, cache: KVCacheBuffers) -> dict[str, Any]:
    """What must be equal for an engine to adopt another's pages: the
    model and its numbers, how vLLM hashes blocks, this rank's place, and
    the reservation's geometry (where each block's bytes lie)."""
    import vllm

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    (group,) = kv_cache_config.kv_cache_groups
    return {
        "vllm": vllm.__version__,
        "model": str(model.model),
        "revision": model.revision,
        "dtype": str(model.dtype),
        "cache_dtype": str(cache_config.cache_dtype),
        "block_size": int(group.kv_cache_spec.block_size),
        "hash": str(cache_config.prefix_caching_hash_algo),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "tensor_parallel": int(parallel.tensor_parallel_size),
        "pipeline_parallel": int(parallel.pipeline_parallel_size),
        "rank": int(parallel.rank),
        "capacity_blocks": cache.num_blocks_capacity,
        "tensors": [
            [tensor.max_num_bytes, tensor.num_segments, per_block]
            for tensor, per_block in cache.tensors
        ],
    }


def owner(vllm_config: Any) -> dict[str, Any]:
    """This rank of this engine, in words its scheduler finds again: the
    pid of the engine-core process (the scheduler's), which is this one's
    parent under vLLM's multiprocessing executor and this one under its
    single-process one. (``vllm_config.instance_id`` would not do: vLLM
    draws it again whenever a config is rebuilt.)"""
    parallel = vllm_config.parallel_config
    engine = os.getppid() if parallel.distributed_executor_backend == "mp" else os.getpid()
    return {"engine": engine, "dp": int(parallel.data_parallel_index), "rank": int(parallel.rank)}


def adopter(
    restart: Restart | None, vllm_config: Any, kv_cache_config: Any, cache: KVCacheBuffers
) -> Callable[[ElasticBlocks], frozenset[int]] | None:
    """What adopts into ``cache``'s elastic blocks before they start (None:
    no ``restart``)."""
    if restart is None:
        return None
    return functools.partial(
        restart.adopt, fingerprint=fingerprint(vllm_config, kv_cache_config, cache)
    )


class Restart:
    """One worker's keeper and its fingerprint, for ``keep_s`` seconds."""

    def __init__(self, keep_s: float, vllm_config: Any) -> None:
        self.keep_s = keep_s
        self.owner = owner(vllm_config)
        self.fingerprint: dict[str, Any] | None = None
        self._spare: SpareKeeper | None = start_keeper()

    @classmethod
    def of(cls, options: Options, vllm_config: Any) -> Restart | None:
        """The restart ``options`` ask for (None: ``keep_prefix_cache_s`` unset)."""
        keep_s = options.keep_prefix_cache_s
        return None if keep_s is None else cls(keep_s, vllm_config)

    def adopt(self, elastic: ElasticBlocks, fingerprint: dict[str, Any]) -> frozenset[int]:
        """Before ``elastic.start()``: adopt the pages a stopped engine with
        the same ``fingerprint`` left, book their units and tell the
        scheduler; the units adopted (none: nothing was there)."""
        self.fingerprint = fingerprint
        tensors = [tensor for tensor, _ in elastic.cache.tensors]
        found = adopt(tensors, fingerprint)
        if found is None:
            self._drop_stale(fingerprint)
            return frozenset()
        left_by = found.owner
        units = frozenset(units_of(left_by["units"]))
        elastic.adopted(left_by["units"], int(left_by["blocks_per_unit"]))
        me = self.owner
        with open(adopted_path(me["engine"], me["dp"], me["rank"]), "w") as told:
            json.dump(
                {
                    "units": left_by["units"],
                    "blocks_per_unit": left_by["blocks_per_unit"],
                    "blocks": found.blocks,
                },
                told,
            )
        logger.info(
            "extensible-kv: adopted %d kept blocks in %d units (%d bytes) of a stopped engine",
            len(found.blocks),
            len(units),
            found.nbytes,
        )
        return units

    def _drop_stale(self, fingerprint: dict[str, Any]) -> None:
        """Give back the pages kept from this model, for this rank, under
        another fingerprint (another block size, dtype, vLLM...): this
        engine can never adopt them, and it took the model's place."""
        for record in kept_caches():
            theirs = record.fingerprint
            if (
                record.blocks is not None
                and theirs != fingerprint
                and (theirs.get("model"), theirs.get("rank"))
                == (fingerprint["model"], fingerprint["rank"])
            ):
                drop(record.keeper_pid)
                logger.info(
                    "extensible-kv: gave back the prefix cache kept under another fingerprint "
                    "(keeper %d)",
                    record.keeper_pid,
                )

    def leave(self, elastic: ElasticBlocks, written: set[int]) -> None:
        """As the engine stops: give back the held units no step wrote, and
        leave the rest to the keeper, unnamed, for the scheduler to name.
        If the scheduler's process exits first, the keeper takes the names
        it wrote as its loop stopped, or gives the pages back if none."""
        spare, self._spare = self._spare, None
        if spare is None or self.fingerprint is None or elastic.cache.asleep:
            if spare is not None:
                spare.close()
            return
        keep = written & elastic.held
        elastic.give_back(elastic.held - keep)
        me = {
            **self.owner,
            "units": ranges_of(keep),
            "blocks_per_unit": elastic.blocks_per_unit,
        }
        tensors = [tensor for tensor, _ in elastic.cache.tensors]
        try:
            spare.leave(
                tensors,
                self.fingerprint,
                None,
                self.keep_s,
                owner=me,
                namer_pid=me["engine"],
                names_path=str(names_path(me["engine"], me["dp"])),
            )
        except (RuntimeError, ValueError) as exc:
            logger.warning("extensible-kv: the prefix cache was not kept for a restart: %s", exc)
        finally:
            spare.close()
