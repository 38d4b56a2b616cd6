"""Access statistics of lookups, batched off the hot path and written by a background thread."""

from __future__ import annotations

import logging
import threading
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from catalog.clock import utcnow
from catalog.errors import CatalogError
from catalog.models import Shard
from catalog.schema import Chunk
from catalog.transactions import Database

log = logging.getLogger(__name__)

# Chunk uses noted and not yet flushed, at most (about 80 bytes each): lookups past
# it between two flushes are not counted (`dropped`) rather than grow the process.
MAX_NOTED = 1 << 18


class AccessLog:
    """Counts of how often and when each chunk was used by a lookup.

    Lookups never write: `note` appends and a background thread folds and
    flushes every `flush_s` seconds; `close` flushes the rest. At most
    `max_noted` chunk uses wait for a flush; the uses of a lookup that would
    pass it are not counted (added to `dropped`): access counts are statistics
    for GC's ordering, not a promise.
    """

    def __init__(self, db: Database, flush_s: float, max_noted: int = MAX_NOTED) -> None:
        self._db = db
        self._flush_s = flush_s
        self._max_noted = max_noted
        self._noted: list[tuple[str, Shard, list[bytes], datetime]] = []
        self._noted_prefixes = 0
        self.dropped = 0  # chunk uses not counted because too many were waiting
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._closing = threading.Event()

    def note(self, prefixes: list[bytes], fp_hex: str, shard: Shard) -> None:
        """Record that a lookup used these chunks (of this fingerprint and shard) now."""
        with self._lock:
            if self._noted_prefixes + len(prefixes) > self._max_noted:
                self.dropped += len(prefixes)
                return
            self._noted_prefixes += len(prefixes)
            self._noted.append((fp_hex, shard, prefixes, utcnow()))
            if self._flusher is None and not self._closing.is_set():
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="kvc-access-flush", daemon=True
                )
                self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._closing.wait(self._flush_s):
            self.flush()

    def flush(self) -> None:
        """Write the batched access counts and times now."""
        with self._lock:
            noted, self._noted = self._noted, []
            self._noted_prefixes = 0
        if not noted:
            return
        pending: dict[tuple[str, bytes, Shard], tuple[int, datetime]] = {}
        for fp_hex, shard, prefixes, at in noted:
            for p in prefixes:
                n, _ = pending.get((fp_hex, p, shard), (0, at))
                pending[(fp_hex, p, shard)] = (n + 1, at)

        def run() -> None:
            with self._db.write() as conn:
                for (fp_hex, prefix, shard), (count, at) in sorted(
                    pending.items(), key=lambda kv: kv[0][1]
                ):
                    conn.execute(
                        sa.update(Chunk)
                        .where(
                            Chunk.fingerprint == fp_hex,
                            Chunk.prefix_hash == prefix,
                            Chunk.layer_lo == shard.layer_lo,
                            Chunk.layer_hi == shard.layer_hi,
                            Chunk.head_lo == shard.head_lo,
                            Chunk.head_hi == shard.head_hi,
                        )
                        .values(access_count=Chunk.access_count + count, last_access_at=at)
                    )

        try:
            self._db.retrying(run)
        except (CatalogError, DBAPIError) as exc:  # statistics must never fail a lookup
            log.warning("could not record access statistics: %s", exc.__class__.__name__)

    def close(self) -> None:
        """Stop the background thread and flush what is left."""
        self._closing.set()
        if self._flusher is not None:
            self._flusher.join()
        self.flush()
