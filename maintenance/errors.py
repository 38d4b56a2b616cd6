"""Domain errors of the maintenance jobs: a GC run that refused to start.

They stay `restore.errors.RestoreError`s, like the `InputError` the jobs raise
for a bad argument, so one `except RestoreError` still covers a whole run.
"""

from __future__ import annotations

from datetime import datetime

from restore.errors import RestoreError


class GcRefusedError(RestoreError):
    """A GC run refused to start; nothing was changed (the message says why)."""


class GcLockedError(GcRefusedError):
    """Another GC run holds the catalog's GC lock (`holder` until `until`, when known)."""

    def __init__(self, message: str, holder: str | None = None, until: datetime | None = None):
        super().__init__(message)
        self.holder = holder
        self.until = until


class MissingReplicasError(GcRefusedError):
    """The catalog records `missing` replicas in the stores being collected (run fsck, or force)."""

    def __init__(self, message: str, missing: int = 0) -> None:
        super().__init__(message)
        self.missing = missing
