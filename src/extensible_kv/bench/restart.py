"""The ``restart`` case of the ``vllm`` suite: time to first token of
prefix-sharing requests right after an engine restarts, ours with
``keep_prefix_cache_s`` against stock vLLM started cold and stock vLLM warm.

The model is a tiny Llama with :data:`LAYERS` layers and 16 KV heads, whose
prefill of :data:`DOCUMENT_TOKENS` tokens is long enough on a CPU to tell a
prefix-cache hit from a miss. Each request is one of :data:`DOCUMENTS`
documents of :data:`DOCUMENT_TOKENS` tokens with a question of
:data:`QUESTION_TOKENS` tokens after it (a new question each time), sent
alone for one token: its wall time is its time to first token. Before it
is timed, each engine serves one short request that shares nothing, so that
what a first request of any engine pays once is paid alike.

Each round, in turn (the order swapped every round), in processes of their
own, vLLM's default engine (engine core a process of its own):

- ``stock``: a stock engine started, its first requests timed (``cold``:
  one question per document), then a second question per document timed
  (``warm``: the documents' blocks in its prefix cache);
- ``ours``: an engine with ``growth: "elastic"`` and
  ``keep_prefix_cache_s`` serves the first questions and ends as a script
  ends (its pages kept); a new engine is started and its first requests
  timed (``restart``: the second questions), then a third question per
  document (``warm``). The kept pages are dropped after the round.

vLLM's offloading connector is tried once per run with a filesystem tier
(:func:`connector_child`); the CPU build refuses it, and the case reports
vLLM's words. Ratios pair request by request: round ``r``, document ``d``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extensible_kv.bench.child import (
    SCHEDULER,
    WORKER,
    child_figures,
    markdown_table,
    print_figures,
    quiet_vllm_cpu,
)
from extensible_kv.bench.measure import MiB
from extensible_kv.bench.ratios import ratio_figures, spread

#: The model's layers: a 32-token block is 1 MiB over them (16 KV heads of 32, fp32).
LAYERS = 8
DOCUMENTS = 4
DOCUMENT_TOKENS = 896
QUESTION_TOKENS = 32
KV_BYTES = 256 * MiB
#: Seconds the kept pages outlive the first engine: the restart comes well within.
KEEP_S = 600
#: What a kind's child reports: (key, label), seconds each.
FIGURES = (
    ("start_s", "engine start"),
    ("first_ttft_s", "first requests' time to first token"),
    ("warm_ttft_s", "then, warm"),
)


def model() -> str:
    """The case's model (made once): its folder."""
    from extensible_kv.demo.tiny_models import save_tiny_model

    folder = Path(tempfile.gettempdir()) / f"extensible-kv-tiny-llama-16kv-{LAYERS}l"
    return str(save_tiny_model("llama", folder, num_layers=LAYERS, num_kv_heads=16))


def request(document: int, question: int) -> list[int]:
    """Document ``document``'s tokens, then question ``question``'s."""
    head = [(17 * document + 5 * j) % 499 + 1 for j in range(DOCUMENT_TOKENS)]
    return head + [(7 * question + 13 * j + document) % 503 + 1 for j in range(QUESTION_TOKENS)]


def _engine(path: str, kind: str) -> Any:
    from vllm import LLM

    ours = {"growth": "elastic", "cache_bytes": KV_BYTES, "keep_prefix_cache_s": KEEP_S}
    return LLM(
        path,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=KV_BYTES,
        worker_cls="auto" if kind == "stock" else WORKER,
        scheduler_cls=None if kind == "stock" else SCHEDULER,
        additional_config={} if kind == "stock" else {"extensible_kv": ours},
    )


def _timed(llm: Any, question: int) -> tuple[list[float], int]:
    """Each document's request with ``question``, alone: their seconds to
    the first token, and their prefix-cache hits (tokens) summed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    seconds, hits = [], 0
    for document in range(DOCUMENTS):
        ids = TokensPrompt(prompt_token_ids=request(document, question))
        start = time.perf_counter()
        (out,) = llm.generate([ids], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        hits += int(out.num_cached_tokens or 0)
    return seconds, hits


def child(path: str, kind: str) -> dict[str, Any]:
    """One engine of ``kind`` (``stock``, ``ours_first``, ``ours``,
    ``connector``), in this process."""
    if kind == "connector":
        return connector_child(path)
    quiet_vllm_cpu()
    start = time.perf_counter()
    llm = _engine(path, "stock" if kind == "stock" else "ours")
    started = time.perf_counter() - start
    if kind == "ours_first":
        _, hits = _timed(llm, 0)
        return {"hits": hits}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    once = TokensPrompt(prompt_token_ids=[(3 * j) % 97 + 1 for j in range(16)])
    llm.generate([once], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    first, first_hits = _timed(llm, 0 if kind == "stock" else 1)
    warm, warm_hits = _timed(llm, 1 if kind == "stock" else 2)
    return {
        "start_s": started,
        "first_ttft_s": first,
        "warm_ttft_s": warm,
        "first_hits": first_hits,
        "warm_hits": warm_hits,
    }


def connector_child(path: str) -> dict[str, Any]:
    """vLLM's offloading connector with a filesystem tier, its engine stepped
    in this process so that a refusal reaches it: ``{"refused": vLLM's
    words}`` where the build refuses it, else ``{"refused": None}``."""
    quiet_vllm_cpu(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="extensible-kv-offload-") as root:
        tiers = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": KV_BYTES}
        tiers["secondary_tiers"] = [{"type": "fs", "root_dir": root}]
        try:
            LLM(
                path,
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                max_model_len=1024,
                kv_cache_memory_bytes=KV_BYTES,
                kv_transfer_config={
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": tiers,
                },
            )
        except Exception as exc:  # vLLM raises what its build refuses as Exception
            while exc.__cause__ is not None and isinstance(exc.__cause__, Exception):
                exc = exc.__cause__
            return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"refused": None}


def case(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Stock and ours, ``rounds`` times, in turn (vLLM must be installed).
    The kept pages live in a state folder of the case's own, emptied after
    each round."""
    from extensible_kv.kept import drop, kept_caches

    path = model()
    progress("restart: vLLM's offloading connector, filesystem tier")
    connector = child_figures(__name__, path, "connector")
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="extensible-kv-restart-") as state:
        saved = os.environ.get("EXTENSIBLE_KV_STATE_DIR")
        os.environ["EXTENSIBLE_KV_STATE_DIR"] = state
        try:
            for round_ in range(rounds):
                for kind in ("stock", "ours") if round_ % 2 == 0 else ("ours", "stock"):
                    progress(f"restart, round {round_ + 1}/{rounds}: {kind}")
                    if kind == "ours":
                        child_figures(__name__, path, "ours_first")
                    runs[kind].append(child_figures(__name__, path, kind))
                    for record in kept_caches():
                        drop(record.keeper_pid)
        finally:
            if saved is None:
                del os.environ["EXTENSIBLE_KV_STATE_DIR"]
            else:
                os.environ["EXTENSIBLE_KV_STATE_DIR"] = saved
    return {**summary(runs, rounds), "connector": connector}


def summary(runs: dict[str, list[dict[str, Any]]], rounds: int) -> dict[str, Any]:
    """Every request's figures pooled per kind (min, median, max), the
    median prefix-cache hits (tokens) of a round's requests, and the
    ratios paired request by request."""

    def pooled(kind: str, key: str) -> list[float]:
        out: list[float] = []
        for run in runs[kind]:
            out.extend(run[key] if isinstance(run[key], list) else [run[key]])
        return out

    stats = {
        kind: {key: spread(pooled(kind, key)) for key, _ in FIGURES} for kind in ("stock", "ours")
    }
    restart, stock_cold = pooled("ours", "first_ttft_s"), pooled("stock", "first_ttft_s")
    stock_warm, ours_warm = pooled("stock", "warm_ttft_s"), pooled("ours", "warm_ttft_s")
    return {
        "rounds": rounds,
        "documents": DOCUMENTS,
        "document_tokens": DOCUMENT_TOKENS,
        "stats": stats,
        "hits": {
            kind: {
                key: statistics.median(run[key] for run in runs[kind])
                for key in ("first_hits", "warm_hits")
            }
            for kind in runs
        },
        "ratios": {
            "ours after a restart / stock warm": ratio_figures(restart, stock_warm),
            "ours after a restart / ours warm": ratio_figures(restart, ours_warm),
            "ours after a restart / stock cold": ratio_figures(restart, stock_cold),
            "ours warm / stock warm": ratio_figures(ours_warm, stock_warm),
            "stock cold / stock warm": ratio_figures(stock_cold, stock_warm),
        },
        "runs": runs,
    }


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The case's table, header first: median [min-max] per kind (seconds),
    prefix-cache hits, then the ratios."""
    out = [["figure", "stock", "ours (restarted)"]]
    for key, label in FIGURES:
        cells = [f"{label} (s)"]
        for kind in ("stock", "ours"):
            s = results["stats"][kind][key]
            cells.append("-" if s is None else f"{s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}]")
        out.append(cells)
    hits = results["hits"]
    out.append(
        ["first requests' prefix-cache hits (tokens)"]
        + [f"{hits[kind]['first_hits']:.0f}" for kind in ("stock", "ours")]
    )
    refused = results["connector"]["refused"]
    said = "runs on this build; not measured" if refused is None else f"refused: {refused}"
    out.append(["vLLM's offloading connector, filesystem tier", said, "-"])
    for name, r in results["ratios"].items():
        cell = "-" if r is None else f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
        out.append([name, cell, ""])
    return out


def markdown(results: dict[str, Any]) -> str:
    """:func:`rows` as a Markdown table."""
    return markdown_table(rows(results))


def main() -> None:
    """``python -m extensible_kv.bench.restart MODEL KIND``: one child's figures."""
    print_figures(child(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
