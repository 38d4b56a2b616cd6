"""The progress callback of long lifecycle runs (fsck, the orphan sweep, a GC run, rebuild)."""

from __future__ import annotations

from collections.abc import Callable

# Called as progress(stage, done, total): `stage` names the phase ("fsck", "gc resume",
# "gc purge", "gc <store name>", "rebuild read", "rebuild record"), `done` counts the items
# handled so far in that phase, `total` is how many there are, or None while a listing or
# purge is still counting.
Progress = Callable[[str, int, int | None], None]


class StageCounter:
    """Turn per-item increments (catalog.gc's progress) into `Progress` calls for one stage."""

    def __init__(self, progress: Progress | None, stage: str, total: int | None = None) -> None:
        self.progress = progress
        self.stage = stage
        self.total = total
        self.done = 0

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.stage, self.done, self.total)
