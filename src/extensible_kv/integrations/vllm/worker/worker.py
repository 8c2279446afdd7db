"""A released vLLM on extensible-kv: its KV cache in our memory, sleep that frees it.

One string, on a CPU build of vLLM and on a CUDA build alike::

    LLM(model, worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker")

The worker subclasses vLLM's own (``CPUWorker`` on CPU, ``Worker`` on a
GPU) and changes three things, through vLLM's hooks:

- **Allocation.** ``initialize_from_config`` lays vLLM's KV cache config
  out at a capacity (an upper bound of blocks: address space only), reserves
  it with :func:`~extensible_kv.kv.allocate_kv_cache`, commits vLLM's block
  count and hands the reservation to vLLM as the KV cache's backing buffer
  (see :mod:`~extensible_kv.integrations.vllm.worker.handover`). vLLM then makes
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
:mod:`extensible_kv.integrations.vllm.scheduler.scheduler`) and ``cache_bytes``
(``"elastic"``: the most memory kept for the prefix cache). Without
virtual memory management on the device, the worker falls back to vLLM's
own allocation with one warning.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

from extensible_kv.integrations.vllm.seam import (
    ElasticBlocks,
    KVCache,
    OnDemandGrowth,
    allocate_kv_cache,
    at_capacity,
    check_bool,
    granule_size,
    segmentation,
    unavailable_reason,
    without_wants,
)
from extensible_kv.integrations.vllm.support import check_vllm_version, installed_vllm

check_vllm_version(installed_vllm())

from vllm import envs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from extensible_kv.integrations.vllm.client import client_pid, watch_client  # noqa: E402
from extensible_kv.integrations.vllm.options import (  # noqa: E402
    GROWTH_MODES,
    OPTIONS,
    Options,
    options_of,
)
from extensible_kv.integrations.vllm.worker import (  # noqa: E402
    commit,
    connectors,
    sizing,
    sleep,
    state,
)
from extensible_kv.integrations.vllm.worker.budget import set_floor_and_cap  # noqa: E402
from extensible_kv.integrations.vllm.worker.elastic import ElasticSteps, elastic_driver  # noqa: E402
from extensible_kv.integrations.vllm.worker.handover import HandOver  # noqa: E402
from extensible_kv.integrations.vllm.worker.restart import Restart, adopter  # noqa: E402
from extensible_kv.integrations.vllm.worker.state import STATE_KEYS  # noqa: E402
from extensible_kv.integrations.vllm.worker.steps import scheduled_block_ids  # noqa: E402

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _VllmWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _VllmWorker

#: The worker side's logger, the one name its messages go under (``sizing.py``'s too).
logger = logging.getLogger("extensible_kv.integrations.vllm.worker")

__all__ = ["GROWTH_MODES", "OPTIONS", "STATE_KEYS", "ExtensibleKVWorker"]


class ExtensibleKVWorker(_VllmWorker):  # type: ignore[misc]
    """vLLM's worker with its KV cache on extensible-kv (see the module). It
    owns the cache; each idea's rules live in a module beside this one
    (sizing, commit, connectors, sleep, elastic, state)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv: KVCache | None = None
        self._growth: OnDemandGrowth | None = None
        self._elastic: ElasticSteps | None = None
        self._handover: HandOver | None = None
        #: The measurement that sized the cache (determine_available_memory),
        #: and whether the reservation it made waits for vLLM's final count.
        self._sizing: dict[str, int] | None = None
        self._provisional = False
        self._layout: Any = None
        #: Whether a sleep took the KV cache from its connector (vLLM 0.33+),
        #: to be registered again on the wake.
        self._connector_unregistered = False
        #: The keeper (``keep_prefix_cache_s``); whether warm-up's reservation is made.
        self._restart: Restart | None = None
        self._measuring = False

    @functools.cached_property
    def _options(self) -> Options:
        """The ``extensible_kv`` options, parsed once, at their first use: in
        vLLM's first call that needs them (an RPC), whose error vLLM shows
        the user, before anything is allocated; an error raised while vLLM
        builds its worker process reaches the user only as "WorkerProc
        initialization failed"."""
        return options_of(self.vllm_config)

    def init_device(self) -> None:
        """vLLM's, then the watch on the engine's client: an orphaned engine
        shuts down and gives its memory back (``integrations/vllm/client.py``)."""
        super().init_device()
        client = client_pid(envs.VLLM_PROCESS_NAME_PREFIX)
        if client is not None:
            watch_client(client)

    # -- growth -------------------------------------------------------------------

    def _growth_policy(self) -> OnDemandGrowth | ElasticBlocks | None:
        """What commits the KV cache beyond a prefix: on-demand growth, the
        elastic units, or None (static growth)."""
        return self._elastic.blocks if self._elastic is not None else self._growth

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
        # Reserve at the capacity and commit the blocks warm-up needs.
        self._measuring = True
        self.initialize_from_config(
            sizing.warm_up_config(self.vllm_config, self.model_runner.get_kv_cache_spec())
        )
        self._measuring = False
        assert self._kv is not None
        sizing.warm_up(self.model_runner, self.compile_or_warm_up_model)
        self._sizing = sizing.measured(*self._budget_and_used(), self._kv.cache)
        # vLLM's own way out of a KV cache made for profiling: the views go,
        # the reservation stays for the final count.
        self.model_runner._cleanup_profiling_kv_cache()
        self._provisional = True
        return self._sizing["available_kv_bytes"]

    def _budget_and_used(self) -> tuple[int, int]:
        """The memory vLLM may use (``gpu_memory_utilization`` of the
        device, or of the host's NUMA node) and what this worker uses now,
        in bytes."""
        if current_platform.is_cpu():
            return sizing.cpu_budget_and_used(int(self.requested_cpu_memory))
        return sizing.gpu_budget_and_used(
            self.device,
            self.cache_config.gpu_memory_utilization,
            int(self.init_snapshot.free_memory),
        )

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
        capacity = sizing.capacity_blocks(
            kv_cache_config,
            segmentation(kv_cache_config).size_bytes(1),
            self._options.num_blocks_capacity,
            self._options.growth,
            self.device,
        )
        layout = at_capacity(kv_cache_config, capacity)
        runner_config = commit.for_runner(layout, num_blocks)
        set_floor_and_cap(self.device, self._options)
        connectors.check_connector_pool(self.vllm_config, runner_config)
        elastic = self._options.growth == "elastic"
        self._restart = self._restart or Restart.of(self._options, self.vllm_config)
        step_tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
        kv = allocate_kv_cache(
            layout,
            device=self.device,
            shareable=self._has_connector() or self._restart is not None,
            driver=elastic_driver(self.device, layout, step_tokens) if elastic else None,
            # Elastic memory gives single granules back: one chunk each.
            chunk_bytes=granule_size(self.device) if elastic else None,
        )
        try:
            self._kv, self._layout = kv, layout
            self._commit_and_hand_over(runner_config)
        except BaseException:
            self._kv = self._growth = self._elastic = None
            kv.free()
            raise
        if self._has_connector():
            kv.cache.register_external(self._connector_name())
        logger.info(
            "extensible-kv: %d of %d blocks committed (%d bytes reserved; vLLM's count %d)",
            kv.cache.num_blocks_committed,
            capacity,
            kv.cache.reserved_bytes,
            num_blocks,
        )

    def _commit_and_hand_over(self, runner_config: Any) -> None:
        """Commit vLLM's count (with on-demand growth, the first step) and
        let vLLM build and bind its views over the reservation."""
        assert self._kv is not None
        restart = None if self._measuring else self._restart
        growth = commit.commit_count(
            self._kv.cache,
            int(runner_config.num_blocks),
            self._options.growth,
            defragment=self._has_connector(),
            adopt=adopter(restart, self.vllm_config, runner_config, self._kv.cache),
        )
        self._growth = growth if isinstance(growth, OnDemandGrowth) else None
        self._elastic = ElasticSteps(growth) if isinstance(growth, ElasticBlocks) else None
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
        layout = commit.final_layout(
            kv_cache_config, self._kv.cache.num_blocks_capacity, self._layout
        )
        self._provisional = False
        # Warm-up wrote into its blocks; vLLM's cache starts as zeros.
        self._kv.cache.clear()
        self._commit_and_hand_over(commit.for_runner(layout, int(kv_cache_config.num_blocks)))
        logger.info(
            "extensible-kv: %d blocks committed after warm-up, under the same addresses",
            self._kv.cache.num_blocks_committed,
        )

    def shutdown(self) -> None:
        """vLLM's, after the prefix cache's pages go to the keeper (``keep_prefix_cache_s``)."""
        restart, self._restart = self._restart, None
        if restart is not None and self._elastic is not None:
            restart.leave(self._elastic.blocks, self._elastic.dirty)
        super().shutdown()

    def _maybe_get_memory_pool_context(self, tag: str) -> Any:
        """vLLM's hook for where an allocation goes: the KV cache's goes to
        our reservation; every other tag goes where vLLM puts it."""
        if tag == "kv_cache" and self._handover is not None:
            return self._handover
        return super()._maybe_get_memory_pool_context(tag)

    # -- connectors ----------------------------------------------------------------

    def _has_connector(self) -> bool:
        return self.vllm_config.kv_transfer_config is not None

    def _connector_name(self) -> str:
        return connectors.connector_name(self.vllm_config.kv_transfer_config)

    # -- sleep and wake ----------------------------------------------------------

    def _release_kv(self, what: str) -> None:
        assert self._kv is not None
        if sleep.release_kv(self._kv.cache, self.vllm_config, what):
            self._connector_unregistered = True

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: at level 1 and 2 the KV cache's physical memory is
        released, its contents discarded (vLLM has reset the prefix cache);
        the weights follow vLLM's own path where vLLM's sleep mode is on."""
        if self._kv is None:
            super().sleep(level)
            return
        if level >= 1:
            self._release_kv(f"sleep(level={level})")
        if sleep.parent_sleeps(self.vllm_config):
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
                connectors.connector_of(self.vllm_config).restore_kv_caches()
                self._connector_unregistered = False
        if sleep.parent_sleeps(self.vllm_config):
            super().wake_up(tags)

    def _wake_kv(self, wait_s: float | None = None) -> None:
        """Commit the KV cache again (see
        :func:`~extensible_kv.integrations.vllm.worker.sleep.wake_kv`), waiting
        up to ``wait_s`` seconds (default: the ``budget_wait_s`` option) for
        room under a device budget."""
        assert self._kv is not None
        if wait_s is None:
            wait_s = self._options.budget_wait_s
        sleep.wake_kv(self._kv.cache, self._growth_policy(), wait_s)

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

        With ``growth: "elastic"`` only the units steps have written to since
        they were committed are copied (those of the blocks vLLM's prefix
        cache names, never a unit no block was written in), and the wake
        restores them at the same block ids.

        The copy is claimed under the host's budget, if it has one, with no
        wait and no want posted: a sleep gives memory and asks no other
        engine for room. A refusal
        (:class:`~extensible_kv.BudgetExceededError`) leaves the cache as
        it was, awake.
        """
        check_bool("preserve", preserve)
        kv = self._managed("sleep_kv_cache")
        sleep.check_kv_sleep(self._connector_name() if self._has_connector() else None)
        with without_wants():
            if self._elastic is not None:
                self._elastic.release(preserve)
            else:
                kv.cache.release_physical(preserve=preserve)

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
        ValueError naming them; see
        :func:`~extensible_kv.integrations.vllm.worker.sleep.blocks_in_use`).
        """
        self._managed("trim_kv_cache")
        growth = sleep.trimmable(self._growth, elastic=self._elastic is not None)
        in_use = sleep.blocks_in_use(
            getattr(self.model_runner, "requests", {}),
            int(self.vllm_config.model_config.max_model_len),
        )
        return sleep.trim_to(growth, num_blocks, in_use)

    # -- the step ------------------------------------------------------------------

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
        """``output``, with elastic growth carrying the report on this step's orders."""
        return output if self._elastic is None else self._elastic.with_report(output)

    def _before_step(self, scheduler_output: Any) -> None:
        assert self._kv is not None
        if self._elastic is not None and scheduler_output is not None:
            self._elastic.before_step(scheduler_output, self._wake_before_step)
            return
        if self._kv.cache.asleep:
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

    # -- inspection ----------------------------------------------------------------

    def extensible_kv_state(self) -> dict[str, Any]:
        """This worker's KV cache, for ``llm.collective_rpc("extensible_kv_state")``:
        :data:`STATE_KEYS` (bytes, blocks, addresses, ``asleep``, ``growth``,
        ``sizing``; each told at :func:`~extensible_kv.integrations.vllm.worker.state.kv_state`)
        and ``enabled``, False where the worker fell back to vLLM's
        allocation (every figure then 0)."""
        if self._kv is None:
            return state.fallback_state()
        return state.kv_state(
            self._kv.cache, self._growth_policy(), self._options.growth, self._sizing
        )
