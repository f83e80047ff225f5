"""Byte sizes written for people: ``"4GiB"``, ``"512 MB"``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Parse a byte size.

    Accepts an int, or a number followed by an optional unit: B, KB/MB/GB/TB
    (powers of 1000), KiB/MiB/GiB/TiB or K/M/G/T (powers of 1024),
    case-insensitive.

    Raises:
        ValueError: the value is negative, not a size, or its unit is unknown.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a byte size: {value!r}")
    m = _PATTERN.match(value)
    if not m:
        raise ValueError(f"not a byte size: {value!r} (expected e.g. 512MiB, 4GiB, 1000000)")
    number, unit = m.groups()
    try:
        factor = _UNITS[unit.lower()]
    except KeyError:
        raise ValueError(
            f"unknown unit {unit!r} in {value!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        ) from None
    return int(float(number) * factor)


def format_bytes(n: float) -> str:
    """``4194304`` -> ``"4.0 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
