"""The daemon's domain errors: what `Daemon` refuses, each a subclass of the builtin it refines.

The core translates what the libraries raise into these (`kvc.daemon.core`);
`kvc.daemon.app` maps each class onto an HTTP status (docs/daemon.md).
"""

from __future__ import annotations

__all__ = [
    "DaemonConflictError",
    "DaemonError",
    "DaemonInputError",
    "DaemonInternalError",
    "DaemonNotFoundError",
    "DaemonUnavailableError",
    "PoolFullError",
]


class DaemonError(Exception):
    """Base class of every refusal of the daemon; `field` is the argument at fault, if one is."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class DaemonInputError(DaemonError, ValueError):
    """An argument is malformed or out of bounds (an unknown fingerprint, a pool over the
    daemon's limit, a token the model has no embedding for)."""


class DaemonNotFoundError(DaemonError, LookupError):
    """No such route in the pool (`field` "route"), or no such thing in the catalog."""


class DaemonConflictError(DaemonError, RuntimeError):
    """The call does not fit the daemon's state: no pool configured, a prefill for a model that
    is not a reference one, a route shorter than its tokens, a ref that moved meanwhile."""


class PoolFullError(DaemonError):
    """The pool has no free pages for the request (the message says the shortfall)."""


class DaemonUnavailableError(DaemonError):
    """Not now: the daemon is shutting down, the checkpoint queue is busy, or a store failed."""


class DaemonInternalError(DaemonError):
    """An unexpected failure; its traceback is in the daemon's log, never in the message."""
