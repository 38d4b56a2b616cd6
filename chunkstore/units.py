"""Byte counts for people: the binary units (B, KiB, MiB, GiB, TiB) every kvc output uses."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`n` bytes in binary units: `512 B`, `1.5 KiB`, `14.0 MiB`, ... (one decimal past B)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def human_rate(bytes_per_s: float) -> str:
    """A transfer rate in the same units: `906.0 MiB/s`."""
    return f"{human_bytes(bytes_per_s)}/s"
