"""What every engine case of the ``vllm`` suite shares, and nothing that
runs a case: our worker and scheduler as vLLM names them, the kinds of
engine the suite compares and how one is made, the tiny Llama with 16 KV
heads that the ``elastic`` and ``several`` cases run and the prompts they
send, the environment an engine runs in, and the ``FIGURES`` line by which
a case's process hands its figures to the parent (:func:`print_figures`,
:func:`case_main`, :func:`child_figures`).

The cases (:mod:`~extensible_kv.bench.lifecycle`,
:mod:`~extensible_kv.bench.decode`, :mod:`~extensible_kv.bench.elastic`,
:mod:`~extensible_kv.bench.several`) import this module, and only the
suite (:mod:`~extensible_kv.bench.engine`) imports the cases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Our worker and scheduler, as vLLM's ``worker_cls`` and ``scheduler_cls``.
WORKER = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
#: The suite's kinds of engine: name -> (worker_cls,
#: additional_config["extensible_kv"] or None).
KINDS: dict[str, tuple[str, dict[str, str] | None]] = {
    "stock": ("auto", None),
    "ours": (WORKER, {}),
    "ours_on_demand": (WORKER, {"growth": "on_demand"}),
}
#: The tiny Llama with 16 KV heads: tokens in a block, and a block's bytes
#: over its 2 layers (128 KiB each).
BLOCK_TOKENS = 32
BYTES_PER_BLOCK = 2 * 128 * 1024
#: A unit: 16 blocks of 128 KiB in each of the model's 2 layers (4 MiB).
UNIT_BYTES = 16 * BYTES_PER_BLOCK
#: The prefix of a child process's line with its figures (JSON after it).
FIGURES_LINE = "FIGURES "


def unavailable() -> str | None:
    """Why the engine cases cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (nox -s vllm installs it)"
    from extensible_kv.integrations.vllm.support import check_vllm_version, installed_vllm

    try:
        check_vllm_version(installed_vllm())
    except ImportError as exc:
        return str(exc)
    return None


def quiet_vllm_cpu(**more: str) -> None:
    """The environment a benchmark engine runs in (unless already set): vLLM's
    CPU build without thread binding, warm-up or usage reports, and ``more``."""
    settings = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **more,
    }
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def make_engine(model: str, worker: str, options: dict[str, str] | None, kv_bytes: int) -> Any:
    """An ``LLM`` of one of :data:`KINDS` on a tiny fp32 model, eager."""
    from vllm import LLM

    return LLM(
        model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=kv_bytes,
        worker_cls=worker,
        additional_config={"extensible_kv": options} if options is not None else {},
    )


def tiny_model() -> str:
    """The tiny Llama with 16 KV heads (made once): its folder."""
    from extensible_kv.demo.tiny_models import save_tiny_model

    folder = Path(tempfile.gettempdir()) / "extensible-kv-tiny-llama-16kv"
    return str(save_tiny_model("llama", folder, num_kv_heads=16))


def prompt(seed: int, length: int, shared: int = 0) -> list[int]:
    """``length`` tokens; the first ``shared`` are the same for every seed."""
    head = [(11 * j + 3) % 509 + 1 for j in range(shared)]
    return head + [(7 * seed + 13 * j) % 503 + 1 for j in range(length - shared)]


def print_figures(figures: dict[str, Any]) -> None:
    """Hand ``figures`` to the parent: the ``FIGURES`` line that
    :func:`child_figures` reads."""
    print(FIGURES_LINE + json.dumps(figures), flush=True)


def case_main(child: Callable[[str, str], dict[str, Any]]) -> None:
    """``python -m <case> MODEL KIND``: one run of ``child``, its figures
    printed (:func:`print_figures`)."""
    model, kind = sys.argv[1], sys.argv[2]
    print_figures(child(model, kind))


def child_figures(module: str, *args: str) -> dict[str, Any]:
    """Run ``python -m module *args`` (one engine, in a process of its own)
    and return the figures it prints on its ``FIGURES`` line."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the engine {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith(FIGURES_LINE))
    figures: dict[str, Any] = json.loads(line.removeprefix(FIGURES_LINE))
    return figures


def markdown_table(table: list[list[str]]) -> str:
    """Rows of cells, the first the header, as a Markdown table."""
    head, *body = table
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])
