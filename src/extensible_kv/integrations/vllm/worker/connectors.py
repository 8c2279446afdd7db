"""The worker's KV connector (``kv_transfer_config``): its name, the pool
check at allocation, and whether and how the worker may release the KV cache
the connector has registered for transfers, on each supported vLLM release.

A connector registers the KV cache's addresses with its transport (RDMA,
NIXL, Mooncake) once, at start. Releasing the memory under a registration
and committing it again leaves the transport pointing at memory it no
longer knows, so a release must come between the connector's own
``unregister_kv_caches()`` and ``restore_kv_caches()``:

- vLLM 0.32's connectors have neither; a release is refused.
- vLLM 0.33 adds both to ``KVConnectorBase_V1`` (the GPU worker calls them
  around its sleep), and ``supports_sleep_mode(kv_transfer_config)``, false
  for the connectors that cannot register again (NIXL push, MooncakeStore,
  MoRIIO, ...). Its engine core then sends peers the new registration
  (``_set_kv_connector_handshake_metadata``) on ``wake_up``: so the
  release is allowed through vLLM's sleep and wake only.

Read from vLLM 0.32.0's and 0.33.0's sources; only 0.32 runs here (CPU
build), so the 0.33 path is unverified.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "check_connector_pool",
    "connector_name",
    "connector_of",
    "release_refusal",
]


def connector_name(kv_transfer_config: Any) -> str:
    """The connector ``kv_transfer_config`` configures, named for messages."""
    name = getattr(kv_transfer_config, "kv_connector", None) or "configured"
    return f"vLLM KV connector {name}"


def connector_of(vllm_config: Any) -> Any:
    """This worker's KV connector (vLLM's, made once per process), or None."""
    if vllm_config.kv_transfer_config is None:
        return None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def check_connector_pool(vllm_config: Any, runner_config: Any) -> None:
    """Refuse a connector that brings its own KV memory pool (Mooncake's
    NVLink): vLLM would allocate the cache there, outside our reservation.
    The connector is made here, as vLLM's worker makes it (once), for
    ``runner_config`` (the KV cache config vLLM's runner gets). Nothing
    without a connector."""
    if vllm_config.kv_transfer_config is None:
        return
    from vllm.distributed.kv_transfer import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    ensure_kv_transfer_initialized(vllm_config, runner_config)
    if has_kv_transfer_group() and get_kv_transfer_group().get_mem_pool_context() is not None:
        raise ValueError(
            f"{connector_name(vllm_config.kv_transfer_config)} brings a memory pool of its own "
            f"for the KV cache; extensible-kv cannot place the cache there (run it without "
            f"worker_cls)"
        )


def release_refusal(connector: type, kv_transfer_config: Any) -> str | None:
    """Why the class of the worker's connector forbids releasing the KV
    cache, or None where a release may go between its
    ``unregister_kv_caches()`` and ``restore_kv_caches()``."""
    name = connector.__name__
    if not hasattr(connector, "restore_kv_caches"):
        return (
            f"{name} would not register it again after a wake (vLLM 0.32's connectors "
            f"cannot; 0.33's can, where they support sleep mode)"
        )
    supports = getattr(connector, "supports_sleep_mode", None)
    if supports is not None and not supports(kv_transfer_config):
        return f"{name} does not support sleep mode (its supports_sleep_mode says so)"
    return None
