"""One worker's kvc: a catalog and its stores, the journal, the write-behind order, one
Checkpointer and one Restorer, opened together and closed in the right order.

Every writer of kvc (the engine adapters, the daemon, the demo, the CLI commands that
write) holds a `Session` instead of assembling these parts itself, so they cannot drift:
the first store receives every chunk, the first object store after it a write-behind copy
(catalogued after its receipt), every store is read on restore, and every ref, pin,
quarantine and purge made through the catalog is journaled to the stores (the store alone
always rebuilds the catalog) unless the caller gives that up by name (`journal=False`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from catalog.base import CatalogAPI
from catalog.connect import connect
from catalog.models import Shard
from chunkstore import ChunkStore, open_store
from chunkstore.codecs import DEFAULT_CODEC
from restore.checkpoint import Checkpointer
from restore.errors import InputError, RestoreError
from restore.journal import StoreJournal, ensure_journal
from restore.restore import Restorer
from restore.write_behind import DEFAULT_WRITE_BEHIND_BYTES, write_behind_store

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """A catalog (a `CatalogAPI`, or a URL: SQLite, PostgreSQL or a `kvc serve` service) and
    stores (objects or URLs), with the pipelines that write and read them.

    What the session opens from a URL it closes; objects handed to it stay the caller's.
    `checkpointer` publishes into `stores[0]` (write-behind to the first object store after
    it) and `restorer` reads every store; both are made on first use. `journal=False`
    gives up recovery: refs, pins, quarantines and purges made through this catalog are
    then not in the stores, and a catalog rebuilt from them (`kvc rebuild`) lacks them.
    """

    def __init__(
        self,
        catalog: CatalogAPI | str,
        stores: Sequence[ChunkStore | str],
        namespace: str = "default",
        chunk_size: int = 256,
        *,
        shard: Shard | None = None,
        actor: str | None = None,
        token: str | None = None,
        journal: bool = True,
        codec: str = DEFAULT_CODEC,
        write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
        max_parallel: int = Restorer.DEFAULT_PARALLEL,
        byte_budget: int = 256 << 20,
    ) -> None:
        if isinstance(stores, str | ChunkStore) or not stores:
            raise InputError("a session needs a list of at least one store (objects or URLs)")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.shard = shard
        self.actor = actor
        self.codec = codec
        self.write_behind_bytes = write_behind_bytes
        self.max_parallel = max_parallel
        self.byte_budget = byte_budget
        self._owned_stores: list[ChunkStore] = []
        self._owned_catalog: CatalogAPI | None = None
        self._journal: StoreJournal | None = None
        self._checkpointer: Checkpointer | None = None
        self._restorer: Restorer | None = None
        self._lock = threading.Lock()
        self._closed = False
        try:
            self.stores: list[ChunkStore] = [self._store(s) for s in stores]
            if isinstance(catalog, str):
                self._owned_catalog = connect(catalog, token=token, namespace=namespace)
                self.catalog: CatalogAPI = self._owned_catalog
            else:
                self.catalog = catalog
            if journal:
                self._journal = ensure_journal(self.catalog, self.stores)
        except BaseException:
            self.close()
            raise

    @property
    def checkpointer(self) -> Checkpointer:
        """The session's one Checkpointer (made on first use: a process that only looks up,
        like vLLM's scheduler, never starts its workers)."""
        with self._lock:
            if self._closed:
                raise RestoreError("the session is closed")
            if self._checkpointer is None:
                self._checkpointer = Checkpointer(
                    self.catalog,
                    self.stores[0],
                    self.namespace,
                    self.chunk_size,
                    write_behind=write_behind_store(self.stores[1:]),
                    shard=self.shard,
                    actor=self.actor,
                    journal=False,  # the session journals every store it has
                    codec=self.codec,
                    write_behind_bytes=self.write_behind_bytes,
                )
            return self._checkpointer

    @property
    def restorer(self) -> Restorer:
        """The session's one Restorer over every store (made on first use)."""
        with self._lock:
            if self._closed:
                raise RestoreError("the session is closed")
            if self._restorer is None:
                self._restorer = Restorer(
                    self.catalog,
                    self.stores,
                    self.namespace,
                    shard=self.shard,
                    actor=self.actor,
                    max_parallel=self.max_parallel,
                    byte_budget=self.byte_budget,
                )
            return self._restorer

    def _store(self, store: ChunkStore | str) -> ChunkStore:
        if isinstance(store, ChunkStore):
            return store
        opened = open_store(str(store))
        self._owned_stores.append(opened)
        return opened

    def close(self) -> None:
        """Finish queued checkpoints and write-behind uploads (they need the catalog and the
        stores), stop the restore workers, then close what the session opened."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            checkpointer, restorer = self._checkpointer, self._restorer
        try:
            if checkpointer is not None:
                checkpointer.close()
        finally:
            if restorer is not None:
                restorer.close()
            if self._journal is not None and self._owned_stores:
                # Its stores close now: later changes through a catalog the caller keeps
                # cannot reach them (a catalog the session opened closes too).
                remove = getattr(self.catalog, "remove_change_listener", None)
                if remove is not None:
                    remove(self._journal)
            for store in self._owned_stores:
                store.close()
            if self._owned_catalog is not None:
                self._owned_catalog.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
