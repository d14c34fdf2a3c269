"""Byte sizes as people write and read them: :func:`parse_size` for options and environment
variables (``20GiB``), :func:`format_bytes` for log lines and tables (``1.5 GiB``)."""
from __future__ import annotations

import re
from typing import Optional


def parse_size(text: str) -> int:
    """Bytes from ``"20GiB"``, ``"512MB"``, ``"1.5e9"`` or ``"4096"`` (KiB/MiB/GiB/TiB are
    powers of 1024; KB/MB/GB/TB powers of 1000).

    Example:
        >>> parse_size("2GiB")
        2147483648
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*", text)
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 20GiB, 512MiB, 8GB or a number of bytes")
    value = float(match.group(1)) * units[(match.group(2) or "B").upper()]
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value)


def format_bytes(n: Optional[float]) -> str:
    """``512 B``, ``1.5 GiB``: binary units, one decimal; ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
