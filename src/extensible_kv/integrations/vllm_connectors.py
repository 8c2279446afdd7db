"""Whether a vLLM KV connector lets the worker release the KV cache it has
registered for transfers, on each supported vLLM release.

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
