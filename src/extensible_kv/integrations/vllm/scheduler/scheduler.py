"""vLLM's scheduler deciding what KV memory its workers hold (``growth: "elastic"``).

::

    LLM(model,
        worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker",
        scheduler_cls="extensible_kv.integrations.vllm.ExtensibleKVScheduler",
        additional_config={"extensible_kv": {"growth": "elastic"}})

vLLM tells a worker which blocks a step uses, never which blocks were freed
or which its prefix cache keeps; the scheduler knows. This subclass of
vLLM's :class:`Scheduler` (chosen with vLLM's ``scheduler_cls``, no patch)
keeps the blocks in use and the cached ones packed in as few **units**
(about a granule's worth of consecutive block ids) as it can, and sends every
worker, on the :class:`SchedulerOutput` vLLM already sends each step, the
:class:`~extensible_kv.kv.growth.elastic.ElasticOrders`: the units the step may use
and the units to commit ahead (what the requests need, and one step's
token budget more while requests run). Workers answer on the output they
return (:class:`~extensible_kv.kv.growth.elastic.ElasticReport`).

How the blocks are handed out (lowest id first, only blocks of committed
units, the prefix cache within ``cache_bytes``) is the block pool's free
queue in this scheduler,
:class:`~extensible_kv.integrations.vllm.scheduler.free_queue.PackedFreeQueue`.

When no request runs, :meth:`ExtensibleKVScheduler.has_requests` turns true
while orders wait to go out, so vLLM's engine-core loop (the default, a
process of its own) runs one empty step that carries them: memory is back
:data:`LINGER_S` after the load fell, or within a step of another process
wanting it. An engine stepped in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only while ``generate`` runs,
so there the orders go with the next step.

It runs on whichever scheduler vLLM chose: its ``AsyncScheduler`` where
async scheduling is on (vLLM's default on a GPU; the CPU build turns it
off), its ``Scheduler`` otherwise (:class:`ExtensibleKVScheduler` makes an
:class:`ExtensibleKVAsyncScheduler` for the first). With async scheduling
or pipeline parallelism vLLM runs a batch queue, scheduling a batch while
the one before still executes: a unit goes back only once no batch running
may use a block of it (:mod:`~extensible_kv.integrations.vllm.scheduler.in_flight`),
and units asked for stay asked for until the workers' report on them is
in, so that orders sent meanwhile never give them back.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from extensible_kv.integrations.vllm.support import check_vllm_version, installed_vllm

check_vllm_version(installed_vllm())

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from extensible_kv.integrations.vllm.options import options_of  # noqa: E402
from extensible_kv.integrations.vllm.scheduler.admission import Admission  # noqa: E402
from extensible_kv.integrations.vllm.scheduler.demand import (  # noqa: E402
    blocks_soon,
    blocks_to_finish,
)
from extensible_kv.integrations.vllm.scheduler.give_way import (  # noqa: E402
    GiveWay,
    engine_loop,
)
from extensible_kv.integrations.vllm.scheduler.plan import ElasticPlan  # noqa: E402
from extensible_kv.integrations.vllm.scheduler.pressure import Pressure  # noqa: E402
from extensible_kv.integrations.vllm.scheduler.restart import (  # noqa: E402
    check_stop_keeps,
    forget_names,
    name_kept,
    seed_adopted,
    write_names,
)
from extensible_kv.integrations.vllm.seam import segmentation  # noqa: E402

logger = logging.getLogger(__name__)

#: The memory a unit of blocks is packed to: a granule of the host backend
#: and of CUDA's device memory (2 MiB). Workers map exactly whatever their
#: granularity; this only sizes the units the scheduler packs and counts.
UNIT_BYTES = 2 << 20
#: Seconds an idle engine keeps the memory it could give back while no
#: other process wants it. Each step of an idle engine costs a host core
#: for a second after it (vLLM's workers busy-wait on their queue that
#: long), and the memory is committed again for the next request: on a
#: trace whose requests come about a second apart, giving back at once
#: stepped the idle servers after nearly every request, and the busy
#: server's first tokens waited for the cores (docs/performance.md). A
#: want is answered at once, lingering or not.
LINGER_S = 2.0


def blocks_per_unit(kv_cache_config: Any) -> int:
    """Blocks in :data:`UNIT_BYTES` of the buffer's largest blocks (at least 1)."""
    return max(1, UNIT_BYTES // segmentation(kv_cache_config).row_bytes)


class ExtensibleKVScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, deciding the KV memory of ``growth: "elastic"`` (see
    the module); with any other growth, vLLM's scheduler unchanged.

    The one name users pass as ``scheduler_cls``, whichever scheduler vLLM
    decided on: where its config has async scheduling on, making one makes
    an :class:`ExtensibleKVAsyncScheduler` (this class on vLLM's
    ``AsyncScheduler``), so a custom scheduler costs no overlap."""

    #: The mark ``growth: "elastic"`` looks for on the scheduler vLLM was
    #: given (:data:`~extensible_kv.integrations.vllm.options.SCHEDULER_MARK`):
    #: this class and its subclasses send the orders the workers follow.
    sends_elastic_orders: ClassVar[bool] = True

    def __new__(cls, *args: Any, **kwargs: Any) -> ExtensibleKVScheduler:
        # vLLM picks its scheduler class before it makes one, from the
        # config alone (SchedulerConfig.get_scheduler_cls); the choice
        # between the synchronous and the async base is made here, from
        # the same config, so that one public name serves both.
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is ExtensibleKVScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = ExtensibleKVAsyncScheduler
        made: ExtensibleKVScheduler = super().__new__(cls)
        return made

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        #: The ``extensible_kv`` options, checked once, here.
        self._options = options_of(vllm_config)
        self._elastic: ElasticPlan | None = None
        if self._options.growth != "elastic":
            return
        if self._options.keep_prefix_cache_s is not None:
            check_stop_keeps(vllm_config)
        num_blocks = int(kv_cache_config.num_blocks)
        bytes_per_block = int(kv_cache_config.kv_cache_tensors[0].size) // num_blocks
        cache_bytes = self._options.cache_bytes
        if cache_bytes is None:
            cache_bytes = default_cache_bytes(num_blocks * bytes_per_block)
        per_unit = blocks_per_unit(kv_cache_config)
        # A rank's block across every tensor: what the budget counts.
        rank_block = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) // num_blocks
        self._pressure = Pressure(rank_block)
        self._elastic = ElasticPlan(
            self.kv_cache_manager.block_pool, per_unit, cache_bytes // bytes_per_block
        )
        #: What one step's token budget (vLLM's ``max_num_scheduled_tokens``)
        #: can fill, in blocks: the most a step can start on before the next plan.
        self._step_blocks = -(-int(self.max_num_scheduled_tokens) // int(self.block_size))
        self._admission = Admission(
            self._pressure, int(self.block_size), per_unit, int(self.max_model_len)
        )
        #: Per client, the outputs of requests refused since the last output.
        self._refused: dict[int, list[EngineCoreOutput]] = {}
        #: When the engine last had requests (``time.monotonic``).
        self._busy_at = 0.0
        #: vLLM's engine-core loop running this scheduler (None: stepped in
        #: the client's process).
        self._loop = engine_loop()
        inbox = None if self._loop is None else self._loop.input_queue
        self._give_way = None if inbox is None else GiveWay(inbox, self._should_step)
        #: Whether the prefix cache's names were written as the loop stopped.
        self._named_at_stop = False
        if self._loop is None:
            logger.warning(
                "extensible-kv: this engine is stepped in its client's process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0): it gives memory back to other "
                "processes' wants only while generate() runs"
            )
        logger.info(
            "extensible-kv: elastic KV memory, units of %d blocks, the prefix cache "
            "within %d bytes (%d blocks)",
            per_unit,
            cache_bytes,
            cache_bytes // bytes_per_block,
        )
        if self._options.keep_prefix_cache_s is not None:
            seed_adopted(
                self._elastic, self.kv_cache_manager.block_pool, int(self.block_size), vllm_config
            )

    def _demand(self, to_finish: bool) -> int:
        """Free blocks the requests need: soon, or, ``to_finish`` (once a
        budget refused the plan), to finish
        (:mod:`~extensible_kv.integrations.vllm.scheduler.demand`)."""
        size = int(self.block_size)
        if to_finish:
            return blocks_to_finish(self.waiting, self.running, size, int(self.max_model_len))
        return blocks_soon(self.waiting, self.running, size)

    def _ahead(self) -> int:
        """Free blocks kept ahead of the demand while requests wait or run
        (a step's worth), and through :data:`LINGER_S` after, where the
        engine's own loop steps it again to give them back
        (:class:`GiveWay`); none while another process wanted memory lately
        (:meth:`Pressure.wanted_lately`)."""
        if not (self.waiting or self.running):
            # vLLM runs one empty step after a request finishes (to tell
            # the workers): giving the blocks ahead back there committed
            # them again for the next request, one step later. One request
            # at a time, each finished before the next came, cost a step
            # and a commit of a step's blocks per request (3.5x stock's
            # time to first token: docs/performance.md, the restart case).
            # An engine stepped in-process may not step again: it gives
            # them back at once.
            lingering = time.monotonic() - self._busy_at < LINGER_S
            if self._give_way is None or not lingering:
                return 0
        # Blocks ahead save a burst's later requests a step; taken from a
        # budget another engine was refused by moments ago, they cost that
        # engine a refusal, a want and this engine's step to give them back,
        # again at every step (the trace replay's conversation servers held
        # a step's token budget ahead through the code server's spike:
        # docs/performance.md).
        return 0 if self._pressure.wanted_lately() else self._step_blocks

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if self._elastic is not None:
            self._admission.add(request)

    def _refuse(self, request: Any, message: str) -> None:
        """Finish ``request``, which can never fit, as vLLM finishes a prompt
        longer than the model's length, ``message`` its stop reason
        (:mod:`~extensible_kv.integrations.vllm.scheduler.admission`)."""
        logger.warning(message)
        self.finish_requests(request.request_id, RequestStatus.FINISHED_IGNORED)
        output = EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.LENGTH, stop_reason=message
        )
        self._refused.setdefault(request.client_index, []).append(output)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        orders = None
        if self._elastic is not None:
            if self.waiting or self.running:
                self._busy_at = time.monotonic()
                if self._named_at_stop:
                    # A request after all: the names may go stale.
                    forget_names(self.vllm_config)
                    self._named_at_stop = False
            for request, message in self._admission.never_fit():
                self._refuse(request, message)
            give = self._pressure.blocks_wanted()
            self._elastic.floor_blocks = self._pressure.floor_blocks
            demand = self._demand(self._elastic.refused_recently())
            orders = self._elastic.plan(demand, give, self._ahead())
            if give:
                self._pressure.spent()
            for message in self._pressure.stalled():
                logger.warning(message)
        output = super().schedule(*args, **kwargs)
        if self._elastic is not None:
            self._elastic.batch_scheduled()
        if orders is not None:
            output.extensible_kv = orders
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._elastic is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        report = getattr(model_runner_output, "extensible_kv", None)
        if report is not None and report.ledgers:
            self._pressure.learn(report.ledgers)
        self._elastic.confirm(getattr(scheduler_output, "extensible_kv", None), report)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._elastic.batch_finished()
        refused, self._refused = self._refused, {}
        for client, finished in refused.items():
            outputs.setdefault(client, EngineCoreOutputs()).outputs.extend(finished)
        return outputs

    def has_requests(self) -> bool:
        """vLLM's answer; with elastic growth also true while another
        process wants memory this engine holds idle, in units or in handles
        its workers keep, and, :data:`LINGER_S` after the engine's last
        request, while orders wait to go out (a step gives it back)."""
        if super().has_requests():
            self._busy_at = time.monotonic()
            return True
        elastic = self._elastic
        if elastic is None:
            return False
        if self._loop is not None and not self._loop.is_running():
            self._name_at_stop()
            return False
        wanted = self._pressure.blocks_wanted() > 0
        if wanted and (elastic.can_give() or elastic.keeps_idle):
            return True
        return self._lingered()

    def _name_at_stop(self) -> None:
        """Once, as vLLM's loop stops with no request left (it steps no
        more), write the prefix cache's names where the workers' keepers
        find them (:func:`write_names`).

        vLLM's engine core, once its loop has stopped, puts SIGTERM back to
        its default action and tears down: the workers first, then this
        scheduler, which names their pages as it stops. A second signal in
        between kills it before that, and the OpenAI server sends one of
        its own when it is stopped with Ctrl-C (SIGINT to the whole group)
        or by systemd (SIGTERM to every process of the unit): the names
        written here, while vLLM's handler still catches signals, are what
        the keepers take then."""
        if self._options.keep_prefix_cache_s is None or self._named_at_stop:
            return
        self._named_at_stop = True
        write_names(self.kv_cache_manager.block_pool, int(self.block_size), self.vllm_config)

    def _lingered(self) -> bool:
        """Whether the idle engine has orders to send and has kept its
        memory :data:`LINGER_S` since its last request."""
        assert self._elastic is not None
        return self._elastic.needs_step() and time.monotonic() - self._busy_at >= LINGER_S

    def _should_step(self) -> bool:
        """Whether the idle loop should step (asked by :class:`GiveWay` on
        its thread: it reads the ledgers and plain flags, and changes
        nothing): another process wants memory, or the linger is over."""
        return self._pressure.others_want() or self._lingered()

    def shutdown(self) -> None:
        if self._elastic is not None:
            if self._give_way is not None:
                self._give_way.close()
            self._pressure.close()
            if self._options.keep_prefix_cache_s is not None:
                # vLLM stopped the workers first: their pages wait for names.
                name_kept(self.kv_cache_manager.block_pool, int(self.block_size), self.vllm_config)
        super().shutdown()

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        if self._elastic is None:
            return bool(super().reset_prefix_cache(*args, **kwargs))
        with self._elastic.all_visible():
            return bool(super().reset_prefix_cache(*args, **kwargs))


class ExtensibleKVAsyncScheduler(ExtensibleKVScheduler, AsyncScheduler):  # type: ignore[misc]
    """:class:`ExtensibleKVScheduler` on vLLM's ``AsyncScheduler``: what it
    makes where vLLM's async scheduling is on (its method order runs ours,
    then vLLM's async scheduling, then vLLM's scheduler)."""


def default_cache_bytes(kv_cache_bytes: int) -> int:
    """The default ``cache_bytes``: an eighth of the KV cache vLLM sized."""
    return kv_cache_bytes // 8
