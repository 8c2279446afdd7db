"""``extensible-kv probe | demo | bench``: what this machine can do, the
runner flow, and the benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from extensible_kv.demo import FlowReport, FlowSettings, ModelConfig, run_flow, run_ranks
from extensible_kv.driver import get_driver, unavailable_reason
from extensible_kv.driver.select import is_rocm

MiB = 1 << 20
console = Console()


def _probe_rows() -> list[dict[str, str]]:
    rows = []
    reason = unavailable_reason("cpu")
    host = {
        "device": "cpu",
        "backend": "host (Linux mmap/memfd)",
        "usable": "yes" if reason is None else "no",
    }
    if reason is None:
        driver = get_driver("cpu")
        host |= {
            "granularity": f"{driver.granularity(0, False) / MiB:g} MiB",
            "shareable": "memfd",
            "rdma": "-",
        }
    rows.append(host | {"notes": reason or "THP + populate; also the tests' backend"})
    backend = "HIP (hip-python)" if is_rocm() else "CUDA (cuda-bindings)"
    reason = unavailable_reason("cuda:0")
    if reason is not None:
        rows.append({"device": "cuda", "backend": backend, "usable": "no", "notes": reason})
        return rows
    gpu: Any = get_driver("cuda:0")
    for index in range(gpu.device_count()):
        row = {"device": f"cuda:{index}", "backend": backend}
        reason = unavailable_reason(f"cuda:{index}")
        if reason is None:
            posix_fd, rdma = (
                gpu.capabilities(index) if hasattr(gpu, "capabilities") else (False, False)
            )
            row |= {
                "usable": "yes",
                "granularity": f"{gpu.granularity(index, False) / MiB:g} MiB",
                "shareable": "POSIX fd" if posix_fd else "no",
                "rdma": "yes" if rdma else "no",
                "notes": torch.cuda.get_device_name(index) if torch.cuda.is_available() else "",
            }
        else:
            row |= {"usable": "no", "notes": reason}
        rows.append(row)
    return rows


def probe(args: argparse.Namespace) -> int:
    rows = _probe_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ("device", "backend", "usable", "granularity", "shareable", "rdma")
    table = Table(title="extensible-kv backends on this machine")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(row.get(c, "") for c in columns))
    console.print(table)
    for row in rows:
        if row.get("notes"):
            console.print(f"[bold]{row['device']}[/]: {row['notes']}")
    return 0


class _Bars:
    """The flow's progress as rich bars, one per phase."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task: Any = None

    def start(self, phase: str, total: int) -> None:
        self._task = self._progress.add_task(phase, total=total)

    def advance(self) -> None:
        self._progress.advance(self._task)


def _timeline_table(report: FlowReport) -> Table:
    table = Table(title=f"memory timeline on {report.device}")
    for column in ("phase", "reserved", "committed", "physical", "device in use", "took"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    base = report.timeline[0].device_used_bytes - report.timeline[0].physical_bytes
    for p in report.timeline:
        table.add_row(
            p.name,
            f"{p.reserved_bytes / MiB:.1f} MiB",
            f"{p.committed_bytes / MiB:.1f} MiB",
            f"{p.physical_bytes / MiB:.1f} MiB",
            f"{(p.device_used_bytes - base) / MiB:+.1f} MiB",
            f"{p.seconds * 1e3:.1f} ms",
        )
    return table


def _plot(report: FlowReport, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [p.name for p in report.timeline]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    base = report.timeline[0].device_used_bytes - report.timeline[0].physical_bytes
    for label, values, style in (
        ("reserved", [p.reserved_bytes for p in report.timeline], "-"),
        ("physical", [p.physical_bytes for p in report.timeline], "-"),
        ("committed", [p.committed_bytes for p in report.timeline], "--"),
        ("device in use (from start)", [p.device_used_bytes - base for p in report.timeline], ":"),
    ):
        ax.plot(x, [v / MiB for v in values], style, marker="o", label=label, linewidth=2)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("MiB")
    ax.set_title(f"extensible-kv demo on {report.device}: KV memory through the runner flow")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device) if args.device else _best_device()
    settings = _settings(args)
    if args.world_size > 1:
        return _demo_ranks(args.world_size, settings, device)
    console.print(
        f"[bold]extensible-kv demo[/] on [bold]{device}[/]: a {args.layers}-layer paged decoder"
    )
    columns = (
        TextColumn("{task.description:<15}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        report = run_flow(device, settings, _Bars(progress))
    console.print(f"sizing: {report.sizing.describe()}")
    if report.cuda_graph:
        console.print("CUDA graph: captured at warm-up, replayed after growth, sleep and wake")
    console.print(_timeline_table(report))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeline.json").write_text(
        json.dumps(
            {
                "device": report.device,
                "ok": report.ok,
                "sizing": asdict(report.sizing),
                "timeline": [asdict(p) for p in report.timeline],
            },
            indent=2,
        )
    )
    if _plot(report, out / "timeline.png"):
        console.print(f"timeline saved: {out / 'timeline.png'} and {out / 'timeline.json'}")
    else:
        note = "install matplotlib (extra 'plot') for the PNG"
        console.print(f"timeline saved: {out / 'timeline.json'} ({note})")
    if report.ok:
        console.print(
            "[green]ok[/]: tokens before and after sleep match the model on ordinary torch memory"
        )
        return 0
    console.print("[red]MISMATCH[/]: tokens differ from the model on ordinary torch memory")
    return 1


def _settings(args: argparse.Namespace) -> FlowSettings:
    return FlowSettings(
        model=ModelConfig(layers=args.layers),
        batch=args.batch,
        new_tokens=args.new_tokens,
        capacity_blocks=args.capacity_blocks,
        kv_budget_bytes=None if args.kv_budget_mib is None else args.kv_budget_mib * MiB,
        memory_utilization=args.memory_utilization,
        cuda_graph=False if args.no_graph else None,
    )


def _demo_ranks(world_size: int, settings: FlowSettings, device: torch.device) -> int:
    """The flow on tensor-parallel ranks: each sizes, all commit the minimum."""
    enough_gpus = device.type == "cuda" and torch.cuda.device_count() >= world_size
    device_type = "cuda" if enough_gpus else "cpu"
    console.print(
        f"[bold]extensible-kv demo[/] on {world_size} ranks ({device_type}, gloo); rank r sizes "
        f"to a budget r/(2 x {world_size}) below the capacity, as if its device had less free"
    )
    reports = run_ranks(world_size, settings, device_type)
    table = Table(title="rank agreement")
    for column in ("rank", "device", "proposed blocks", "committed blocks", "tokens match"):
        table.add_column(column)
    for rank, report in enumerate(reports):
        table.add_row(
            str(rank),
            report.device,
            str(report.sizing.num_blocks),
            str(report.num_blocks),
            str(report.ok),
        )
    console.print(table)
    smallest = min(report.sizing.num_blocks for report in reports)
    if all(report.num_blocks == smallest and report.ok for report in reports):
        console.print(
            "[green]ok[/]: every rank committed the smallest proposal and its tokens match"
        )
        return 0
    console.print("[red]MISMATCH[/]: ranks disagree or tokens differ")
    return 1


def bench(args: argparse.Namespace) -> int:
    from extensible_kv.bench import BenchPlan, run, save
    from extensible_kv.bench.report import tables

    device = torch.device(args.device) if args.device else _best_device()
    plan = BenchPlan.for_device(device, args.quick)
    if args.repeats:
        plan = BenchPlan(**(vars(plan) | {"repeats": args.repeats}))
    console.print(f"[bold]extensible-kv bench[/] on [bold]{device}[/], {plan.repeats} repeats")
    names = ("commit_vs_zeros", "growth", "sleep_wake", "view_access", "bookkeeping", "overhead")
    with Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("starting", total=len(names))

        def advance(name: str) -> None:
            progress.update(task, description=name, completed=names.index(name))

        results = run(device, plan, advance)
        progress.update(task, description="done", completed=len(names))
    for table in tables(results):
        console.print(table)
    files = save(results, args.out)
    console.print("written: " + ", ".join(str(path) for path in files))
    return 0


def _best_device() -> torch.device:
    if unavailable_reason("cuda") is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extensible-kv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("probe", help="which backends work here, and why not")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=probe)
    d = commands.add_parser("demo", help="the runner flow on a tiny paged-attention model")
    d.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: GPU if usable, else cpu)"
    )
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--new-tokens", type=int, default=40)
    d.add_argument(
        "--capacity-blocks", type=int, default=8192, help="upper bound reserved (blocks)"
    )
    d.add_argument("--kv-budget-mib", type=int, default=None, help="size the cache to this budget")
    d.add_argument(
        "--memory-utilization", type=float, default=None, help="size to this share of the device"
    )
    d.add_argument("--no-graph", action="store_true", help="no CUDA graph on a GPU")
    d.add_argument(
        "--world-size", type=int, default=1, help="run as this many tensor-parallel ranks (gloo)"
    )
    d.add_argument(
        "--out", type=Path, default=Path("extensible-kv-demo"), help="folder for the timeline"
    )
    d.set_defaults(run=demo)
    b = commands.add_parser("bench", help="benchmarks against the baselines, as ratios")
    b.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: GPU if usable)")
    b.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    b.add_argument("--quick", action="store_true", help="small sizes (seconds, for a smoke test)")
    b.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG"
    )
    b.set_defaults(run=bench)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
