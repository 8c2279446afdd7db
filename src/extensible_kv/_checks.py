"""Argument checks shared by the layers."""

from __future__ import annotations


def check_int(name: str, value: object) -> int:
    """``value`` if it is an int (bools refused), else a TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``name``: a string
    like ``"no"`` or an int is not taken for one."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """``value`` if it is a number of seconds: an int or a float (bools
    refused), at least 0; ``inf`` is forever, NaN is refused. Else a
    TypeError or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds (an int or a float), "
            f"got {type(value).__name__} {value!r}"
        )
    if not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value}")
    return value


#: The largest byte count any reservation, view or chunk may have: 256 TiB,
#: beyond the address space of every GPU and of x86-64 and arm64 Linux
#: processes. Checked before a size reaches a driver, where it would wrap
#: around ``size_t`` and reserve next to nothing.
MAX_BYTES = 1 << 48


def check_bytes(name: str, value: object) -> int:
    """``value`` if it is an int in ``[0, MAX_BYTES]``, else an error naming ``name``."""
    check_int(name, value)
    assert isinstance(value, int)
    if not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{name} must be between 0 and {MAX_BYTES} bytes (2**48), got {value}")
    return value


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
