"""Changes worth journaling (refs, pins, quarantine, GC purges) and the listeners told of them.

A catalog module announces a change with `Database.changed(conn, change)` inside
its write transaction; the change reaches the listeners only once that
transaction commits (never for a rollback or a refused compare-and-swap), in
the committing thread, in commit order for that thread. A listener that raises
does not turn the committed change into an error for the caller: the failure is
logged (the change's kind and names and the exception's class and first line,
never its details) and counted in `ChangeFeed.failures`
(`Catalog.journal_failures`). What an operator does about a failure is in
docs/restore.md ("The journal").

The catalog never imports `chunkstore`: writing changes to stores is
`restore.journal.StoreJournal`, one such listener.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from catalog.models import PinInfo, RefInfo, Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RefSet:
    """A ref was created (forked) or moved by a compare-and-swap: its new value."""

    ref: RefInfo

    @property
    def at(self) -> datetime:
        return self.ref.updated_at


@dataclass(frozen=True, slots=True)
class RefDeleted:
    namespace: str
    name: str
    at: datetime


@dataclass(frozen=True, slots=True)
class PinSet:
    """A pin was set or moved (its expiry restarted): its new value."""

    pin: PinInfo

    @property
    def at(self) -> datetime:
        return self.pin.created_at


@dataclass(frozen=True, slots=True)
class PinRemoved:
    """A pin was removed: by `unpin`, or by GC with the prefix an expired pin named."""

    namespace: str
    name: str
    at: datetime


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A prefix node (and with it its whole subtree) was quarantined."""

    namespace: str
    prefix_hash: bytes
    reason: str
    at: datetime


@dataclass(frozen=True, slots=True)
class ChunkPurged:
    """GC dropped a chunk's row (its blob's bytes were deleted or are being deleted)."""

    namespace: str
    fingerprint: str  # hex
    prefix_hash: bytes
    shard: Shard
    blob_key: str
    at: datetime


Change = RefSet | RefDeleted | PinSet | PinRemoved | Quarantined | ChunkPurged
ChangeListener = Callable[[Change], None]


def describe(change: Change) -> str:
    """A short, log-safe description of a change (kind and names; no reasons or values)."""
    if isinstance(change, RefSet):
        return f"ref set {change.ref.namespace!r}/{change.ref.name!r}"
    if isinstance(change, PinSet):
        return f"pin set {change.pin.namespace!r}/{change.pin.name!r}"
    if isinstance(change, RefDeleted):
        return f"ref delete {change.namespace!r}/{change.name!r}"
    if isinstance(change, PinRemoved):
        return f"pin remove {change.namespace!r}/{change.name!r}"
    if isinstance(change, Quarantined):
        return f"quarantine {change.namespace!r}/{change.prefix_hash.hex()[:16]}"
    return f"purge {change.namespace!r}/{change.blob_key[:16]}"


class ChangeFeed:
    """The listeners of one catalog and the count of their failures; safe for many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: tuple[ChangeListener, ...] = ()
        self._failures = 0

    def add(self, fn: ChangeListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, fn)

    def remove(self, fn: ChangeListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not fn)

    @property
    def listeners(self) -> tuple[ChangeListener, ...]:
        return self._listeners

    @property
    def failures(self) -> int:
        """How many times a listener raised since the catalog was opened."""
        return self._failures

    def publish(self, change: Change) -> None:
        """Tell every listener about a committed change; never raises."""
        for fn in self._listeners:
            try:
                fn(change)
            except Exception as exc:
                with self._lock:
                    self._failures += 1
                first = str(exc).splitlines()[0] if str(exc) else ""
                log.error(
                    "change listener failed for %s (the change is committed; "
                    "see docs/restore.md, 'The journal'): %s: %.200s",
                    describe(change),
                    type(exc).__name__,
                    first,
                )
