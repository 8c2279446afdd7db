"""The extensible-kv command: what this machine can do (probe), the runner
flow on a tiny model (demo), the benchmarks (bench), and the budget shared
by every process (limit, top)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from extensible_kv.budget import (
    SCHEMA_VERSION,
    Ledger,
    Limit,
    StateDirError,
    format_bytes,
    parse_size,
    snapshot,
    state_dir,
)
from extensible_kv.budget.liveness import one_line
from extensible_kv.budget.snapshot import device_type
from extensible_kv.demo import FlowReport, FlowSettings, ModelConfig, run_flow, run_ranks
from extensible_kv.devices import get_driver
from extensible_kv.driver import (
    BackendUnavailableError,
    DriverError,
    backend,
    parse_device,
    unavailable_reason,
)
from extensible_kv.driver.select import is_rocm
from extensible_kv.kept import drop, kept_caches
from extensible_kv.limits import (
    KEEP,
    FloorAndCap,
    NamedDevice,
    named_device,
    read_cap,
    read_floor,
    set_device_limit,
    set_floor_and_cap,
    total_bytes,
)
from extensible_kv.top import live, render

MiB = 1 << 20
# Wide enough that no table cuts a name or a figure when the output is not a
# terminal (rich assumes 80 columns then): top's widest table takes about 180.
console = Console(width=None if sys.stdout.isatty() else 200)

DESCRIPTION = """\
Growable, sleepable KV caches on GPU virtual memory (and Linux host memory).

  probe   which backends work on this machine, and why the others do not
  demo    the runner flow on a tiny paged-attention model: reserve, warm up,
          size, generate, sleep, wake, generate again, checked token by token
  bench   the benchmarks, each a ratio to a baseline timed in the same run
  limit   show or set the memory every process may claim on a device together,
          and what is kept for one process (floor) and the most it may claim (cap)
  top     every process's caches and claims, per device, live
"""


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
    if not is_rocm():
        rows.append(
            {
                "device": "rocm",
                "backend": "HIP (hip-python)",
                "usable": "no",
                "notes": f"this torch ({torch.__version__}) is not a ROCm build; AMD GPUs "
                "need torch for ROCm and pip install 'extensible-kv[rocm]'",
            }
        )
    gpu_backend = "HIP (hip-python)" if is_rocm() else "CUDA (cuda-bindings)"
    reason = unavailable_reason("cuda:0")
    if reason is not None:
        rows.append({"device": "cuda", "backend": gpu_backend, "usable": "no", "notes": reason})
        return rows
    gpu: Any = backend("cuda:0")
    for index in range(gpu.device_count()):
        row = {"device": f"cuda:{index}", "backend": gpu_backend}
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
            console.print(f"[bold]{row['device']}[/]: {escape(row['notes'])}")
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
    table = Table(
        title=f"memory timeline on {report.device}",
        caption="committed: blocks x bytes per block; physical: whole 2 MiB granules, so a "
        "few blocks still take a granule in every segment (K and V of every layer)",
    )
    for column in ("phase", "reserved", "committed", "physical", "device in use", "took"):
        table.add_column(column, justify="right" if column != "phase" else "left", no_wrap=True)
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
    """The timeline as steps (memory changes at the phase boundaries), on a
    log scale so the reservation and the commit show side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    phases = report.timeline
    x = list(range(len(phases)))
    base = phases[0].device_used_bytes - phases[0].physical_bytes
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, values, style in (
        ("reserved (address space)", [p.reserved_bytes for p in phases], "-"),
        ("committed (blocks)", [p.committed_bytes for p in phases], "--"),
        ("physical (granules)", [p.physical_bytes for p in phases], "-"),
        ("device in use, from start", [p.device_used_bytes - base for p in phases], ":"),
    ):
        # Each value holds from the end of its phase to the end of the next.
        mib = [max(v / MiB, 0.01) for v in values]
        ax.step([*x, len(x)], [*mib, mib[-1]], style, where="post", label=label, linewidth=2)
    ax.set_yscale("log")
    top = max(p.reserved_bytes for p in phases) / MiB
    for i, phase in enumerate(phases):
        ax.annotate(
            f"{phase.seconds * 1e3:.0f} ms",
            (i, top),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
            color="0.35",
        )
    ax.set_xticks(x, [p.name for p in phases], rotation=30, ha="right")
    ax.set_ylabel("MiB (log scale; 0 drawn at 0.01)")
    ax.set_title(
        f"extensible-kv demo on {report.device}: reserve big, commit what is used",
        pad=22,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def demo(args: argparse.Namespace) -> int:
    device = args.device or _best_device()
    settings = _settings(args)
    if args.world_size > 1:
        return _demo_ranks(args.world_size, settings, device, args.out)
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
        kv_budget_bytes=None if args.memory_utilization else args.kv_budget_mib * MiB,
        memory_utilization=args.memory_utilization,
        cuda_graph=False if args.no_graph else None,
    )


def _demo_ranks(world_size: int, settings: FlowSettings, device: torch.device, out: Path) -> int:
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
    out.mkdir(parents=True, exist_ok=True)
    ranks = [
        {
            "rank": rank,
            "device": report.device,
            "ok": report.ok,
            "proposed_blocks": report.sizing.num_blocks,
            "committed_blocks": report.num_blocks,
            "timeline": [asdict(p) for p in report.timeline],
        }
        for rank, report in enumerate(reports)
    ]
    (out / "ranks.json").write_text(json.dumps(ranks, indent=2))
    console.print(f"ranks saved: {out / 'ranks.json'}")
    if all(report.num_blocks == smallest and report.ok for report in reports):
        console.print(
            "[green]ok[/]: every rank committed the smallest proposal and its tokens match"
        )
        return 0
    console.print("[red]MISMATCH[/]: ranks disagree or tokens differ")
    return 1


def bench(args: argparse.Namespace) -> int:
    from extensible_kv.bench import SUITES, BenchPlan, run, save, save_json
    from extensible_kv.bench.report import tables

    device = args.device or _best_device()
    plan = BenchPlan.for_device(device, args.quick)
    if args.repeats:
        plan = BenchPlan(**(vars(plan) | {"repeats": args.repeats}))
    console.print(f"[bold]extensible-kv bench[/] on [bold]{device}[/], {plan.repeats} repeats")
    names = SUITES
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

        results = run(device, plan, advance, lambda partial: save_json(partial, args.out))
        progress.update(task, description="done", completed=len(names))
    for table in tables(results):
        console.print(table)
    files = save(results, args.out)
    console.print("written: " + ", ".join(str(path) for path in files))
    return 0


def _local_names() -> dict[str, str]:
    """Device UUID -> the name this process knows it by (cpu, cuda:N)."""
    names = {}
    if unavailable_reason("cpu") is None:
        names[get_driver("cpu").device_uuid(0)] = "cpu"
    if unavailable_reason("cuda") is None:
        gpu = get_driver("cuda")
        for index in range(gpu.device_count()):
            names[gpu.device_uuid(index)] = f"cuda:{index}"
    return names


def limit(args: argparse.Namespace) -> int:
    if (args.pid, args.floor, args.cap) != (None, None, None):
        return _floor_and_cap(args)
    if args.device is None:
        return _show_limits(args)
    if args.size is None:
        args.parser.error("give a SIZE (64MiB, 8GiB, 50%) or off")
    named = _named(args)
    try:
        size = None if args.size == "off" else parse_size(args.size, total_bytes(named))
    except ValueError as exc:
        args.parser.error(f"argument SIZE: {exc}")
    written = set_device_limit(named.uuid, size, expect_revision=args.revision)
    if args.json:
        print(json.dumps(_limit_row(named.uuid, written), indent=2))
        return 0
    text = "no limit" if written.bytes is None else f"limit {format_bytes(written.bytes)}"
    console.print(f"{named.name} ({named.uuid}): {text}, revision {written.revision}")
    return 0


def _named(args: argparse.Namespace) -> NamedDevice:
    """The DEVICE argument, or the argparse error saying why not."""
    parser: argparse.ArgumentParser = args.parser
    try:
        return named_device(args.device)
    except (ValueError, BackendUnavailableError) as exc:
        parser.error(f"argument DEVICE: {exc}")


def _floor_and_cap(args: argparse.Namespace) -> int:
    """``limit DEVICE --pid PID --floor SIZE --cap SIZE``: one process's
    floor and cap; the one not given stays as the ledger has it."""
    parser: argparse.ArgumentParser = args.parser
    if args.pid is None:
        parser.error("--floor and --cap need --pid PID: the process they are for")
    if args.floor is None and args.cap is None:
        parser.error(f"give --floor SIZE, --cap SIZE or both for pid {args.pid}")
    if args.device is None:
        parser.error("give the DEVICE the process claims on (cpu, cuda:N or a device UUID)")
    if args.size is not None:
        parser.error("give a SIZE for the device's limit or --pid's floor and cap, not both")
    named = _named(args)
    total = total_bytes(named)
    try:
        floor = KEEP if args.floor is None else read_floor(args.floor, total)
    except ValueError as exc:
        parser.error(f"argument --floor: {exc}")
    try:
        cap = KEEP if args.cap is None else read_cap(args.cap, total)
    except ValueError as exc:
        parser.error(f"argument --cap: {exc}")
    written = set_floor_and_cap(
        named.uuid, args.pid, floor=floor, cap=cap, expect_revision=args.revision
    )
    if args.json:
        print(json.dumps(_process_row(named.uuid, args.pid, written), indent=2))
        return 0
    console.print(
        f"{named.name} ({named.uuid}): pid {args.pid} floor {_floor_text(written.floor_bytes)}, "
        f"cap {_cap_text(written.cap_bytes)}, revision {written.revision}"
    )
    return 0


def _floor_text(floor: int) -> str:
    return format_bytes(floor) if floor else "none"


def _cap_text(cap: int | None) -> str:
    return "none" if cap is None else format_bytes(cap)


def _process_row(uuid: str, pid: int, written: FloorAndCap) -> dict[str, Any]:
    """A floor and cap just written, as ``limit --pid --json`` prints them (bytes)."""
    ledger = Ledger(state_dir(), uuid)
    try:
        holders = ledger.read().holders
    finally:
        ledger.close()
    claimed = sum(held.claimed_bytes for process, held in holders.items() if process.pid == pid)
    return {
        "device": uuid,
        "type": device_type(uuid),
        "revision": written.revision,
        "pid": pid,
        "claimed_bytes": claimed,
        "floor_bytes": written.floor_bytes,
        "cap_bytes": written.cap_bytes,
    }


#: A row of ``limit --json``: keys of ``top``'s snapshot of a device, and
#: ``processes`` where any process there has a floor or a cap.
_LIMIT_KEYS = ("device", "type", "limit_bytes", "revision", "claimed_bytes")
#: A process in a row's ``processes``: keys of ``top``'s snapshot of it.
_PROCESS_KEYS = ("pid", "claimed_bytes", "floor_bytes", "cap_bytes")


def _limit_row(uuid: str, written: Limit) -> dict[str, Any]:
    """A limit just written, as a row of ``limit --json``'s listing (bytes)."""
    ledger = Ledger(state_dir(), uuid)
    try:
        view = ledger.read()
    finally:
        ledger.close()
    row = dict(
        zip(
            _LIMIT_KEYS,
            (uuid, device_type(uuid), written.bytes, written.revision, view.claimed_bytes),
            strict=True,
        )
    )
    processes = [
        dict(zip(_PROCESS_KEYS, (p.pid, h.claimed_bytes, h.floor_bytes, h.cap_bytes), strict=True))
        for p, h in sorted(view.holders.items(), key=lambda item: item[0].pid)
    ]
    return row | _with_floor_or_cap(processes)


def _with_floor_or_cap(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"processes": [...]}``: those of ``processes`` with a floor or a
    cap, narrowed to :data:`_PROCESS_KEYS`; ``{}`` when there are none."""
    kept = [
        {key: process[key] for key in _PROCESS_KEYS}
        for process in processes
        if process["floor_bytes"] or process["cap_bytes"] is not None
    ]
    return {"processes": kept} if kept else {}


def _show_limits(args: argparse.Namespace) -> int:
    state = snapshot(state_dir())
    if args.json:
        rows = [
            {key: device[key] for key in _LIMIT_KEYS} | _with_floor_or_cap(device["processes"])
            for device in state["devices"]
        ]
        print(json.dumps(rows, indent=2))
        return 0
    if not state["devices"]:
        console.print(f"no device has a limit or a claim (state in {state['state_dir']})")
        return 0
    names = _local_names()
    table = Table(title=f"limits (state in {state['state_dir']})", title_justify="left")
    for column in ("device", "uuid", "limit", "claimed", "revision"):
        table.add_column(column, justify="right" if column in ("limit", "claimed") else "left")
    for device in state["devices"]:
        table.add_row(
            names.get(device["device"], device["type"]),
            device["device"],
            "none" if device["limit_bytes"] is None else format_bytes(device["limit_bytes"]),
            format_bytes(device["claimed_bytes"]),
            str(device["revision"]),
        )
    console.print(table)
    floors = _floors_table(state, names)
    if floors is not None:
        console.print(floors)
    return 0


def _floors_table(state: dict[str, Any], names: dict[str, str]) -> Table | None:
    """Every process with a floor or a cap, per device (None: no such process)."""
    table = Table(title="floors and caps", title_justify="left")
    for column in ("device", "pid", "command", "claimed", "floor", "cap"):
        table.add_column(column, justify="left" if column in ("device", "command") else "right")
    for device in state["devices"]:
        for process in device["processes"]:
            if process["floor_bytes"] or process["cap_bytes"] is not None:
                table.add_row(
                    names.get(device["device"], device["type"]),
                    str(process["pid"]),
                    one_line(process["command"], 48),
                    format_bytes(process["claimed_bytes"]),
                    _floor_text(process["floor_bytes"]),
                    _cap_text(process["cap_bytes"]),
                )
    return table if table.row_count else None


def top(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(snapshot(state_dir()), indent=2))
        return 0
    names = _local_names()
    if args.once:
        console.print(render(snapshot(state_dir()), names))
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        live(console, names)
    return 0


def _best_device() -> torch.device:
    if unavailable_reason("cuda") is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default in its help."""


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share of the device in (0, 1], got {value}")
    return value


def _device(text: str) -> torch.device:
    """A device this machine can run the command on, or the reason it cannot."""
    try:
        spec = parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if spec.type == "cuda":
        reason = unavailable_reason(spec)
        if reason is not None:
            raise argparse.ArgumentTypeError(f"{text} cannot be used here: {reason}")
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text} cannot be used here: this torch ({torch.__version__}) has no GPU support"
            )
    if spec.type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda") if spec.index is None else torch.device("cuda", spec.index)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extensible-kv", description=DESCRIPTION, formatter_class=_Formatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "probe", help="which backends work here, and why not", formatter_class=_Formatter
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=probe)
    d = commands.add_parser(
        "demo", help="the runner flow on a tiny paged-attention model", formatter_class=_Formatter
    )
    device_help = "cpu, cuda or cuda:N (default: the GPU if one is usable, else cpu)"
    d.add_argument("--device", type=_device, default=None, help=device_help)
    d.add_argument("--layers", type=_positive, default=4, help="decoder layers")
    d.add_argument("--batch", type=_positive, default=4, help="sequences generated at once")
    d.add_argument("--new-tokens", type=_positive, default=40, help="tokens generated per sequence")
    d.add_argument(
        "--capacity-blocks",
        type=_positive,
        default=65536,
        help="blocks of address space reserved: the cache's upper bound (2 GiB at the "
        "default model size; address space only)",
    )
    d.add_argument(
        "--kv-budget-mib",
        type=_positive,
        default=64,
        help="size the cache to this many MiB after warm-up",
    )
    d.add_argument(
        "--memory-utilization",
        type=_share,
        default=None,
        help="size the cache from measured memory instead, so the device is at most this "
        "share full (vLLM's gpu_memory_utilization)",
    )
    d.add_argument("--no-graph", action="store_true", help="no CUDA graph on a GPU")
    d.add_argument(
        "--world-size",
        type=_positive,
        default=1,
        help="run as this many tensor-parallel ranks (gloo) that agree on one block count",
    )
    d.add_argument(
        "--out", type=Path, default=Path("extensible-kv-demo"), help="folder for the results"
    )
    d.set_defaults(run=demo)
    b = commands.add_parser(
        "bench", help="benchmarks against the baselines, as ratios", formatter_class=_Formatter
    )
    b.add_argument("--device", type=_device, default=None, help=device_help)
    b.add_argument(
        "--repeats",
        type=_positive,
        default=None,
        help="repeats per measurement (default: 3, 5 on a GPU, 2 with --quick)",
    )
    b.add_argument("--quick", action="store_true", help="small sizes (seconds, for a smoke test)")
    b.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG"
    )
    b.set_defaults(run=bench)
    lim = commands.add_parser(
        "limit",
        help="show or set a device's memory limit, shared by every process, and "
        "one process's floor and cap",
        description="Limit the memory every process of this user may claim on a device\n"
        "together; with no argument, show the limits (and every floor and cap).\n"
        "A limit below what is claimed refuses new claims until enough is given\n"
        "back. With --pid, set that process's floor (kept for it while it holds\n"
        "less; others' claims cannot take it) and cap (the most it may claim)\n"
        "on DEVICE instead; the one not given stays as it is:\n\n"
        "  extensible-kv limit cuda:0 --pid 4117 --floor 8GiB --cap 30GiB\n"
        "  extensible-kv limit cuda:0 --pid 4117 --cap none",
        formatter_class=_Formatter,
    )
    lim.add_argument("device", nargs="?", metavar="DEVICE", help="cpu, cuda:N or a device UUID")
    lim.add_argument(
        "size", nargs="?", metavar="SIZE", help="64MiB, 8GiB, 1.5GB, 50%% of the device, or off"
    )
    lim.add_argument(
        "--pid",
        type=_positive,
        default=None,
        help="the process whose floor or cap is set: one that claims on DEVICE",
    )
    lim.add_argument(
        "--floor",
        metavar="SIZE",
        default=None,
        help="keep this much for --pid while it holds less (a size as above; 0 for none)",
    )
    lim.add_argument(
        "--cap",
        metavar="SIZE",
        default=None,
        help="the most --pid may claim (a size as above; none for no cap)",
    )
    lim.add_argument(
        "--revision",
        type=lambda text: _whole(text, 0),
        default=None,
        help="set only if the device is still at this revision (as shown), else fail",
    )
    lim.add_argument(
        "--json",
        action="store_true",
        help="print the limits, or the limit, floor or cap set, as JSON",
    )
    lim.set_defaults(run=limit, parser=lim)
    t = commands.add_parser(
        "top",
        help="every process's caches and claims, per device, live (q quits)",
        description="Every process's caches and claims, per device, refreshed four times\n"
        "a second; q quits.",
        formatter_class=_Formatter,
    )
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument(
        "--json",
        action="store_true",
        help=f"print one snapshot as JSON (schema_version {SCHEMA_VERSION})",
    )
    t.set_defaults(run=top)
    k = commands.add_parser(
        "kept",
        help="KV pages kept for an engine's restart: list them, or drop them",
        description="The KV pages keeper processes hold after their engines stopped, until\n"
        "an engine with the same fingerprint adopts them or their time runs out.",
        formatter_class=_Formatter,
    )
    drops = k.add_mutually_exclusive_group()
    drops.add_argument(
        "--drop", type=_positive, metavar="PID", help="give this keeper's pages back"
    )
    drops.add_argument("--drop-all", action="store_true", help="give every keeper's pages back")
    k.add_argument("--json", action="store_true", help="print the list as JSON")
    k.set_defaults(run=kept)
    return parser


def kept(args: argparse.Namespace) -> int:
    """List the KV pages keepers hold for a restart, or drop them."""
    records = kept_caches()
    if args.drop is not None or args.drop_all:
        pids = [r.keeper_pid for r in records] if args.drop_all else [args.drop]
        for pid in pids:
            if not drop(pid):
                raise ValueError(f"no keeper with pid {pid} holds pages (see extensible-kv kept)")
            console.print(f"dropped the pages keeper {pid} held")
        return 0
    if args.json:
        print(json.dumps([asdict(r) for r in records], indent=2))
        return 0
    table = Table(title=f"kept KV pages (state in {state_dir()})", title_justify="left")
    for column in ("keeper pid", "held", "blocks", "device", "until", "fingerprint"):
        table.add_column(column)
    for r in records:
        until = time.strftime("%H:%M:%S", time.localtime(r.until))
        fingerprint = escape(json.dumps(r.fingerprint, sort_keys=True))
        table.add_row(
            str(r.keeper_pid),
            format_bytes(r.nbytes),
            "not named yet" if r.blocks is None else str(len(r.blocks)),
            r.device_uuid,
            until,
            fingerprint,
        )
    console.print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (BackendUnavailableError, DriverError, StateDirError, ValueError) as exc:
        # The library's errors name the rule broken: one line, no traceback.
        parser.exit(1, f"extensible-kv {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
