"""Benchmark results as terminal tables and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

MiB = 1 << 20
GiB = 1 << 30


def _ms(stats: dict[str, float]) -> str:
    return f"{stats['median'] * 1e3:.1f} ms [{stats['min'] * 1e3:.1f}-{stats['max'] * 1e3:.1f}]"


def _us(stats: dict[str, float]) -> str:
    """Microseconds (min/median/max already in us) as median [min-max]."""
    return f"{stats['median']:.1f} us [{stats['min']:.1f}-{stats['max']:.1f}]"


def tables(results: dict[str, Any]) -> list[Table]:
    """One table per suite; times are median [min-max], ratios baseline/ours."""
    out = []
    table = Table(title="1. commit + zero N bytes vs torch.zeros(N)")
    for column in ("N", "ours", "torch.zeros", "ratio"):
        table.add_column(column, justify="right")
    for row in results["commit_vs_zeros"]:
        table.add_row(
            f"{row['bytes'] // MiB} MiB",
            _ms(row["ours"]),
            _ms(row["torch_zeros"]),
            f"{row['ratio']:.2f}x",
        )
    out.append(table)

    growth = results["growth"]
    table = Table(
        title=f"2. growth to {growth['total_bytes'] // MiB} MiB in {growth['steps']} steps "
        f"(GPU peers: cuda.core, expandable segments: {growth['gpu_peers']})"
    )
    for column in (
        "who",
        "whole growth",
        "step at 1/4",
        "step at 1/2",
        "last step",
        "ours faster by",
    ):
        table.add_column(column, justify="right")
    for name, entry in growth.items():
        if isinstance(entry, dict):
            steps = entry["steps"]
            table.add_row(
                name,
                _ms(entry["whole_growth"]),
                _ms(steps["quarter"]),
                _ms(steps["half"]),
                _ms(steps["full"]),
                f"{entry['ratio_to_ours']:.1f}x",
            )
    out.append(table)

    sleep = results["sleep_wake"]
    size = sleep["bytes"] // MiB
    table = Table(title=f"3. sleep + wake of {sleep['layers']} layers x 2 segments, {size} MiB")
    table.add_column("what")
    table.add_column("time", justify="right")
    for key, label in (
        ("release_recommit", "release + recommit (discard)"),
        ("preserving", "preserving release + recommit"),
        ("preserving_reserved_ahead", "the same, wake memory reserved ahead while asleep"),
        ("plain_copy_roof", "plain copy_ out and back (roof)"),
        ("per_allocation_sleep", "per-allocation sleep (sync backup)"),
    ):
        table.add_row(label, _ms(sleep[key]))
    table.add_row(
        "preserving, share of the roof's speed", f"{sleep['preserving_fraction_of_roof']:.0%}"
    )
    table.add_row(
        "reserved ahead, share of the roof's speed",
        f"{sleep['reserved_ahead_fraction_of_roof']:.0%}",
    )
    table.add_row(
        "preserving vs per-allocation", f"{sleep['preserving_vs_per_allocation']:.2f}x faster"
    )
    out.append(table)

    wake = results["large_wake"]
    size = f"{wake['bytes'] / GiB:.1f} GiB"
    table = Table(title=f"3c. discarding wake of {size} (32 layers) vs the memset floor")
    for column in ("wake", "time", "x the floor (GPU goal <= 2)"):
        table.add_column(column, justify="right")
    table.add_row("memory created by the wake", _ms(wake["cold"]), f"{wake['cold_vs_floor']:.1f}x")
    table.add_row(
        "memory reserved ahead while asleep",
        _ms(wake["reserved_ahead"]),
        f"{wake['reserved_ahead_vs_floor']:.1f}x",
    )
    table.add_row("zero_() of as many bytes (floor)", _ms(wake["memset_floor"]), "1.0x")
    out.append(table)

    beside = results["release_beside_work"]
    table = Table(title="3a. a release while another stream works: device-wide vs stream-ordered")
    if "skipped" in beside:
        table.add_column("not measured")
        table.add_row(beside["skipped"])
    else:
        for column in ("device-wide wait", "its own stream only", "faster by"):
            table.add_column(column, justify="right")
        table.add_row(_ms(beside["device_wide"]), _ms(beside["streams"]), f"{beside['ratio']:.1f}x")
    out.append(table)

    regrow = results["pooled_regrowth"]
    table = Table(
        title=f"3b. grow {regrow['bytes'] // MiB} MiB back after a trim: pooled handles vs new"
    )
    for column in ("new from the driver", "from a warm pool", "speed-up", "pool GB/s"):
        table.add_column(column, justify="right")
    table.add_row(
        _ms(regrow["driver"]),
        _ms(regrow["pool"]),
        f"{regrow['ratio']:.2f}x",
        f"{regrow['pool_GBps']:.1f}",
    )
    out.append(table)

    view = results["view_access"]
    table = Table(
        title=f"4. bandwidth kernels over {view['bytes'] // MiB} MiB: our views vs ordinary"
    )
    for column in ("kernel", "ours", "ordinary", "ratio (goal >= 0.98)"):
        table.add_column(column, justify="right")
    for kernel in ("copy", "fill"):
        row = view[kernel]
        table.add_row(kernel, _ms(row["ours"]), _ms(row["ordinary"]), f"{row['ratio']:.3f}")
    out.append(table)

    book = results["bookkeeping"]
    table = Table(title="5. one more granule committed, as the buffer grows (median per commit)")
    for column in ("granules", "bookkeeping alone", "host driver, 4 KiB granules"):
        table.add_column(column, justify="right")
    null, host = book["null_driver_seconds_per_commit"], book["host_4KiB_seconds_per_commit"]
    for count in sorted(set(map(int, null)) | set(map(int, host))):
        a, b = null.get(count, null.get(str(count))), host.get(count, host.get(str(count)))
        table.add_row(
            str(count), f"{a * 1e6:.1f} us" if a else "-", f"{b * 1e6:.1f} us" if b else "-"
        )
    table.caption = f"driver calls per commit: {book['driver_calls_per_commit']:.2f}"
    out.append(table)

    table = Table(title="6. physical overhead (physical - committed) per layout")
    blocks = sorted({int(b) for rows in results["overhead"].values() for b in rows})
    table.add_column("layout")
    for count in blocks:
        table.add_column(f"{count} blocks", justify="right")
    for name, rows in results["overhead"].items():
        cells = []
        for count in blocks:
            row = rows.get(count, rows.get(str(count)))
            share = row["overhead"] / row["committed"]
            cells.append(f"{row['overhead'] / MiB:.1f} MiB ({share:.0%})")
        table.add_row(name, *cells)
    out.append(table)
    out.append(budget_table(results["budget"]))
    vllm = vllm_table(results.get("vllm"))
    if vllm is not None:
        out.append(vllm)
    if "goals" in results.get("vllm", {}):
        out.append(vllm_goals_table(results["vllm"]))
    if "elastic" in results.get("vllm", {}):
        out.append(elastic_table(results["vllm"]["elastic"]))
    if "several" in results.get("vllm", {}):
        out.append(several_table(results["vllm"]["several"]))
        if "trace" in results["vllm"]["several"]:
            out.append(trace_table(results["vllm"]["several"]["trace"]))
    if "give_way" in results.get("vllm", {}):
        out.append(give_way_table(results["vllm"]["give_way"]))
    if "restart" in results.get("vllm", {}):
        out.append(restart_table(results["vllm"]["restart"]))
    if "scheduler" in results:
        out.extend(scheduler_tables(results["scheduler"]))
    out.append(goals(results))
    return out


def budget_table(budget: dict[str, Any]) -> Table:
    """The ``budget`` suite: a claim's cost in a 2 MiB commit and alone,
    and switching engines under a limit against starting one."""
    commit, claim, switch = budget["commit"], budget["claim"], budget["switch"]
    table = Table(
        title=f"7. the shared budget, on the host: {commit['bytes'] // MiB} MiB commits and "
        f"claims; switching engines of {switch['cache_bytes'] // MiB} MiB under a limit"
    )
    table.add_column("what")
    for column in ("time", "vs the baseline"):
        table.add_column(column, justify="right")
    table.add_row("commit + release, raw backend", _us(commit["raw_us"]), "baseline")
    for key, label in (("no_limit", "no limit"), ("limit", "under a limit")):
        table.add_row(
            f"the same through BudgetDriver, {label}",
            _us(commit[f"{key}_us"]),
            f"{commit[f'{key}_vs_raw']:.3f}x ({commit[f'{key}_overhead_pct']:+.1f}%, "
            f"{commit[f'{key}_added_us']:+.1f} us)",
        )
    table.add_row("Ledger.claim + give_back, no limit", _us(claim["no_limit_us"]), "-")
    table.add_row("the same under a limit", _us(claim["limit_us"]), "-")
    table.add_row(
        "switch: A's release_physical + B's recommit", _ms(switch["switch_s"]), "baseline"
    )
    table.add_row("of which the release", _ms(switch["release_s"]), "-")
    table.add_row("of which the recommit", _ms(switch["recommit_s"]), "-")
    table.add_row(
        "start B from nothing: spawn to committed",
        _ms(switch["start_s"]),
        f"{switch['start_vs_switch']:.0f}x the switch",
    )
    table.add_row("of which making and committing the cache", _ms(switch["start_commit_s"]), "-")
    table.caption = (
        f"limit {switch['limit_bytes'] // MiB} MiB; {switch['engines_started']} engines "
        f"started, {switch['switches']} switches; {commit['samples']} samples of "
        f"{commit['cycles_per_sample']} commits and of {claim['pairs_per_sample']} claims"
    )
    return table


def vllm_table(vllm: dict[str, Any] | None) -> Table | None:
    """The ``vllm`` suite: median [min-max] per kind and ours / stock, or a
    one-line table saying why it did not run; None for results without it."""
    if vllm is None:
        return None
    if "skipped" in vllm:
        table = Table(title="10. vLLM, stock and on extensible-kv")
        table.add_column("skipped")
        table.add_row(vllm["skipped"])
        return table
    from extensible_kv.bench.engine import rows

    return _table(
        f"10. vLLM, stock and on extensible-kv ({vllm['kv_bytes'] // MiB} MiB KV, "
        f"{vllm['rounds']} rounds): median [min-max]",
        rows(vllm),
    )


def vllm_goals_table(vllm: dict[str, Any]) -> Table:
    """The ``vllm`` suite's goals: each ratio, median [interval], and whether
    it settles the goal."""
    from extensible_kv.bench.engine import goal_rows

    return _table("10b. vLLM goals, ours against stock", goal_rows(vllm))


def elastic_table(elastic: dict[str, Any]) -> Table:
    """The ``vllm`` suite's ``elastic`` case: a bursty day, median [min-max]."""
    from extensible_kv.bench.elastic import rows

    return _table(
        f"11. vLLM on a bursty day: stock, static and elastic growth "
        f"({elastic['kv_bytes'] // MiB} MiB KV, {elastic['rounds']} rounds): median [min-max]",
        rows(elastic),
    )


def several_table(several: dict[str, Any]) -> Table:
    """The ``vllm`` suite's ``several`` case: two servers under one limit
    against a static split of it, median [min-max], and the goals."""
    from extensible_kv.bench.several import rows

    return _table(
        f"12. two vLLM servers under one {several['limit_bytes'] // MiB} MiB limit, alternating "
        f"bursts, against a static split ({several['rounds']} rounds): median [min-max]",
        rows(several),
    )


def trace_table(results: dict[str, Any]) -> Table:
    """The ``several`` case's trace replay: three servers on slices of the
    Azure LLM inference trace, against the even and the best static split."""
    from extensible_kv.bench.trace import rows

    return _table(
        f"12b. three vLLM servers under one {results['limit_bytes'] // MiB} MiB limit "
        "replaying the Azure LLM inference trace 2023, against static splits: "
        "median [min-max]",
        rows(results),
    )


def give_way_table(results: dict[str, Any]) -> Table:
    """The ``give_way`` case: how soon an idle engine gives way, each way it
    is run."""
    from extensible_kv.bench.give_way import rows

    return _table(
        "12d. an idle vLLM engine giving way to another's want, as a server, an LLM "
        "program and a program on two ranks: median [min-max]",
        rows(results),
    )


def restart_table(results: dict[str, Any]) -> Table:
    """The ``restart`` case: the first requests after a restart that keeps
    the prefix cache, against stock vLLM cold and warm."""
    from extensible_kv.bench.restart import rows

    return _table(
        f"12c. vLLM restarted: {results['documents']} documents of "
        f"{results['document_tokens']} tokens, a question each, one token; ours "
        f"keeping the prefix cache, stock cold and warm ({results['rounds']} rounds): "
        "median [min-max]",
        rows(results),
    )


def scheduler_tables(results: dict[str, Any]) -> list[Table]:
    """The ``scheduler`` suite: each side's time per step and the ratios,
    the step where the load falls, where ours's time goes, and the driver
    calls of a burst; where vLLM is missing, why the schedulers did not run."""
    from extensible_kv.bench import scheduler

    out = []
    if "skipped" in results:
        table = Table(title="13. vLLM's scheduler and ours, no model")
        table.add_column("skipped")
        table.add_row(results["skipped"])
        out.append(table)
    else:
        profile = results["profile"]
        out += [
            _table(
                f"13. vLLM's scheduler and ours, no model: ms per step, schedule() + "
                f"update_from_output() ({results['load']} requests, {results['steps']} steps)",
                scheduler.rows(results),
            ),
            _table(
                "13b. the step where the load falls, each burst's", scheduler.falling_rows(results)
            ),
            _table(
                f"13c. where ours's time goes: cProfile on {profile['trace']} at "
                f"{profile['scale']}, {profile['total_s']:.2f} s in all; most own time",
                scheduler.profile_rows(results),
            ),
            _table(
                "13d. extensible-kv's functions in that profile, most cumulative time",
                scheduler.profile_rows(results, "ours"),
            ),
        ]
    calls = results["driver_calls"]
    out.append(
        _table(f"13e. driver calls: {scheduler.driver_title(calls)}", scheduler.driver_rows(calls))
    )
    return out


def _table(title: str, rows: list[list[str]]) -> Table:
    """A rich table of ``rows``, header first, right-aligned."""
    table = Table(title=title)
    head, *body = rows
    for column in head:
        table.add_column(column, justify="right")
    for cells in body:
        table.add_row(*cells)
    return table


#: What a GPU row says on a machine without one.
NOT_MEASURED = "not measured on this machine (no GPU)"


def goals(results: dict[str, Any]) -> Table:
    """The performance goals, each with what this run measured for it."""
    on_gpu = str(results["device"]).startswith("cuda")
    table = Table(title="Goals (ratios of medians)")
    for column in ("goal", "target", "measured"):
        table.add_column(column)
    zeros = ", ".join(
        f"{row['bytes'] / GiB:g} GiB: {1 / row['ratio']:.2f}" for row in results["commit_vs_zeros"]
    )
    regrow, wake = results["pooled_regrowth"], results["large_wake"]
    sleep, beside = results["sleep_wake"], results["release_beside_work"]
    steps = {int(k): v for k, v in results["bookkeeping"]["null_driver_seconds_per_commit"].items()}
    flat = [v * 1e6 for k, v in steps.items() if k >= 10]
    rows = (
        ("GPU commit + zero / torch.zeros", "<= 1.1", zeros),
        ("GPU commit throughput, pool warm", ">= 50 GB/s", f"{regrow['pool_GBps']:.1f} GB/s"),
        (
            "GPU wake (discarding) / memset floor",
            "<= 2 at 64 GiB",
            f"{wake['cold_vs_floor']:.1f} at {wake['bytes'] / GiB:.1f} GiB "
            f"({wake['reserved_ahead_vs_floor']:.1f} with its memory reserved ahead)",
        ),
    )
    for goal, target, measured in rows:
        table.add_row(goal, target, measured if on_gpu else NOT_MEASURED)
    table.add_row(
        "preserving sleep + wake, share of a plain copy_'s speed",
        ">= 0.8",
        f"{sleep['preserving_fraction_of_roof']:.2f} "
        f"({sleep['reserved_ahead_fraction_of_roof']:.2f} with the wake's memory reserved ahead)",
    )
    table.add_row(
        "a release beside work on another stream",
        "does not wait for it",
        NOT_MEASURED
        if "skipped" in beside
        else f"{beside['streams']['median'] * 1e3:.1f} ms with its own stream, "
        f"{beside['device_wide']['median'] * 1e3:.1f} ms waiting for the device",
    )
    table.add_row(
        "bookkeeping per commit",
        "flat to 100k granules",
        f"{min(flat):.0f}-{max(flat):.0f} us from 10 to {max(steps):,} granules",
    )
    commit, claim = results["budget"]["commit"], results["budget"]["claim"]
    table.add_row(
        "the budget's cost on a 2 MiB host commit + release",
        f"<= {commit['overhead_goal_pct']:g}%",
        f"{commit['no_limit_overhead_pct']:+.1f}% with no limit, "
        f"{commit['limit_overhead_pct']:+.1f}% under one "
        f"({'met' if commit['overhead_goal_met'] else 'not met'})",
    )
    table.add_row(
        "a claim + give_back, under a limit",
        f"<= {claim['claim_goal_us']:g} us",
        f"{claim['limit_us']['median']:.1f} us, {claim['no_limit_us']['median']:.1f} us "
        f"with no limit ({'met' if claim['claim_goal_met'] else 'not met'})",
    )
    return table


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots of the suites; none if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    device = results["device"]

    ax = axes[0][0]
    rows = results["commit_vs_zeros"]
    ax.bar(
        [f"{r['bytes'] // MiB} MiB" for r in rows], [r["ratio"] for r in rows], color="tab:green"
    )
    ax.axhline(1, color="grey", linewidth=1)
    ax.set_title("commit + zero vs torch.zeros (x faster)")

    ax = axes[0][1]
    growth = results["growth"]
    names = [n for n, e in growth.items() if isinstance(e, dict)]
    marks = ("quarter", "half", "full")
    for i, name in enumerate(names):
        values = [growth[name]["steps"][m]["median"] * 1e3 for m in marks]
        ax.bar([x + i * 0.8 / len(names) for x in range(3)], values, 0.8 / len(names), label=name)
    ax.set_xticks(range(3), ["1/4", "1/2", "full"])
    ax.set_yscale("log")
    ax.set_ylabel("ms per growth step")
    ax.set_title(f"growth step cost at 1/4, 1/2, all of {growth['total_bytes'] // MiB} MiB")
    ax.legend()

    ax = axes[1][0]
    book = results["bookkeeping"]
    for key, label in (
        ("null_driver_seconds_per_commit", "bookkeeping alone"),
        ("host_4KiB_seconds_per_commit", "host driver, 4 KiB granules"),
    ):
        points = sorted((int(k), v * 1e6) for k, v in book[key].items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("granules mapped")
    ax.set_ylabel("us per commit of one granule")
    ax.set_title("commit cost as the buffer grows (flat is the goal)")
    ax.legend()

    ax = axes[1][1]
    for name, rows in results["overhead"].items():
        points = sorted((int(k), v["overhead"] / v["committed"] * 100) for k, v in rows.items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("blocks committed")
    ax.set_ylabel("physical overhead, % of committed")
    ax.set_title("physical overhead per layout")
    ax.legend(fontsize=8)

    fig.suptitle(f"extensible-kv bench on {device} ({results['date']})")
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)
    vllm = results.get("vllm")
    if vllm is not None and "skipped" not in vllm:
        from extensible_kv.bench import elastic, several, trace

        files.append(plot_vllm(vllm, out / "vllm-memory.png"))
        files.append(elastic.plot(vllm["elastic"], out / "elastic-memory.png"))
        if "several" in vllm:
            files.append(several.plot(vllm["several"], out / "several-memory.png"))
            if "trace" in vllm["several"]:
                files.append(trace.plot(vllm["several"]["trace"], out / "several-trace.png"))
    return files


def plot_vllm(vllm: dict[str, Any], path: Path) -> Path:
    """Each kind's resident memory over its run, phases marked, as a PNG."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for kind, timeline in vllm["timelines"].items():
        points = timeline["points"]
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], label=kind)
        for at, label in timeline["marks"]:
            ax.axvline(at, color=line.get_color(), linewidth=0.6, linestyle=":")
            ax.annotate(
                label,
                (at, 0),
                xytext=(2, 2),
                textcoords="offset points",
                fontsize=7,
                color=line.get_color(),
                rotation=90,
            )
    ax.set_xlabel("seconds since the engine was made")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"vLLM engine process memory: start, generate, sleep(level=1), wake, restart "
        f"({vllm['kv_bytes'] // MiB} MiB KV)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
