"""Damage a stored file the way the LMCache bench's correctness columns need, on both sides
(`bench_lmcache.py` for kvc, `lmcache_worker.py` in LMCache's own venv): no imports but the
standard library's, so both environments can load it."""

from __future__ import annotations

import os
from pathlib import Path

DAMAGES = ("flip", "truncate")


def damage_file(path: Path, damage: str) -> None:
    """`flip`: invert the byte in the middle of the file; `truncate`: cut it to half its size."""
    size = path.stat().st_size
    if damage == "flip":
        with path.open("r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, size // 2)
    else:
        raise ValueError(f"damage must be one of {DAMAGES}, got {damage!r}")
