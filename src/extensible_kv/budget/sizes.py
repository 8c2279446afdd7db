"""Byte counts as people write them: ``64MiB``, ``8GiB``, ``1.5 GB``, ``50%``."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
#: The largest size :func:`parse_size` reads, in bytes: what a ledger's
#: limit, an int64, holds (2**63 - 1, about 8 EiB).
MAX_SIZE_BYTES = (1 << 63) - 1
_SIZE_RE = re.compile(r"\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*")
_PERCENT_RE = re.compile(r"\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*%\s*")


def parse_size(text: str, total_bytes: int | None = None, *, zero: bool = False) -> int:
    """``text`` in bytes: a number with an optional unit (B, KB, MB, GB, TB or
    KiB, MiB, GiB, TiB, any case), or a percentage of ``total_bytes``.

    Decimals are read exactly (``2.01MB`` is 2,010,000 bytes). A size must
    be a whole number of bytes, from one (zero with ``zero``: a floor) to
    :data:`MAX_SIZE_BYTES`; a percentage in (0, 100] is rounded down to
    whole bytes, and is at least one. Raises ValueError saying what is
    accepted.
    """
    percent = _PERCENT_RE.fullmatch(text)
    size = (
        _bytes(text, 0 if zero else 1)
        if percent is None
        else _share(text, Fraction(percent["number"]), total_bytes)
    )
    if size > MAX_SIZE_BYTES:
        raise ValueError(
            f"the size {text!r} is too large: a size can be at most "
            f"{MAX_SIZE_BYTES} bytes (2**63 - 1)"
        )
    return size


def _bytes(text: str, least: int) -> int:
    """``text``, a number and an optional unit, in whole bytes (at least ``least``)."""
    match = _SIZE_RE.fullmatch(text)
    unit = None if match is None else _UNITS.get(match["unit"].lower())
    if match is None or unit is None:
        raise ValueError(f"cannot read the size {text!r}; use a size like 64MiB, 8GiB or 50%")
    size = Fraction(match["number"]) * unit
    if size.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if size < least:
        raise ValueError(f"a size must be at least {least} byte, got {text!r}")
    return int(size)


def _share(text: str, percent: Fraction, total_bytes: int | None) -> int:
    """``percent`` of ``total_bytes``, rounded down to whole bytes and at least one."""
    if not 0 < percent <= 100:
        raise ValueError(f"a percentage must be above 0 and at most 100, got {text!r}")
    if total_bytes is None:
        raise ValueError(f"{text!r} is a percentage, but the device's size is unknown")
    return max(1, int(total_bytes * percent / 100))


def format_bytes(size: int) -> str:
    """``size`` bytes in binary units, three significant digits: ``1.50 GiB``."""
    if abs(size) < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            break
        value /= 1024
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"
