"""``extensible-kv top``: every process's caches and claims, per device, live."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from extensible_kv.budget import STALLED_S, format_bytes, snapshot, state_dir
from extensible_kv.budget.liveness import one_line

#: Snapshots per second in the live view.
REFRESH_HZ = 4


def _size(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _asleep(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _device_title(device: dict[str, Any], names: dict[str, str]) -> Text:
    name = names.get(device["device"], device["type"])
    limit = device["limit_bytes"]
    claimed = device["claimed_bytes"]
    title = Text(f"{name}  ", style="bold")
    title.append(device["device"], style="dim")
    if limit is None:
        title.append(f"   claimed {format_bytes(claimed)}, no limit")
    else:
        share = f" ({100 * claimed / limit:.0f}%)" if limit else ""
        style = "red" if claimed > limit else ""
        title.append(
            f"   claimed {format_bytes(claimed)} of {format_bytes(limit)}{share}, "
            f"revision {device['revision']}",
            style=style,
        )
    wanted = sum(p["wanted_bytes"] for p in device["processes"])
    if wanted:
        stalled = any(_stalled(p) for p in device["processes"])
        title.append(
            f", wanted {format_bytes(wanted)}{' (stalled)' if stalled else ''}",
            style="red" if stalled else "yellow",
        )
    return title


def _stalled(process: dict[str, Any]) -> bool:
    """Whether the process's want has stood unmet :data:`STALLED_S` seconds
    (a snapshot of an older extensible-kv has no ``wanting_s``: never)."""
    wanting = process.get("wanting_s")
    return wanting is not None and wanting >= STALLED_S


def _wanted(process: dict[str, Any]) -> str:
    """The want's bytes, marked ``stalled N s`` once it is."""
    if not process["wanted_bytes"]:
        return "-"
    wanted = format_bytes(process["wanted_bytes"])
    return f"{wanted}, stalled {process['wanting_s']:.0f} s" if _stalled(process) else wanted


#: Columns of a cache's row, each with its cell; in use and cached (blocks
#: running requests hold, and free blocks the prefix cache keeps) show where
#: any cache on the device reports them (an elastic vLLM engine's).
_CACHE_CELLS: dict[str, Callable[[dict[str, Any]], str]] = {
    "cache": lambda c: str(c["kind"]),
    "reserved": lambda c: format_bytes(c["reserved_bytes"]),
    "committed": lambda c: format_bytes(c["committed_bytes"]),
    "physical": lambda c: format_bytes(c["physical_bytes"]),
    "in use": lambda c: _size(c.get("in_use_bytes")),
    "cached": lambda c: _size(c.get("cached_bytes")),
    "asleep": lambda c: _asleep(c["asleep"]),
}
#: Columns of a process (on its first row), each with its cell: the flow is
#: claimed (held), then wanted; waited, floor and cap show where any
#: process on the device has one.
_PROCESS_CELLS: dict[str, Callable[[dict[str, Any]], str]] = {
    "claimed": lambda p: format_bytes(p["claimed_bytes"]),
    "wanted": _wanted,
    "waited": lambda p: "-" if p["waited_s"] is None else f"{p['waited_s']:.2f} s",
    "floor": lambda p: format_bytes(p["floor_bytes"]) if p["floor_bytes"] else "-",
    "cap": lambda p: _size(p["cap_bytes"]),
}
#: The optional columns, and whether a process gives one a figure.
_SHOWN_IF: dict[str, Callable[[dict[str, Any]], bool]] = {
    "in use": lambda p: p["in_use_bytes"] is not None,
    "cached": lambda p: p["cached_bytes"] is not None,
    "waited": lambda p: p["waited_s"] is not None,
    "floor": lambda p: bool(p["floor_bytes"]),
    "cap": lambda p: p["cap_bytes"] is not None,
}


def _shown(columns: Iterable[str], device: dict[str, Any]) -> list[str]:
    """``columns`` less the optional ones no process on ``device`` has."""
    return [
        column
        for column in columns
        if column not in _SHOWN_IF or any(map(_SHOWN_IF[column], device["processes"]))
    ]


def _device_table(device: dict[str, Any], names: dict[str, str]) -> Table:
    table = Table(title=_device_title(device, names), title_justify="left", expand=False)
    cache_columns = _shown(_CACHE_CELLS, device)
    process_columns = _shown(_PROCESS_CELLS, device)
    table.add_column("pid", justify="right")
    table.add_column("command")
    for column in (*cache_columns, *process_columns):
        left = column in ("cache", "asleep")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    if not device["processes"]:
        table.caption = "no live process holds memory here"
    for process in device["processes"]:
        first = [_PROCESS_CELLS[column](process) for column in process_columns]
        rest = [""] * len(first)
        for index, cache in enumerate(process["caches"] or [None]):
            table.add_row(
                str(process["pid"]) if index == 0 else "",
                one_line(process["command"], 48) if index == 0 else "",
                *(
                    "-" if cache is None else _CACHE_CELLS[column](cache)
                    for column in cache_columns
                ),
                *(first if index == 0 else rest),
            )
    return table


def render(state: dict[str, Any], names: dict[str, str] | None = None) -> RenderableType:
    """One snapshot as a table per device (``names``: UUID -> local name):
    per cache its sizes, in use and cached bytes (where its engine counts
    them) and whether it is asleep; per process its claim and want, and
    how long its last want waited, its floor and its cap where any process
    on the device has one."""
    names = names or {}
    if not state["devices"]:
        return Text(f"no process has claimed memory (state in {state['state_dir']})")
    return Group(*(_device_table(device, names) for device in state["devices"]))


def live(console: Console, names: dict[str, str]) -> None:
    """Refresh the view :data:`REFRESH_HZ` times a second until ``q``
    (or Ctrl-C, or the end of input) is pressed."""
    where = state_dir()
    period = 1 / REFRESH_HZ
    with _keys() as pressed, Live(console=console, auto_refresh=False) as view:
        while True:
            header = Text("extensible-kv top: q quits\n", style="dim")
            view.update(Group(header, render(snapshot(where), names)), refresh=True)
            if pressed(period) in ("q", "Q", ""):
                return


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """A function waiting up to its argument's seconds for a key press: the
    key, None if none came, or "" at the end of input (at once with stdin
    closed). A terminal is put in cbreak mode meanwhile, so one key is
    enough; any other input (a pipe, a file, /dev/null) is read as it
    comes, a character at a time."""
    if sys.stdin is None:
        yield lambda seconds: ""
        return
    try:
        fd = sys.stdin.fileno()
    except (io.UnsupportedOperation, ValueError):
        # A stream with no descriptor to wait on (a notebook's): no key can
        # come, so the view refreshes until Ctrl-C.
        yield _no_key
        return
    if not os.isatty(fd):
        yield functools.partial(_key, fd)
        return
    before = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield functools.partial(_key, fd)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, before)


def _no_key(seconds: float) -> None:
    """Wait ``seconds``; no key comes."""
    time.sleep(seconds)


def _key(fd: int, seconds: float) -> str | None:
    """The next character on ``fd`` within ``seconds``: None if none came,
    "" at the end of input."""
    ready, _, _ = select.select([fd], [], [], seconds)
    if not ready:
        return None
    return os.read(fd, 1).decode(errors="replace")
