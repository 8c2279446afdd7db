"""The ``elastic`` case of the ``vllm`` suite: a bursty day replayed on
stock vLLM, ours with static growth and ours with ``growth: "elastic"``.

Each engine runs in a process of its own, vLLM's default engine (its engine
core a process with its own loop), on a tiny Llama with 16 KV heads (a block
of 32 tokens is 128 KiB per layer, so a 2 MiB unit holds 16 blocks), a
128 MiB pool, prefix caching on, ``cache_bytes`` 16 MiB (``elastic``) and
128 MiB (``elastic_whole_day``: the whole day's prefixes, as stock's pool
keeps them). The trace: rounds of
0 to 16 requests that rise, peak, fall and idle, the prompts of a round
sharing a 64-token prefix. Each engine reports:

- the KV memory held after each round (ours: ``extensible_kv_state``; stock
  holds its pool whole), beside the bytes the round's requests need;
- the time from the last round's end to the memory being back at its floor
  (unit 0 plus ``cache_bytes``), and the idle memory over that floor (after
  the engine's linger);
- decode tokens/s (8 sequences of 128 new tokens) and time to first token
  (4 new prompts, one token, after an idle second), medians of 5;
- prefix-cache hits over the trace (tokens served from the cache).

Figures are min, median and max over the rounds; ratios are medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extensible_kv.bench.child import (
    BLOCK_TOKENS,
    BYTES_PER_BLOCK,
    SCHEDULER,
    UNIT_BYTES,
    WORKER,
    case_main,
    child_figures,
    markdown_table,
    prompt,
    quiet_vllm_cpu,
    tiny_model,
)
from extensible_kv.bench.measure import MiB
from extensible_kv.bench.ratios import spread

KV_BYTES = 128 * MiB
CACHE_BYTES = 16 * MiB
#: Requests per round: rise, peak, fall, idle.
ROUNDS = (1, 2, 4, 8, 12, 16, 16, 12, 8, 4, 2, 1, 0, 0)
NEW_TOKENS = 16
KINDS = ("stock", "static", "elastic", "elastic_whole_day")
#: ``cache_bytes`` of each elastic kind: the default trade-off, and one
#: that holds the whole day's prefixes (as stock's pool does).
CACHE_OF = {"elastic": CACHE_BYTES, "elastic_whole_day": KV_BYTES}
#: (key, label, unit) of each figure an engine reports.
FIGURES = (
    ("decode_tok_s", "decode", "tok/s"),
    ("ttft_s", "time to first token", "s"),
    ("peak_mib", "KV memory at the peak", "MiB"),
    ("idle_mib", "KV memory idle", "MiB"),
    ("idle_over_floor", "idle over the floor", "x"),
    ("back_s", "load falls to memory back", "s"),
    ("cached_tokens", "prefix-cache hits", "tokens"),
)


def round_prompts(round_: int, size: int) -> list[list[int]]:
    return [prompt(100 * round_ + i, 100 + 23 * i, shared=64) for i in range(size)]


def needed_bytes(size: int) -> int:
    """KV bytes a round's requests hold together at their end."""
    tokens = [100 + 23 * i + NEW_TOKENS for i in range(size)]
    return sum(-(-t // BLOCK_TOKENS) for t in tokens) * BYTES_PER_BLOCK


def _hold_mib(tokens: Any) -> float:
    """MiB the blocks of requests of these token counts take."""
    return float(sum(-(-t // BLOCK_TOKENS) for t in tokens) * BYTES_PER_BLOCK / MiB)


def _engine(model: str, kind: str) -> Any:
    from vllm import LLM

    elastic = {"growth": "elastic", "cache_bytes": CACHE_OF.get(kind, 0)}
    return LLM(
        model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        block_size=BLOCK_TOKENS,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=KV_BYTES,
        worker_cls="auto" if kind == "stock" else WORKER,
        scheduler_cls=SCHEDULER if kind in CACHE_OF else None,
        additional_config={"extensible_kv": elastic if kind in CACHE_OF else {}},
    )


def child(model: str, kind: str) -> dict[str, Any]:
    """One engine of ``kind``, in this process: the trace and its figures."""
    quiet_vllm_cpu()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(model, kind)

    def held() -> float:
        if kind == "stock":
            return KV_BYTES / MiB
        return float(llm.collective_rpc("extensible_kv_state")[0]["physical_bytes"]) / MiB

    def params(tokens: int) -> Any:
        return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)

    def generate(prompts: list[list[int]], tokens: int) -> list[Any]:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return list(llm.generate(batch, params(tokens), use_tqdm=False))

    engine, started = llm.llm_engine, time.perf_counter()
    # [seconds, MiB held, MiB the running requests' blocks take, round]
    timeline: list[list[float]] = []
    memory, cached, back_s = [], 0, None
    for round_, size in enumerate(ROUNDS):
        running: dict[str, int] = {}
        for i, ids in enumerate(round_prompts(round_, size)):
            engine.add_request(
                f"{round_}-{i}", TokensPrompt(prompt_token_ids=ids), params(NEW_TOKENS)
            )
            running[f"{round_}-{i}"] = len(ids)
        peak = held()
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens = len(output.prompt_token_ids or ()) + len(output.outputs[0].token_ids)
                running[output.request_id] = tokens
                if output.finished:
                    cached += int(output.num_cached_tokens or 0)
                    del running[output.request_id]
            now = held()
            peak = max(peak, now)
            timeline.append(
                [time.perf_counter() - started, now, _hold_mib(running.values()), round_]
            )
        if round_ == ROUNDS.index(0):
            fell, floor = time.perf_counter(), (UNIT_BYTES + CACHE_OF.get(kind, 0)) / MiB
            while held() > floor and time.perf_counter() - fell < 5:
                time.sleep(0.01)
            back_s = time.perf_counter() - fell
        timeline.append([time.perf_counter() - started, held(), 0.0, round_])
        memory.append([round_, size, needed_bytes(size) / MiB, peak])
    decode, ttft = [], []
    for repeat in range(5):
        start = time.perf_counter()
        outputs = generate([prompt(9000 + repeat * 8 + i, 64) for i in range(8)], 128)
        decode.append(
            sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        )
        time.sleep(1.0)
        start = time.perf_counter()
        generate([prompt(7000 + repeat * 4 + i, 200) for i in range(4)], 1)
        ttft.append(time.perf_counter() - start)
    from extensible_kv.integrations.vllm.scheduler.scheduler import LINGER_S

    # Idle is after the linger: through it, an elastic engine keeps the
    # blocks ahead of its last step for a request that comes right after.
    time.sleep(LINGER_S + 1.0)
    idle = held()
    return {
        "decode_tok_s": statistics.median(decode),
        "ttft_s": statistics.median(ttft),
        "peak_mib": max(row[3] for row in memory),
        "idle_mib": idle,
        "idle_over_floor": idle / ((UNIT_BYTES + CACHE_OF.get(kind, CACHE_BYTES)) / MiB),
        "back_s": back_s if kind in CACHE_OF else None,
        "cached_tokens": cached,
        "memory": memory,
        "timeline": timeline,
    }


def case(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every kind, ``rounds`` times, in turn (vLLM must be installed)."""
    model = tiny_model()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for round_ in range(rounds):
        for kind in KINDS:
            progress(f"elastic, round {round_ + 1}/{rounds}: {kind}")
            runs[kind].append(child_figures(__name__, model, kind))
    stats = {
        kind: {key: spread([run[key] for run in kind_runs]) for key, _, _ in FIGURES}
        for kind, kind_runs in runs.items()
    }
    return {
        "rounds": rounds,
        "kv_bytes": KV_BYTES,
        "cache_bytes": CACHE_BYTES,
        "stats": stats,
        "ratios": {
            "decode elastic / static": _ratio(stats, "elastic", "static", "decode_tok_s"),
            "time to first token elastic / static": _ratio(stats, "elastic", "static", "ttft_s"),
            "prefix-cache hits elastic / stock": _ratio(stats, "elastic", "stock", "cached_tokens"),
        },
        "memory": {kind: kind_runs[-1]["memory"] for kind, kind_runs in runs.items()},
        "timelines": {kind: kind_runs[-1]["timeline"] for kind, kind_runs in runs.items()},
        "runs": {
            kind: [
                {k: v for k, v in run.items() if k not in ("memory", "timeline")}
                for run in kind_runs
            ]
            for kind, kind_runs in runs.items()
        },
    }


def _ratio(stats: dict[str, Any], ours: str, theirs: str, key: str) -> float | None:
    a, b = stats[ours][key], stats[theirs][key]
    if a is None or b is None or not b["median"]:
        return None
    return float(a["median"] / b["median"])


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The case's table, header first: median [min-max] per kind."""
    out = [["figure", *KINDS]]
    for key, label, unit in FIGURES:
        cells = [f"{label} ({unit})"]
        for kind in KINDS:
            s = results["stats"][kind][key]
            cells.append("-" if s is None else f"{s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}]")
        out.append(cells)
    for name, ratio in results["ratios"].items():
        out.append([name, "-" if ratio is None else f"{ratio:.2f}", *([""] * (len(KINDS) - 1))])
    return out


def markdown(results: dict[str, Any]) -> str:
    """:func:`rows` as a Markdown table."""
    return markdown_table(rows(results))


def plot(results: dict[str, Any], path: Path) -> Path:
    """KV memory held over the trace, per kind, beside what the running
    requests' blocks take, as a PNG."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for kind, points in results["timelines"].items():
        xs = _round_positions(points)
        ax.plot(xs, [p[1] for p in points], label=f"{kind}: KV memory held")
    points = results["timelines"]["elastic"]
    ax.fill_between(
        _round_positions(points),
        [p[2] for p in points],
        color="0.85",
        step="post",
        label="elastic: the running requests' blocks",
    )
    floor = (UNIT_BYTES + results["cache_bytes"]) / MiB
    ax.axhline(floor, color="0.4", linestyle=":", label="floor: unit 0 + cache_bytes")
    ax.set_xticks(range(len(ROUNDS)), [str(n) for n in ROUNDS])
    ax.set_xlabel("requests in each round of the trace (each kind its own run)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(
        "vLLM (CPU build), a bursty day of "
        + ", ".join(str(n) for n in ROUNDS)
        + " requests: KV memory"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _round_positions(points: list[list[float]]) -> list[float]:
    """Each sample's place on a round axis: round ``r`` spans ``[r, r + 1)``,
    its samples spread evenly, so that every kind's run lines up."""
    per_round: dict[int, int] = {}
    for point in points:
        per_round[int(point[3])] = per_round.get(int(point[3]), 0) + 1
    seen: dict[int, int] = {}
    out = []
    for point in points:
        r = int(point[3])
        out.append(r + seen.get(r, 0) / per_round[r])
        seen[r] = seen.get(r, 0) + 1
    return out


if __name__ == "__main__":
    case_main(child)
