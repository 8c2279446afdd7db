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

An idle elastic engine gives way to other processes' wants without the
plug-in: its scheduler wakes its own loop
(:mod:`~extensible_kv.integrations.vllm.scheduler.give_way`).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import psutil
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from vllm import envs

from extensible_kv.integrations.vllm.client import process_title
from extensible_kv.integrations.vllm.seam import StateDirError, snapshot, state_dir

#: The routes' common prefix.
PREFIX = "/extensible_kv"


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
        """Nothing to set up: each route reads the state directory."""


__all__ = [
    "PREFIX",
    "ExtensibleKVEndpoints",
    "instance_pids",
    "instance_state",
    "metrics_text",
]
