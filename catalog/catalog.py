"""The SQL catalog (SQLite or PostgreSQL): the facade over the catalog's rooms.

Each responsibility lives in its own module: `catalog.namespaces` (namespaces,
fingerprints, statistics, history), `catalog.publish`, `catalog.lookup`,
`catalog.replicas`, `catalog.names` (refs, pins, demand), `catalog.lineage`
(prefix tree, quarantine); all share one `catalog.transactions.Database`.
`Catalog` puts them together and implements `catalog.base.CatalogAPI`.

Change listeners (`add_change_listener`) are told of every committed change to
a ref or pin, every quarantine and every chunk GC purges (`catalog.changes`);
`restore.journal.attach_journal` uses one to journal them to the stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from catalog import database
from catalog.access import AccessLog
from catalog.changes import ChangeListener
from catalog.errors import CatalogUnavailableError
from catalog.lineage import Lineage
from catalog.lookup import Lookups
from catalog.names import Names
from catalog.namespaces import Namespaces
from catalog.publish import Publishing
from catalog.replicas import Replicas
from catalog.transactions import Database

if TYPE_CHECKING:
    from catalog.base import CatalogAPI


class Catalog(Namespaces, Publishing, Lookups, Replicas, Names, Lineage):
    """Facts about stored KV chunks, over SQLite or PostgreSQL; safe for many threads and processes.

    Open with `Catalog.open(url)`; close (or use as a context manager) to flush
    batched access statistics.
    """

    def __init__(self, engine: Any, url: str, *, access_flush_s: float = 2.0) -> None:
        self.db = Database(engine, url)
        self.engine = engine
        self.url = self.db.url
        self._access = AccessLog(self.db, access_flush_s)

    @classmethod
    def open(cls, url: str, *, upgrade: bool = False, pool_size: int = 5, **kwargs: Any) -> Catalog:
        """Open the catalog at `url`; refuse a database of another schema revision.

        `upgrade=True` runs the migrations first (what `kvc init` does). `pool_size`:
        database connections kept open, about the threads that call the catalog at once.
        `CatalogInputError`: malformed URL; `CatalogUnavailableError`: the
        database cannot be reached; `SchemaVersionError`: run `kvc db upgrade`.
        """
        engine = database.create_engine(url, pool_size=pool_size, create=upgrade)
        try:
            if upgrade:
                database.upgrade(engine)
            else:
                database.check_schema(engine, url)
        except DBAPIError as exc:
            engine.dispose()
            detail = str(exc.orig or exc).splitlines()[0] if str(exc.orig or exc) else ""
            raise CatalogUnavailableError(
                f"cannot reach catalog {database.safe_url(url)}: "
                f"{type(exc.orig or exc).__name__}: {detail:.200}"
            ) from exc
        except Exception:
            engine.dispose()
            raise
        return cls(engine, url, **kwargs)

    def upgrade(self, revision: str = "head") -> None:
        database.upgrade(self.engine, revision)

    def current_revision(self) -> str | None:
        return database.current_revision(self.engine)

    def ping(self) -> None:
        """One round trip to the database (health checks); `CatalogUnavailableError` if down."""
        with self.db.read() as conn:
            conn.exec_driver_sql("SELECT 1")

    def add_change_listener(self, fn: ChangeListener) -> None:
        """Call `fn(change)` after each committed change worth journaling (`catalog.changes`).

        Changes: `RefSet` (create, fork, compare-and-swap move), `RefDeleted`,
        `PinSet`, `PinRemoved`, `Quarantined`, `ChunkPurged` (a row GC dropped).
        `fn` runs in the thread that made the change, after its transaction
        committed (never for a rolled-back or refused one), before the call that
        made it returns; keep it short. If it raises, the change stays committed
        and the call still succeeds: the failure is logged and counted in
        `journal_failures`.
        """
        self.db.changes.add(fn)

    def remove_change_listener(self, fn: ChangeListener) -> None:
        self.db.changes.remove(fn)

    @property
    def change_listeners(self) -> tuple[ChangeListener, ...]:
        """The listeners told of each committed change, in the order they were added."""
        return self.db.changes.listeners

    @property
    def journal_failures(self) -> int:
        """How many times a change listener (the journal) raised since this catalog was opened."""
        return self.db.changes.failures

    def flush_access(self) -> None:
        """Write batched access counts and times now (lookups batch them; `close` flushes)."""
        self._access.flush()

    def close(self) -> None:
        self._access.close()
        self.db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:

    def _implements_catalog_api(catalog: Catalog) -> CatalogAPI:
        return catalog  # mypy checks that Catalog has every CatalogAPI method, typed alike
