"""Argument checks shared by the layers."""

from __future__ import annotations


def check_int(name: str, value: object) -> int:
    """``value`` if it is an int (bools refused), else a TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
