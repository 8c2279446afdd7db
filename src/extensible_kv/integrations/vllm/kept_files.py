"""The files a restarting engine's sides leave each other in the kept
folder (``keep_prefix_cache_s``), one place for their names:

- each worker, at start, what its rank adopted, for its scheduler to seed
  vLLM's prefix cache with (:func:`adopted_path`);
- the scheduler, as its loop stops, the names of the prefix cache's full
  blocks, for the keepers to read if the engine is killed before the
  scheduler names their pages itself (:func:`names_path`).

Engines are told apart by the engine-core process's pid and the
data-parallel index, ranks by their rank.
"""

from __future__ import annotations

from pathlib import Path

from extensible_kv.integrations.vllm.seam import kept_dir

__all__ = ["adopted_path", "names_path"]


def adopted_path(engine: int, dp: int, rank: int) -> Path:
    """Where rank ``rank`` of engine ``engine`` tells its scheduler what it adopted."""
    return kept_dir() / f"adopted-{engine}-{dp}-{rank}.json"


def names_path(engine: int, dp: int) -> Path:
    """Where engine ``engine``'s scheduler writes its blocks' names as its loop stops."""
    return kept_dir() / f"names-{engine}-{dp}.json"
