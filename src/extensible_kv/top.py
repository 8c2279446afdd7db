"""``extensible-kv top``: every process's caches and claims, per device, live."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from extensible_kv.budget import format_bytes, snapshot, state_dir
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
    return title


def render(state: dict[str, Any], names: dict[str, str] | None = None) -> RenderableType:
    """One snapshot as a table per device (``names``: UUID -> local name)."""
    names = names or {}
    if not state["devices"]:
        return Text(f"no process has claimed memory (state in {state['state_dir']})")
    parts: list[RenderableType] = []
    for device in state["devices"]:
        table = Table(title=_device_title(device, names), title_justify="left", expand=False)
        for column in ("pid", "command", "cache", "reserved", "committed", "physical"):
            table.add_column(column, justify="left" if column in ("command", "cache") else "right")
        table.add_column("asleep")
        table.add_column("claimed", justify="right")
        if not device["processes"]:
            table.caption = "no live process holds memory here"
        for process in device["processes"]:
            caches = process["caches"] or [None]
            for index, cache in enumerate(caches):
                first = index == 0
                table.add_row(
                    str(process["pid"]) if first else "",
                    one_line(process["command"], 48) if first else "",
                    "-" if cache is None else cache["kind"],
                    _size(None if cache is None else cache["reserved_bytes"]),
                    _size(None if cache is None else cache["committed_bytes"]),
                    _size(None if cache is None else cache["physical_bytes"]),
                    _asleep(None if cache is None else cache["asleep"]),
                    format_bytes(process["claimed_bytes"]) if first else "",
                )
        parts.append(table)
    return Group(*parts)


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
    key, None if none came, or "" at the end of input. The terminal is put in
    cbreak mode meanwhile, so one key is enough."""
    stream = sys.stdin
    if not stream.isatty():

        def sleep_only(seconds: float) -> str | None:
            time.sleep(seconds)
            return None

        yield sleep_only
        return
    fd = stream.fileno()
    before = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def key(seconds: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], seconds)
        if not ready:
            return None
        return os.read(fd, 1).decode(errors="replace")

    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, before)
