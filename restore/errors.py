"""Domain errors of restore: page pool, checkpoint and restore pipelines, the journal."""

from __future__ import annotations

from typing import Any


class RestoreError(Exception):
    """Base class of every error raised by `restore`."""


class PoolExhaustedError(RestoreError):
    """The page pool cannot provide the pages asked for; nothing was changed.

    `needed` is what the operation asked for, `available` what it could have
    had (free pages, or pages eviction could free), `shortfall` the difference.
    """

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.shortfall = needed - available

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields would otherwise be lost when the error crosses a process boundary.
        return (_rebuild_exhausted, (str(self), self.needed, self.available))


class UnknownRouteError(RestoreError, LookupError):
    """No live route has this id in this pool (never created, released or evicted)."""


class InputError(RestoreError, ValueError):
    """An argument is malformed or inconsistent (named in the message); nothing was changed."""


class UnsupportedModelError(RestoreError, TypeError):
    """A model or cache kvc cannot represent exactly (named in the message): refused, never approximated."""


class CheckpointBusyError(RestoreError):
    """An explicit checkpoint was refused because the queue or staging budget is full."""


def _rebuild_exhausted(message: str, needed: int, available: int) -> PoolExhaustedError:
    return PoolExhaustedError(message, needed=needed, available=available)


class JournalWriteError(RestoreError):
    """A journal record (`restore.journal`) did not land in every store it was meant for.

    The catalog change it describes is committed regardless; see docs/restore.md
    ("The journal") for what to do.
    """
