"""A released vLLM (0.32, 0.33) on extensible-kv, by the strings vLLM takes::

    LLM(model,
        worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker",
        scheduler_cls="extensible_kv.integrations.vllm.ExtensibleKVScheduler")

and the ``extensible_kv`` endpoint plug-in of vLLM's OpenAI server
(``VLLM_PLUGINS=extensible_kv``). Laid out by the process each part runs in:

- ``worker/``: :class:`ExtensibleKVWorker`, in every worker process (the KV
  cache: its allocation, sizing, commits, sleep, elastic steps, state);
- ``scheduler/``: :class:`ExtensibleKVScheduler`, in the engine core (the
  elastic plan over vLLM's block pool, its free queue, what other processes
  want);
- ``endpoints.py``: the HTTP routes, in the API server;
- below them, what every side reads: ``options.py`` (the options, parsed
  once), ``support.py`` (which vLLM releases), ``client.py`` (the engine's
  client process), ``kept_files.py`` (the files a restarting engine's
  sides leave each other), and ``seam.py``, the one module that imports the
  rest of extensible-kv.

The sides never import each other; this module names both, and imports
each only when one of its names is asked for, so that a worker process
imports no scheduler, the engine core no worker, the API server neither.
Each side checks the installed vLLM first: asking for a name here without
a supported vLLM is an ImportError of one line naming the range.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extensible_kv.integrations.vllm.options import GROWTH_MODES, OPTIONS
    from extensible_kv.integrations.vllm.scheduler.scheduler import (
        ExtensibleKVAsyncScheduler,
        ExtensibleKVScheduler,
    )
    from extensible_kv.integrations.vllm.worker.state import STATE_KEYS
    from extensible_kv.integrations.vllm.worker.worker import ExtensibleKVWorker

#: Where each public name lives, by module under this package.
_WHERE = {
    "ExtensibleKVWorker": "worker.worker",
    "ExtensibleKVScheduler": "scheduler.scheduler",
    "ExtensibleKVAsyncScheduler": "scheduler.scheduler",
    "GROWTH_MODES": "options",
    "OPTIONS": "options",
    "STATE_KEYS": "worker.state",
}

__all__ = [
    "GROWTH_MODES",
    "OPTIONS",
    "STATE_KEYS",
    "ExtensibleKVAsyncScheduler",
    "ExtensibleKVScheduler",
    "ExtensibleKVWorker",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
