"""A released vLLM on extensible-kv: its KV cache in our memory, sleep that frees it.

One string, on a CPU build of vLLM and on a CUDA build alike::

    LLM(model, worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker")

The worker subclasses vLLM's own (``CPUWorker`` on CPU, ``Worker`` on a
GPU) and changes three things, through vLLM's hooks:

- **Allocation.** ``initialize_from_config`` lays vLLM's KV cache config
  out at a capacity (an upper bound of blocks: address space only), reserves
  it with :func:`~extensible_kv.kv.allocate_kv_cache`, commits vLLM's block
  count and hands the reservation to vLLM as the KV cache's backing buffer
  (see :mod:`~extensible_kv.integrations.vllm_handover`). vLLM then makes
  its own views, shapes, strides, dtypes and kernel blocks over it and binds
  them as usual.
- **Sleep and wake.** ``sleep(level >= 1)`` and ``discard(("kv_cache",))``
  release every byte of KV physical memory; ``wake_up()`` and
  ``wake_up(tags=["kv_cache"])`` commit it again, zeroed, at the same
  addresses. Weights go through vLLM's own path (the parent's) where vLLM's
  sleep mode is on, on a GPU; on CPU they stay resident.
- **A sleep that keeps the prefix cache.** After ``llm.sleep(level=0)``
  (scheduler paused, caches kept), ``collective_rpc("sleep_kv_cache",
  kwargs={"preserve": True})`` copies the KV blocks to host memory and
  releases every byte; ``collective_rpc("wake_kv_cache")`` puts them back,
  and ``llm.wake_up(tags=["scheduling"])`` resumes serving from the same
  prefix cache.
- **Inspection.** ``llm.collective_rpc("extensible_kv_state")`` gives each
  worker's figures (:meth:`ExtensibleKVWorker.extensible_kv_state`).

Options go in ``LLM(..., additional_config={"extensible_kv": {...}})``:
``num_blocks_capacity`` (blocks to reserve address space for; default: as
many as the device's total memory holds) and ``growth`` (``"static"``:
commit vLLM's block count at start; ``"on_demand"``: commit blocks as the
scheduler hands their ids out, before the step that uses them, and
``collective_rpc("trim_kv_cache")`` gives memory back when idle;
``"elastic"``: with ``scheduler_cls=
"extensible_kv.integrations.vllm.ExtensibleKVScheduler"``, the memory
follows the load up and down, as the scheduler orders, see
:mod:`extensible_kv.integrations.vllm_scheduler`) and ``cache_bytes``
(``"elastic"``: the most memory kept for the prefix cache). Without
virtual memory management on the device, the worker falls back to vLLM's
own allocation with one warning.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import logging
import math
import os
import warnings
from typing import Any

import torch

from extensible_kv import granule_size, unavailable_reason, waiting_for_budget
from extensible_kv._checks import check_bool, check_int
from extensible_kv.integrations.vllm_support import check_vllm_version, installed_vllm
from extensible_kv.kv import KVCache, OnDemandGrowth, allocate_kv_cache, at_capacity
from extensible_kv.kv.elastic import ElasticBlocks, ElasticOrders, ElasticReport
from extensible_kv.kv.strided import segmentation

check_vllm_version(installed_vllm())

from vllm import envs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from extensible_kv.integrations.vllm_client import client_pid, watch_client  # noqa: E402
from extensible_kv.integrations.vllm_connectors import release_refusal  # noqa: E402
from extensible_kv.integrations.vllm_handover import HandOver  # noqa: E402
from extensible_kv.integrations.vllm_options import (  # noqa: E402
    GROWTH_MODES,
    OPTIONS,
    options_of,
)
from extensible_kv.integrations.vllm_scheduler import ExtensibleKVScheduler  # noqa: E402
from extensible_kv.integrations.vllm_steps import ended, scheduled_block_ids  # noqa: E402

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _VllmWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _VllmWorker

logger = logging.getLogger(__name__)

#: What ``extensible_kv_state`` returns per worker (keys users rely on).
STATE_KEYS = (
    "reserved_bytes",
    "committed_bytes",
    "physical_bytes",
    "num_blocks_committed",
    "num_blocks_capacity",
    "base_ptrs",
    "asleep",
    "host_backup_bytes",
    "growth",
    "high_water_blocks",
    "sizing",
)

__all__ = ["GROWTH_MODES", "OPTIONS", "STATE_KEYS", "ExtensibleKVScheduler", "ExtensibleKVWorker"]


def _total_memory(device: torch.device) -> int:
    """Bytes of memory the device has: what bounds a capacity by default."""
    if device.type == "cpu":
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(torch.cuda.mem_get_info(device)[1])


class ExtensibleKVWorker(_VllmWorker):  # type: ignore[misc]
    """vLLM's worker with its KV cache on extensible-kv (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv: KVCache | None = None
        self._growth: OnDemandGrowth | None = None
        self._elastic: ElasticBlocks | None = None
        #: The scheduler's last orders (growth "elastic"), the units the
        #: scheduler counts as held after them, and the report on them that
        #: goes back with this step's output.
        self._orders: ElasticOrders | None = None
        self._holding: ElasticOrders | None = None
        self._report: ElasticReport | None = None
        self._handover: HandOver | None = None
        #: The measurement that sized the cache (determine_available_memory),
        #: and whether the reservation it made waits for vLLM's final count.
        self._sizing: dict[str, int] | None = None
        self._provisional = False
        self._layout: Any = None
        #: Whether a sleep took the KV cache from its connector (vLLM 0.33+),
        #: to be registered again on the wake.
        self._connector_unregistered = False

    def init_device(self) -> None:
        """vLLM's, then the watch on the engine's client: an orphaned engine
        shuts down and gives its memory back (``integrations/vllm_client.py``)."""
        super().init_device()
        client = client_pid(envs.VLLM_PROCESS_NAME_PREFIX)
        if client is not None:
            watch_client(client)

    # -- options ------------------------------------------------------------------

    def _options(self) -> dict[str, Any]:
        return options_of(self.vllm_config)

    def _growth_mode(self) -> str:
        return str(self._options().get("growth", "static"))

    def _capacity(self, config: Any, bytes_per_block: int) -> int:
        """Blocks to reserve address space for: the option, else as many as
        the device's memory holds; never below vLLM's count."""
        num_blocks = int(config.num_blocks)
        asked = self._options().get("num_blocks_capacity")
        if asked is None:
            capacity = max(num_blocks, _total_memory(self.device) // bytes_per_block)
            if self._growth_mode() == "elastic":
                # Every layer's segment starts on a granule, so that a unit
                # of blocks takes the same granules in each.
                row = segmentation(config).row_bytes
                step = granule_size(self.device) // math.gcd(granule_size(self.device), row)
                capacity = -(-capacity // step) * step
            return capacity
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < num_blocks:
            raise ValueError(
                f"additional_config['extensible_kv']['num_blocks_capacity'] is {asked!r}, "
                f"below the {num_blocks} blocks vLLM sized the KV cache to; give an int "
                f"of at least {num_blocks}"
            )
        return asked

    # -- sizing from what warm-up used ---------------------------------------------

    def determine_available_memory(self) -> int:
        """Bytes vLLM may give the KV cache. With an explicit size
        (``kv_cache_memory_bytes``, ``VLLM_CPU_KVCACHE_SPACE``) or a KV
        connector, vLLM's own answer. Otherwise the seed's flow: reserve the
        cache at its capacity, commit a small prefix, run vLLM's warm-up
        over it, measure what everything besides the KV cache holds, and
        answer the budget minus that. vLLM then sizes its block count from
        the answer, and :meth:`initialize_from_config` commits it in the
        same reservation."""
        explicit = self.cache_config.kv_cache_memory_bytes is not None
        if explicit or self._has_connector() or unavailable_reason(self.device) is not None:
            return int(super().determine_available_memory())
        self._reserve_provisional()
        assert self._kv is not None
        self._warm_up()
        budget, used = self._budget_and_used()
        non_kv = used - self._kv.buffers.physical_bytes
        available = budget - non_kv
        warm_up_blocks = self._kv.buffers.num_blocks_committed
        self._sizing = {
            "budget_bytes": budget,
            "non_kv_bytes": non_kv,
            "available_kv_bytes": available,
            "warm_up_blocks": warm_up_blocks,
        }
        logger.info(
            "extensible-kv: warm-up ran over %d KV blocks; everything else holds %d bytes, "
            "so %d of the %d-byte budget go to the KV cache",
            warm_up_blocks,
            non_kv,
            available,
            budget,
        )
        # vLLM's own way out of a KV cache made for profiling: the views go,
        # the reservation stays for the final count.
        self.model_runner._cleanup_profiling_kv_cache()
        self._provisional = True
        return available

    def _reserve_provisional(self) -> None:
        """Reserve at the capacity and commit the blocks warm-up needs:
        one per sequence vLLM may batch, as vLLM's own profiling KV cache."""
        from vllm.v1.core.kv_cache_utils import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )

        groups = get_kv_cache_groups(self.vllm_config, self.model_runner.get_kv_cache_spec())
        saved = self.cache_config.num_gpu_blocks_override
        self.cache_config.num_gpu_blocks_override = max(
            1, self.vllm_config.scheduler_config.max_num_seqs
        )
        try:
            provisional = get_kv_cache_config_from_groups(
                self.vllm_config, groups, available_memory=0
            )
        finally:
            self.cache_config.num_gpu_blocks_override = saved
        self.initialize_from_config(provisional)

    def _warm_up(self) -> None:
        """vLLM's warm-up, over the committed prefix: a dummy forward of the
        largest batch; on a GPU also compilation and CUDA-graph capture."""
        if current_platform.is_cpu():
            self.model_runner.warming_up_model()
            return
        self.model_runner.profile_run()
        self.compile_or_warm_up_model()

    def _budget_and_used(self) -> tuple[int, int]:
        """The memory vLLM may use (``gpu_memory_utilization`` of the
        device, or of the host's NUMA node) and what this worker uses now,
        in bytes."""
        if current_platform.is_cpu():
            # What vLLM's CPU worker measures too (psutil is vLLM's dependency).
            import psutil

            return int(self.requested_cpu_memory), int(psutil.Process().memory_info().rss)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization)
        return budget, int(self.init_snapshot.free_memory) - int(free)

    # -- allocation ----------------------------------------------------------------

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Reserve the KV cache at its capacity, commit vLLM's block count,
        and let vLLM build and bind its views over it. After the measuring
        warm-up (:meth:`determine_available_memory`) the reservation is the
        one warm-up ran in: the final count is committed under the same
        addresses."""
        if self._provisional:
            self._commit_final(kv_cache_config)
            return
        if self._kv is not None:
            raise ValueError(
                "this worker's KV cache is already reserved; extensible-kv makes one "
                "reservation per worker (free the engine and build a new one)"
            )
        reason = unavailable_reason(self.device)
        if reason is not None:
            warnings.warn(
                f"extensible-kv: virtual memory is unavailable on {self.device} ({reason}); "
                f"vLLM allocates its KV cache itself and sleep is vLLM's own",
                RuntimeWarning,
                stacklevel=2,
            )
            super().initialize_from_config(kv_cache_config)
            return
        num_blocks = int(kv_cache_config.num_blocks)
        capacity = self._capacity(kv_cache_config, segmentation(kv_cache_config).size_bytes(1))
        layout = at_capacity(kv_cache_config, capacity)
        # vLLM's views and block tables keep its count; the strides are the capacity's.
        runner_config = dataclasses.replace(layout, num_blocks=num_blocks)
        self._check_connector_pool(runner_config)
        kv = allocate_kv_cache(
            layout,
            device=self.device,
            shareable=self._has_connector(),
            # Elastic memory gives single granules back: one chunk each.
            chunk_bytes=granule_size(self.device) if self._growth_mode() == "elastic" else None,
        )
        try:
            self._kv, self._layout = kv, layout
            self._commit_and_hand_over(runner_config)
        except BaseException:
            self._kv = self._growth = self._elastic = None
            kv.free()
            raise
        if self._has_connector():
            kv.buffers.register_external(self._connector_name())
        logger.info(
            "extensible-kv: %d of %d blocks committed (%d bytes reserved; vLLM's count %d)",
            kv.buffers.num_blocks_committed,
            capacity,
            kv.buffers.reserved_bytes,
            num_blocks,
        )

    def _commit_and_hand_over(self, runner_config: Any) -> None:
        """Commit vLLM's count (with on-demand growth, the first step) and
        let vLLM build and bind its views over the reservation."""
        assert self._kv is not None
        buffers, num_blocks = self._kv.buffers, int(runner_config.num_blocks)
        growth = self._growth_mode()
        if growth == "on_demand":
            # Memory follows the ids the scheduler hands out (execute_model).
            self._growth = OnDemandGrowth(buffers, num_blocks)
            self._growth.start()
        elif growth == "elastic":
            # Memory follows the scheduler's orders (execute_model), in
            # units of granules, not as the prefix the allocation committed.
            buffers.clear()
            self._elastic = ElasticBlocks(buffers, num_blocks)
            self._elastic.start()
        else:
            buffers.commit(num_blocks, defragment=self._has_connector())
        self._handover = HandOver(self._kv.backing[0])
        try:
            super().initialize_from_config(runner_config)
            if not self._handover.used:
                raise RuntimeError(
                    "vLLM allocated its KV cache outside the worker's allocation context; "
                    "extensible-kv cannot place it"
                )
        finally:
            self._handover = None

    def _commit_final(self, kv_cache_config: Any) -> None:
        """vLLM's final count, in the reservation the measuring warm-up ran in."""
        assert self._kv is not None
        num_blocks = int(kv_cache_config.num_blocks)
        capacity = self._kv.buffers.num_blocks_capacity
        if num_blocks > capacity:
            raise ValueError(
                f"vLLM sized the KV cache to {num_blocks} blocks, past the {capacity} reserved; "
                f"raise additional_config['extensible_kv']['num_blocks_capacity']"
            )
        layout = at_capacity(kv_cache_config, capacity)
        # What places memory; the engine's settings (layout name, hash
        # block size) reach the final config only.
        differ = [
            name
            for name in ("kv_cache_tensors", "kv_cache_groups")
            if getattr(layout, name) != getattr(self._layout, name)
        ]
        if differ:
            raise RuntimeError(
                f"vLLM's final KV cache layout differs from the one its warm-up ran over "
                f"({', '.join(differ)}); extensible-kv cannot commit it in the same reservation"
            )
        self._provisional = False
        # Warm-up wrote into its blocks; vLLM's cache starts as zeros.
        self._kv.buffers.clear()
        self._commit_and_hand_over(dataclasses.replace(layout, num_blocks=num_blocks))
        logger.info(
            "extensible-kv: %d blocks committed after warm-up, under the same addresses",
            self._kv.buffers.num_blocks_committed,
        )

    def _maybe_get_memory_pool_context(self, tag: str) -> Any:
        """vLLM's hook for where an allocation goes: the KV cache's goes to
        our reservation; every other tag goes where vLLM puts it."""
        if tag == "kv_cache" and self._handover is not None:
            return self._handover
        return super()._maybe_get_memory_pool_context(tag)

    # -- connectors ----------------------------------------------------------------

    def _has_connector(self) -> bool:
        return self.vllm_config.kv_transfer_config is not None

    def _check_connector_pool(self, runner_config: Any) -> None:
        """Refuse a connector that brings its own KV memory pool (Mooncake's
        NVLink): vLLM would allocate the cache there, outside our reservation.
        The connector is made here, as vLLM's worker makes it (once)."""
        if not self._has_connector():
            return
        from vllm.distributed.kv_transfer import (
            ensure_kv_transfer_initialized,
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        ensure_kv_transfer_initialized(self.vllm_config, runner_config)
        if has_kv_transfer_group() and get_kv_transfer_group().get_mem_pool_context() is not None:
            raise ValueError(
                f"{self._connector_name()} brings a memory pool of its own for the KV cache; "
                f"extensible-kv cannot place the cache there (run it without worker_cls)"
            )

    def _connector_name(self) -> str:
        config = self.vllm_config.kv_transfer_config
        return f"vLLM KV connector {getattr(config, 'kv_connector', None) or 'configured'}"

    # -- sleep and wake ----------------------------------------------------------

    def _parent_sleeps(self) -> bool:
        """Whether vLLM's own sleep handles the weights: on a GPU with vLLM's
        sleep mode on (on CPU, vLLM's sleep does nothing)."""
        return not current_platform.is_cpu() and bool(
            self.vllm_config.model_config.enable_sleep_mode
        )

    def _connector(self) -> Any:
        """This worker's KV connector, or None."""
        if not self._has_connector():
            return None
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def _release_kv(self, what: str) -> None:
        assert self._kv is not None
        connector = self._connector()
        if connector is not None:
            reason = release_refusal(type(connector), self.vllm_config.kv_transfer_config)
            if reason is not None:
                raise RuntimeError(
                    f"{what} would discard the KV cache, which {self._connector_name()} has "
                    f"registered for transfers; {reason}. Sleep at level 0, or run without "
                    f"the connector"
                )
            connector.unregister_kv_caches()
            try:
                self._kv.buffers.release_physical()
            except BaseException:
                connector.restore_kv_caches()  # the memory stayed: so does its registration
                raise
            self._connector_unregistered = True
            return
        self._kv.buffers.release_physical()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: at level 1 and 2 the KV cache's physical memory is
        released, its contents discarded (vLLM has reset the prefix cache);
        the weights follow vLLM's own path where vLLM's sleep mode is on."""
        if self._kv is None:
            super().sleep(level)
            return
        if level >= 1:
            self._release_kv(f"sleep(level={level})")
        if self._parent_sleeps():
            super().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Commit the KV cache again (``tags`` None or with ``"kv_cache"``),
        zeroed, at the same addresses; the weights as vLLM does."""
        if self._kv is None:
            super().wake_up(tags)
            return
        if tags is None or "kv_cache" in tags:
            self._wake_kv()
            if self._connector_unregistered:  # the memory is back: register it again
                self._connector().restore_kv_caches()
                self._connector_unregistered = False
        if self._parent_sleeps():
            super().wake_up(tags)

    def _wake_kv(self, wait_s: float | None = None) -> None:
        """Commit the KV cache again: what it held, or with on-demand growth
        the first step after a discarding sleep (vLLM reset its prefix cache).

        Under a device budget (``extensible-kv limit``) that another engine
        fills, the commit waits up to ``wait_s`` seconds (default: the
        ``budget_wait_s`` option) for room, then raises
        :class:`~extensible_kv.BudgetExceededError` with the cache still
        asleep, so a later wake can try again."""
        assert self._kv is not None
        if wait_s is None:
            wait_s = float(self._options().get("budget_wait_s", 0))
        with waiting_for_budget(wait_s):
            if self._elastic is not None:
                self._elastic.wake()
            elif self._growth is not None:
                self._growth.wake()
            else:
                self._kv.buffers.recommit()

    def discard(self, tags: tuple[str, ...]) -> None:
        """Drop tagged memory without a backup: ``"kv_cache"`` releases the
        KV cache (vLLM's ``release_kv_cache_memory``); other tags go to vLLM."""
        if self._kv is None:
            super().discard(tags)
            return
        if "kv_cache" in tags:
            self._release_kv("discard(('kv_cache',))")
        rest = tuple(tag for tag in tags if tag != "kv_cache")
        if rest:
            super().discard(rest)

    # -- a sleep that keeps the prefix cache -----------------------------------------

    def _managed(self, what: str) -> KVCache:
        """The worker's KV cache, or a RuntimeError saying why ``what`` has none."""
        if self._kv is None:
            raise RuntimeError(
                f"{what}: extensible-kv does not hold this worker's KV cache (virtual "
                f"memory is unavailable on {self.device}, so vLLM allocated it itself)"
            )
        return self._kv

    def sleep_kv_cache(self, preserve: bool = False) -> None:
        """Release every byte of KV physical memory, for
        ``llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": True})``
        after ``llm.sleep(level=0)`` (which pauses the scheduler and keeps
        vLLM's prefix cache).

        With ``preserve`` the committed blocks are copied to host memory
        first and :meth:`wake_kv_cache` puts them back, so the prefix cache
        still holds after the wake. Without, the contents are discarded:
        call ``llm.reset_prefix_cache()`` before resuming, or vLLM would
        serve cached prefixes from zeroed blocks. Idempotent.
        """
        check_bool("preserve", preserve)
        kv = self._managed("sleep_kv_cache")
        if preserve and self._elastic is not None:
            raise RuntimeError(
                "sleep_kv_cache(preserve=True) keeps a committed prefix, and growth 'elastic' "
                "holds scattered units: sleep without preserve (and reset the prefix cache), "
                "or use growth 'on_demand' or 'static'"
            )
        if self._has_connector():
            raise RuntimeError(
                f"sleep_kv_cache would release the KV cache, which {self._connector_name()} "
                f"has registered for transfers; a connector's peers learn of a cache "
                f"registered again only through vLLM's own wake_up (vLLM 0.33 and later). "
                f"Use llm.sleep(level=1) there, or run without the connector"
            )
        kv.buffers.release_physical(preserve=preserve)

    def wake_kv_cache(self, wait_s: float | None = None) -> None:
        """Commit the KV cache again at the same addresses, with what a
        preserving :meth:`sleep_kv_cache` kept (zeroed otherwise); then
        ``llm.wake_up(tags=["scheduling"])`` resumes the scheduler. Does
        nothing while awake. Under a device budget, waits up to ``wait_s``
        seconds (default: the ``budget_wait_s`` option) for another engine
        to give memory back; :class:`~extensible_kv.BudgetExceededError`
        after that leaves the cache asleep."""
        self._managed("wake_kv_cache")
        self._wake_kv(wait_s)

    def trim_kv_cache(self, num_blocks: int | None = None) -> int:
        """Give back the KV memory past ``num_blocks`` blocks (default: past
        the blocks of the requests still running), for
        ``llm.collective_rpc("trim_kv_cache", args=(n,))``; returns the
        blocks still committed. Needs ``growth: "on_demand"``.

        Call it after ``llm.reset_prefix_cache()``: vLLM's prefix cache may
        name any block, and a trimmed block reads zero when it comes back.
        Blocks of running requests are never trimmed (a smaller count is a
        ValueError naming them).
        """
        self._managed("trim_kv_cache")
        if self._elastic is not None:
            raise RuntimeError(
                "trim_kv_cache is for growth 'on_demand': with growth 'elastic' the scheduler "
                "gives memory back by itself, within a step of the load falling"
            )
        if self._growth is None:
            raise RuntimeError(
                "trim_kv_cache needs additional_config={'extensible_kv': {'growth': "
                "'on_demand'}}: with static growth vLLM may use every block it was given"
            )
        in_use = self._blocks_in_use()
        if num_blocks is None:
            num_blocks = in_use
        check_int("num_blocks", num_blocks)
        if num_blocks < in_use:
            raise ValueError(
                f"trim_kv_cache({num_blocks}) would drop blocks that running requests "
                f"use (up to block {in_use - 1}); keep at least {in_use}"
            )
        return self._growth.trim(num_blocks)

    def _blocks_in_use(self) -> int:
        """One past the highest block id of the requests still running.

        vLLM's runner lists a finished request until the next step tells it
        so (``finished_req_ids``), and an engine stepped in-process takes no
        step after ``generate`` returns: a request whose last token ended
        it (its ``max_tokens``, the model's length, a stop token) is not
        counted. (One ended by a stop string, which the front end finds,
        still counts until the next step: the trim is then refused, never
        wrong.)"""
        requests = getattr(self.model_runner, "requests", {})
        max_len = int(self.vllm_config.model_config.max_model_len)
        return 1 + max(
            (
                i
                for state in requests.values()
                if not ended(state, max_len)
                for group in state.block_ids
                for i in group
            ),
            default=-1,
        )

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step, after committing the blocks it is about to use (with
        on-demand growth), applying the scheduler's orders (elastic growth)
        and waking a KV cache still asleep: a step over released memory
        would fault (a device fault; SIGSEGV on the host)."""
        if self._kv is not None:
            self._before_step(args[0] if args else kwargs.get("scheduler_output"))
        return self._with_report(super().execute_model(*args, **kwargs))

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's sampling, which returns the step's output when
        ``execute_model`` did not: the elastic report rides on it."""
        return self._with_report(super().sample_tokens(*args, **kwargs))

    def _with_report(self, output: Any) -> Any:
        """``output`` carrying the report on this step's orders to the
        scheduler (a copy: vLLM reuses one empty output for every empty step)."""
        if output is None or self._report is None:
            return output
        output = _copy.copy(output)
        output.extensible_kv, self._report = self._report, None
        return output

    def _before_step(self, scheduler_output: Any) -> None:
        assert self._kv is not None
        if self._elastic is not None and scheduler_output is not None:
            self._before_elastic_step(scheduler_output)
            return
        if self._kv.buffers.released:
            self._wake_before_step()
        if self._growth is not None and scheduler_output is not None:
            self._growth.ensure(scheduled_block_ids(scheduler_output))

    def _wake_before_step(self) -> None:
        warnings.warn(
            "extensible-kv: a model step ran while the KV cache slept; it is woken "
            "first (call wake_kv_cache before resuming the scheduler)",
            RuntimeWarning,
            stacklevel=4,
        )
        self._wake_kv()

    def _before_elastic_step(self, scheduler_output: Any) -> None:
        """Hold what the scheduler's orders say before the step runs. An
        empty step while asleep only records them (the wake commits unit 0,
        the next orders the rest)."""
        assert self._kv is not None
        assert self._elastic is not None
        orders: ElasticOrders | None = getattr(scheduler_output, "extensible_kv", None)
        if orders is not None:
            self._orders = orders
            if self._kv.buffers.released:
                # Asleep: what the wake must come back to is these orders.
                self._holding = dataclasses.replace(orders, wanted=())
        if self._kv.buffers.released:
            if not scheduler_output.total_num_scheduled_tokens:
                if orders is not None:
                    self._report = ElasticReport(orders.seq, 0)
                return
            self._wake_before_step()
        if orders is not None:
            self._report = self._agreed(self._elastic.apply(orders))
            # What the scheduler counts once it reads the report: the held
            # units and the wanted ones granted.
            self._holding = dataclasses.replace(orders, held=self._elastic.held_units, wanted=())
        elif self._holding is not None and not self._elastic.holds_units(self._holding.held):
            # Woken since: commit what the scheduler counts again.
            self._elastic.apply(self._holding)
        used = scheduled_block_ids(scheduler_output)
        if not self._elastic.holds(used):
            raise RuntimeError(
                f"vLLM scheduled blocks outside the units the scheduler ordered "
                f"({sorted(set(used))[:8]}...); run growth 'elastic' with "
                f"scheduler_cls='extensible_kv.integrations.vllm.ExtensibleKVScheduler'"
            )

    def _agreed(self, report: ElasticReport) -> ElasticReport:
        """With tensor parallelism, the fewest units any rank got: every rank
        keeps that many, so the ranks hold the same blocks."""
        from vllm.distributed.parallel_state import get_tp_group

        assert self._elastic is not None
        assert self._orders is not None
        group = get_tp_group()
        if group.world_size == 1 or not self._orders.wanted:
            return report
        import torch.distributed as dist

        granted = torch.tensor([report.granted], dtype=torch.int64)
        dist.all_reduce(granted, op=dist.ReduceOp.MIN, group=group.cpu_group)
        agreed = int(granted.item())
        if agreed < report.granted:
            wanted = [u for lo, hi in self._orders.wanted for u in range(lo, hi)]
            self._elastic.give_back(wanted[agreed : report.granted])
        return ElasticReport(report.seq, agreed)

    # -- inspection ----------------------------------------------------------------

    def extensible_kv_state(self) -> dict[str, Any]:
        """This worker's KV cache, for ``llm.collective_rpc("extensible_kv_state")``.

        Keys: ``reserved_bytes`` (address space), ``committed_bytes`` (the
        committed blocks' bytes), ``physical_bytes`` (memory held, whole
        granules), ``num_blocks_committed``, ``num_blocks_capacity``,
        ``base_ptrs`` (one address per backing buffer), ``asleep`` and
        ``host_backup_bytes`` (host memory holding a preserving sleep's
        copy), ``growth`` (``"static"``, ``"on_demand"`` or ``"elastic"``;
        with ``"elastic"`` ``num_blocks_committed`` counts the blocks of the
        units held) and
        ``high_water_blocks`` (the most blocks committed at once),
        ``sizing`` (None with an explicit KV size; else what warm-up
        measured: ``budget_bytes``, ``non_kv_bytes``, ``available_kv_bytes``,
        ``warm_up_blocks``); and
        ``enabled``, False where the worker fell back to vLLM's allocation
        (every figure then 0).
        """
        if self._kv is None:
            fallback: dict[str, Any] = {key: 0 for key in STATE_KEYS}
            return {
                **fallback,
                "base_ptrs": [],
                "asleep": False,
                "growth": "static",
                "sizing": None,
                "enabled": False,
            }
        buffers = self._kv.buffers
        held = None if self._elastic is None else self._elastic.num_blocks_held
        return {
            "reserved_bytes": buffers.reserved_bytes,
            "committed_bytes": (
                buffers.committed_bytes if held is None else held * buffers.bytes_per_block
            ),
            "physical_bytes": buffers.physical_bytes,
            "num_blocks_committed": buffers.num_blocks_committed if held is None else held,
            "num_blocks_capacity": buffers.num_blocks_capacity,
            "base_ptrs": buffers.base_ptrs,
            "asleep": buffers.released,
            "host_backup_bytes": buffers.host_backup_bytes,
            "growth": self._growth_mode(),
            "high_water_blocks": self._high_water(),
            "sizing": self._sizing,
            "enabled": True,
        }

    def _high_water(self) -> int:
        """The most blocks committed at once so far."""
        if self._elastic is not None:
            return self._elastic.high_water
        if self._growth is not None:
            return self._growth.high_water
        assert self._kv is not None
        return self._kv.buffers.num_blocks_committed
