"""HTTP routes for vLLM's OpenAI server: the KV memory of this instance.

An endpoint plug-in (vLLM's ``vllm.endpoint_plugins`` entry-point group,
loaded only when named in ``VLLM_PLUGINS``)::

    VLLM_PLUGINS=extensible_kv python -m vllm.entrypoints.openai.api_server ...

- ``GET /extensible_kv/state``: ``extensible-kv top --once --json``'s
  snapshot (same schema, docs/budget.md), narrowed to this instance's
  processes; each device keeps its whole budget (``limit_bytes``,
  ``revision``, ``claimed_bytes`` of every process on it).
- ``GET /extensible_kv/metrics``: the same figures in Prometheus' text format.

Both read what every process already publishes in the budget's state
directory; as vLLM's plug-in contract asks, they open no path into the
engine. The figures are at most half a second old (docs/budget.md).

With ``growth: "elastic"`` the plug-in also lets an idle engine give way.
vLLM's engine core, with no request to run, blocks on its input queue, and
only a request from its client wakes it; so while another process on the
same device budget wants memory (:meth:`~extensible_kv.budget.Ledger.pressure`),
the plug-in asks the engine the cheapest question there is
(``is_sleeping``) every :data:`LOOK_EVERY_S` seconds. That wakes the engine
core's loop, where the scheduler sees the want and gives back the blocks no
request holds. No route is added for it, and nothing else reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from vllm import envs

from extensible_kv.integrations.vllm.client import process_title
from extensible_kv.integrations.vllm.seam import Ledger, StateDirError, snapshot, state_dir

logger = logging.getLogger(__name__)

#: The routes' common prefix.
PREFIX = "/extensible_kv"
#: Seconds between two looks at the budget's wants (an idle engine's answer
#: to a want takes this long at most, plus a step).
LOOK_EVERY_S = 0.05
#: Seconds between two listings of the ledgers and this instance's processes.
RELIST_S = 2.0


def instance_pids() -> set[int]:
    """This server's processes: itself and every descendant (its engine core
    and workers); with several API servers (``--api-server-count``, each
    titled ``VLLM::APIServer_<n>``), every process their launcher started,
    their engines included."""
    root = psutil.Process()
    several = process_title(root.pid).startswith(f"{envs.VLLM_PROCESS_NAME_PREFIX}::APIServer")
    parent = root.parent()
    if several and parent is not None:
        root = parent
    return {root.pid, *(child.pid for child in root.children(recursive=True))}


def instance_state(pids: set[int]) -> dict[str, Any]:
    """The state directory's snapshot (``top --json``'s schema) with only
    the processes in ``pids``, on the devices where any of them claims or
    publishes; device totals stay whole."""
    state = snapshot(state_dir())
    devices = []
    for device in state["devices"]:
        processes = [p for p in device["processes"] if p["pid"] in pids]
        if processes:
            devices.append({**device, "processes": processes})
    return {**state, "devices": devices}


class _StateCollector:
    """One snapshot as Prometheus gauges (bytes; ``asleep`` 0 or 1;
    seconds); a collector as prometheus_client registers one. A figure the
    snapshot has as null (no limit, no cap, no want met yet, a cache that
    does not count its blocks in use) is left out."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        device_labels = ["device", "type"]
        devices = {
            key: GaugeMetricFamily(f"extensible_kv_device_{name}", text, labels=device_labels)
            for key, name, text in (
                ("limit_bytes", "limit_bytes", "The device's limit (absent without one)."),
                ("revision", "limit_revision", "The device limit's revision (0: never set)."),
                ("claimed_bytes", "claimed_bytes", "What every live process claims on the device."),
            )
        }
        process_labels = [*device_labels, "pid"]
        processes = {
            key: GaugeMetricFamily(f"extensible_kv_process_{name}", text, labels=process_labels)
            for key, name, text in _PROCESS_GAUGES
        }
        cache_labels = [*process_labels, "kind", "cache"]
        caches = {
            key: GaugeMetricFamily(f"extensible_kv_cache_{key}", text, labels=cache_labels)
            for key, text in _CACHE_GAUGES
        }
        for device in self._state["devices"]:
            labels = [device["device"], device["type"]]
            _add(devices, device, labels)
            for process in device["processes"]:
                pid = str(process["pid"])
                _add(processes, process, [*labels, pid])
                for index, cache in enumerate(process["caches"]):
                    asleep = cache.get("asleep")
                    values = {**cache, "asleep": None if asleep is None else int(asleep)}
                    _add(caches, values, [*labels, pid, cache["kind"], str(index)])
        yield from (*devices.values(), *processes.values(), *caches.values())


#: A process's gauges: the snapshot's key, the gauge's name, its help.
_PROCESS_GAUGES = (
    ("claimed_bytes", "claimed_bytes", "What the process claims on the device."),
    ("wanted_bytes", "wanted_bytes", "What it asked for, was refused, and has not got yet."),
    ("floor_bytes", "floor_bytes", "Kept for it while it holds less (0: none)."),
    ("cap_bytes", "cap_bytes", "The most it may claim (absent without a cap)."),
    ("waited_s", "waited_seconds", "How long its last met want waited (absent: none yet)."),
    ("wanting_s", "wanting_seconds", "How long its standing want has stood unmet (3+: stalled)."),
)
#: A cache's gauges: the snapshot's key (the gauge's name) and its help.
_CACHE_GAUGES = (
    ("reserved_bytes", "Address space reserved (no memory)."),
    ("committed_bytes", "Bytes of the committed blocks."),
    ("physical_bytes", "Memory mapped, in whole granules."),
    ("asleep", "1 between a sleep and its wake."),
    ("in_use_bytes", "Bytes of the blocks running requests hold (elastic growth only)."),
    ("cached_bytes", "Bytes of the free blocks vLLM's prefix cache keeps (elastic growth only)."),
)


def _add(families: dict[str, GaugeMetricFamily], values: dict[str, Any], labels: list[str]) -> None:
    """``values[key]`` to the family of each key, where it is not null."""
    for key, family in families.items():
        if values.get(key) is not None:
            family.add_metric(labels, values[key])


def metrics_text(state: dict[str, Any]) -> bytes:
    """``state`` (a snapshot) in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(state))
    text: bytes = generate_latest(registry)
    return text


def _unreadable(exc: StateDirError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=503)


def _state() -> Any:
    try:
        return instance_state(instance_pids())
    except StateDirError as exc:
        return _unreadable(exc)


def _metrics() -> Response:
    try:
        text = metrics_text(instance_state(instance_pids()))
    except StateDirError as exc:
        return _unreadable(exc)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _router() -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    # Plain functions: FastAPI runs them in its thread pool, so reading the
    # state directory never blocks the server's event loop.
    router.add_api_route("/state", _state, methods=["GET"])
    router.add_api_route("/metrics", _metrics, methods=["GET"])
    return router


class ExtensibleKVEndpoints:
    """The ``extensible_kv`` endpoint plug-in (vLLM's ``EndpointPlugin``
    protocol): routes only; they need no engine, so every server task,
    vLLM's render server included, gets them."""

    name = "extensible_kv"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(_router())

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """The routes need nothing set up (each reads the state directory);
        with elastic growth, start the look at the budget's wants that lets
        the idle engine give way (see the module)."""
        if engine_client is not None and _growth(args) == "elastic":
            state.extensible_kv_give_way = asyncio.create_task(give_way(engine_client))


def _growth(args: Namespace) -> object:
    """The ``growth`` option of the server's ``--additional-config``."""
    extra = getattr(args, "additional_config", None)
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    options = extra.get("extensible_kv") if isinstance(extra, dict) else None
    return options.get("growth") if isinstance(options, dict) else None


async def give_way(engine_client: Any) -> None:
    """Until the server stops: while another process on a device budget this
    instance claims from wants memory, wake the engine core (see the module)."""
    ledgers: dict[Path, Ledger] = {}
    pids: set[int] = set()
    listed_at = -RELIST_S
    warned = False
    while True:
        await asyncio.sleep(LOOK_EVERY_S)
        try:
            if time.monotonic() - listed_at >= RELIST_S:
                pids, listed_at = instance_pids(), time.monotonic()
                _list_ledgers(ledgers)
            if any(ledger.pressure(pids) for ledger in ledgers.values()):
                await engine_client.is_sleeping()
        except Exception as exc:  # the server goes on serving; say it once
            if not warned:
                logger.warning("extensible-kv: cannot read the budget's wants: %s", exc)
                warned = True


def _list_ledgers(ledgers: dict[Path, Ledger]) -> None:
    """Open every device ledger in the state directory not open yet."""
    where = state_dir()
    for path in sorted((where / "devices").glob("*.ledger")):
        if path not in ledgers:
            ledgers[path] = Ledger(where, path.stem)


__all__ = [
    "PREFIX",
    "ExtensibleKVEndpoints",
    "give_way",
    "instance_pids",
    "instance_state",
    "metrics_text",
]
