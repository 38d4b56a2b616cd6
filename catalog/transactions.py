"""The catalog's database handle: reads, write transactions with retries, shared caches, events.

`Database` is the internal interface every catalog module (and `catalog.gc`)
builds on; nothing outside `catalog/` uses it. It owns:

- `read()`: a connection for queries; `read_rows()`: one snapshot's statements in the
  driver's own SQL (the lookup's), on SQLite without SQLAlchemy's pool;
- `write()`: a write transaction (SQLite takes the write lock up front with
  `BEGIN IMMEDIATE`); callbacks registered with `after_commit` run once it commits;
- `changed(conn, change)`: announce a journaled change (`catalog.changes`) to the
  catalog's listeners once the transaction commits;
- `retrying(fn)`: runs `fn` (which opens its own `write()`) again on deadlocks,
  serialization failures and a busy SQLite;
- `hold(conn, namespaces, prefixes, what)` and `exclude_holders(conn, namespace)`: keep
  a GC's mark and the transactions that name its nodes in order;
- the namespace and fingerprint caches (filled only after a commit), `insert`
  (the dialect's INSERT, for ON CONFLICT) and `event` (one history row).

Errors: an unreachable or failing database is `CatalogUnavailableError` (the
transaction did not commit); a connection lost while committing is
`OutcomeUnknownError`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from catalog import database
from catalog.changes import Change, ChangeFeed
from catalog.clock import utcnow
from catalog.errors import CatalogUnavailableError, OutcomeUnknownError, PurgeInProgressError
from catalog.identity import Fingerprint, chain_root
from catalog.lru import LRU
from catalog.schema import Chunk, Event, FingerprintRow, Namespace, NamespaceFingerprint
from catalog.sqlite_readers import SQLiteReaders

T = TypeVar("T")

CACHE_ENTRIES = 4096  # namespaces, and fingerprints, each cache keeps (least recently used go)
FINGERPRINT_CACHE_BYTES = 16 << 20  # the descriptors the fingerprint cache keeps, at most

_AFTER_COMMIT = "kvc_after_commit"  # conn.info key: callbacks run once the write commits
_RETRYABLE_PG = {"40001", "40P01"}  # serialization failure, deadlock detected


def _busy(exc: DBAPIError) -> bool:
    """A conflict that rolled the transaction back and goes away on retry."""
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return "database is locked" in str(exc.orig) or code in _RETRYABLE_PG


def _unreachable(exc: DBAPIError) -> bool:
    """The database could not be reached or stopped answering (not a bug in a statement)."""
    return exc.connection_invalidated or isinstance(exc, (OperationalError, InterfaceError))


# The advisory-lock class of a namespace's GC mark (PostgreSQL): "kvc".
_GC_LOCK_CLASS = 0x6B7663


def driver_rows(conn: sa.Connection, sql: str, params: Any) -> list[Any]:
    """The rows of one statement in the driver's own SQL and parameter style, as the driver
    returns them, in `conn`'s transaction (begun here if none is).

    For the lookup's hot statements: SQLAlchemy's result object (a column map built per
    execution) cost more than running them. What SQLAlchemy would do around a statement
    is kept: its `before_cursor_execute` / `after_cursor_execute` listeners (tracing,
    statement logs) see it, and driver errors come out as its `DBAPIError` (`read` and
    `write` map them).
    """
    if not conn.in_transaction():
        conn.begin()  # SQLite's BEGIN (the engine's "begin" event); psycopg's is implicit
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    error = conn.dialect.loaded_dbapi.Error
    try:
        for before in conn.dispatch.before_cursor_execute:
            sql, params = before(conn, cursor, sql, params, None, False)
        cursor.execute(sql, params)
        rows = list(cursor.fetchall())
        for after in conn.dispatch.after_cursor_execute:
            after(conn, cursor, sql, params, None, False)
        return rows
    except error as exc:
        # As SQLAlchemy does: a lost connection is invalidated (the pool replaces it) so
        # that nothing else is sent on it and this error is the one reported.
        lost = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
        if lost:
            conn.invalidate()
        raise DBAPIError.instance(sql, params, exc, error, connection_invalidated=lost) from exc
    finally:
        cursor.close()


def _gc_lock_key(ns_id: int) -> Any:
    return sa.cast((_GC_LOCK_CLASS << 32) | ns_id, sa.BigInteger)


def hold(conn: sa.Connection, ns_ids: Iterable[int], hashes: set[bytes], what: str) -> list[Any]:
    """Keep GC's mark out of these namespaces until the transaction ends, and refuse if GC is
    purging any of these prefix nodes (`PurgeInProgressError`); return their chunk rows.

    On PostgreSQL each namespace's advisory lock is taken shared: GC's mark takes it
    exclusively (`exclude_holders`), so a GC waits for this transaction (and then sees
    what it added), a transaction that comes after a GC's mark sees the chunks it
    marked, and publishes, ref moves and pins naming the same nodes (a shared system
    prompt) neither wait for each other nor write lock marks into those rows. SQLite's
    single writer is exclusive anyway.
    """
    if conn.dialect.name == "postgresql":
        for ns_id in sorted(set(ns_ids)):
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock_shared(_gc_lock_key(ns_id))))
    if not hashes:
        return []
    rows: list[Any] = []
    for batch in database.batches(sorted(hashes)):
        rows += conn.execute(
            sa.select(Chunk.id, Chunk.prefix_hash, Chunk.state)
            .where(Chunk.prefix_hash.in_(batch))
            .order_by(Chunk.id)
        ).all()
    purging = tuple(sorted({r.prefix_hash for r in rows if r.state == "purging"}))
    if purging:
        raise PurgeInProgressError(
            f"prefix {purging[0].hex()} {what} is being purged by GC; "
            "nothing was changed: retry once the GC run finishes",
            purging,
        )
    return list(rows)


def exclude_holders(conn: sa.Connection, ns_id: int) -> None:
    """Wait for every transaction that `hold`s namespace `ns_id` to end, and keep new ones
    waiting until this one ends (GC's mark; PostgreSQL, a no-op on SQLite)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_gc_lock_key(ns_id))))


class Database:
    """One engine and what every catalog module shares; safe for many threads."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = database.safe_url(url)
        self._writer = engine.execution_options(kvc_write=True)
        # PostgreSQL reads run without BEGIN and COMMIT (see `read`).
        self._reader = (
            engine.execution_options(isolation_level="AUTOCOMMIT")
            if engine.dialect.name == "postgresql"
            else engine
        )
        # SQLite has one writer at a time, and a writer waiting for the lock polls it with
        # growing sleeps, so under many writers some wait seconds while others get in.
        # The writers of this process queue here instead, and only one of them at a time
        # polls SQLite against other processes. (Re-entrant: a nested write in one thread
        # meets SQLite's lock, as it did without this one.)
        self._write_lock = threading.RLock() if engine.dialect.name == "sqlite" else None
        self._sqlite_readers = (
            SQLiteReaders(engine, engine.pool.size())  # type: ignore[attr-defined]
            if engine.dialect.name == "sqlite"
            else None
        )
        # Rows that never change once committed, cached by name / hex; bounded so a
        # catalog with very many namespaces or fingerprints cannot grow the process.
        self._ns_cache: LRU[str, tuple[int, int]] = LRU(CACHE_ENTRIES)
        self._fp_cache: LRU[str, Fingerprint] = LRU(
            CACHE_ENTRIES, max_weight=FINGERPRINT_CACHE_BYTES, weigh=lambda fp: len(fp.canonical)
        )
        self._ns_fp_cache: LRU[tuple[int, str], bool] = LRU(CACHE_ENTRIES)
        self.changes = ChangeFeed()

    def _unavailable(self, exc: DBAPIError) -> CatalogUnavailableError:
        detail = str(exc.orig or exc).splitlines()[0] if str(exc.orig or exc) else ""
        return CatalogUnavailableError(
            f"catalog {self.url} is unavailable: {type(exc.orig or exc).__name__}: {detail:.200}"
        )

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        """A connection for queries (no transaction is left open after the block).

        On PostgreSQL the connection is in autocommit: each statement is its own
        transaction, as each already saw its own snapshot at READ COMMITTED, so the
        block reads the same without the BEGIN and COMMIT round trips (two of a
        lookup's five, each a wake-up of a server thread and of a PostgreSQL backend
        that waits for a core under load). On SQLite the block is one transaction
        (one snapshot) and ends with a COMMIT. Neither ever sends the ROLLBACK that
        closing a connection in a transaction would: psycopg forgets every statement
        it has prepared on each ROLLBACK, which kept the lookup's statements from
        ever being prepared (PostgreSQL planned them again on every lookup: 1.3 ms of
        planning for 0.2 ms of execution). Nothing here writes (writes go through
        `write`).
        """
        try:
            with self._reader.connect() as conn:
                yield conn
                if conn.in_transaction():
                    conn.commit()
        except DBAPIError as exc:
            if _unreachable(exc):
                raise self._unavailable(exc) from exc
            raise

    @contextmanager
    def read_rows(self) -> Iterator[Callable[[str, Any], list[Any]]]:
        """One snapshot's reads in the driver's own SQL and parameter style: a function of
        `(sql, params)` returning the driver's rows (what `driver_rows` does on `read`).

        On SQLite, when no listener watches statements, they run between a plain BEGIN
        and COMMIT on a connection of `SQLiteReaders`, not through SQLAlchemy's pool (see
        `catalog.sqlite_readers`); errors are mapped as `read` maps them. With a
        `before_cursor_execute` or `after_cursor_execute` listener on the engine (tracing,
        statement logs, tests), and on PostgreSQL, they run on `read`'s connection, so
        every listener sees them with the connection it expects.
        """
        readers = self._sqlite_readers
        dispatch = self.engine.dispatch
        if readers is None or dispatch.before_cursor_execute or dispatch.after_cursor_execute:
            with self.read() as conn:
                yield functools.partial(driver_rows, conn)
            return
        driver: Any = readers.take()
        dbapi_error = self.engine.dialect.loaded_dbapi.Error
        try:
            driver.execute("BEGIN")
            yield lambda sql, params: driver.execute(sql, params).fetchall()
            driver.execute("COMMIT")
        except dbapi_error as exc:
            lost = self.engine.dialect.is_disconnect(exc, driver, None)
            readers.drop(driver)
            driver = None
            error = DBAPIError.instance(None, None, exc, dbapi_error, connection_invalidated=lost)
            if isinstance(error, DBAPIError) and _unreachable(error):
                raise self._unavailable(error) from exc
            raise error from exc
        finally:
            if driver is not None:
                if driver.in_transaction:  # the block raised: end its snapshot
                    driver.rollback()
                readers.give_back(driver)

    def close(self) -> None:
        """Close every connection (the engine's pool and the SQLite readers)."""
        if self._sqlite_readers is not None:
            self._sqlite_readers.close()
        self.engine.dispose()

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """A write transaction: committed when the block ends, rolled back if it raises."""
        pending: list[Callable[[], None]] = []
        with self._write_turn(), self._writer.connect() as conn:
            tx = conn.begin()
            conn.info[_AFTER_COMMIT] = pending
            try:
                yield conn
            except BaseException:
                if tx.is_active:
                    tx.rollback()
                raise
            finally:
                conn.info.pop(_AFTER_COMMIT, None)
            try:
                tx.commit()
            except DBAPIError as exc:
                if _busy(exc) or not _unreachable(exc):
                    raise  # rolled back: `retrying` runs it again, or it is a bug
                raise OutcomeUnknownError(
                    f"catalog {self.url}: the connection was lost while committing; "
                    "the change may or may not have landed"
                ) from exc
        for fn in pending:  # committed: now the caches may learn what it created
            fn()

    @contextmanager
    def _write_turn(self) -> Iterator[None]:
        """This process's turn to write (SQLite), waited for as long as SQLite's busy timeout."""
        if self._write_lock is None:
            yield
            return
        if not self._write_lock.acquire(timeout=database.SQLITE_BUSY_TIMEOUT_S):
            raise CatalogUnavailableError(
                f"catalog {self.url} is unavailable: other writers of this process held it "
                f"for {database.SQLITE_BUSY_TIMEOUT_S} s"
            )
        try:
            yield
        finally:
            self._write_lock.release()

    @staticmethod
    def after_commit(conn: sa.Connection, fn: Callable[[], None]) -> None:
        """Run `fn` once `conn`'s write transaction commits (never if it rolls back)."""
        pending = conn.info.get(_AFTER_COMMIT)
        if pending is None:  # not in a write transaction: nothing this created can roll back
            fn()
        else:
            pending.append(fn)

    def changed(self, conn: sa.Connection, change: Change) -> None:
        """Tell the change listeners about `change` once `conn`'s transaction commits."""
        feed = self.changes
        self.after_commit(conn, lambda: feed.publish(change))

    def retrying(self, fn: Callable[[], T], attempts: int = 8) -> T:
        """Run a write transaction, retrying deadlocks, serialization failures and busy SQLite."""
        for attempt in range(attempts):
            try:
                return fn()
            except DBAPIError as exc:
                if _busy(exc) and attempt < attempts - 1:
                    time.sleep(min(0.5, 0.01 * 2**attempt))
                    continue
                if _busy(exc) or _unreachable(exc):
                    raise self._unavailable(exc) from exc
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def insert(conn: sa.Connection, table: Any) -> Any:
        """The dialect's INSERT for `table` (it has `on_conflict_do_nothing/update`)."""
        dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
        return dialect.insert(table)

    def known_namespace(self, name: str) -> tuple[int, int] | None:
        """(id, chunk size) of a namespace if the cache holds it (no query)."""
        return self._ns_cache.get(name)

    def known_fingerprint(self, hex_: str, ns_id: int) -> Fingerprint | None:
        """The fingerprint with this hex if the caches hold it and that namespace `ns_id`
        uses it (no query)."""
        if (ns_id, hex_) not in self._ns_fp_cache:
            return None
        return self._fp_cache.get(hex_)

    def namespace(
        self, conn: sa.Connection, name: str, *, create_chunk_size: int | None = None
    ) -> tuple[int, int] | None:
        """(id, chunk size) of a namespace, created with `create_chunk_size` if given; else None."""
        cached = self.known_namespace(name)
        if cached is not None:
            return cached
        row = conn.execute(
            sa.select(Namespace.id, Namespace.chunk_size).where(Namespace.name == name)
        ).first()
        if row is None and create_chunk_size is not None:
            chain_root(name)  # validates the name
            conn.execute(
                self.insert(conn, Namespace)
                .values(name=name, chunk_size=create_chunk_size, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["name"])
            )
            row = conn.execute(
                sa.select(Namespace.id, Namespace.chunk_size).where(Namespace.name == name)
            ).first()
        if row is None:
            return None
        found = (row[0], row[1])
        self.after_commit(conn, lambda: self._ns_cache.put(name, found))
        return found

    def ensure_fingerprint(self, conn: sa.Connection, fp: Fingerprint, ns_id: int | None) -> None:
        """Store the fingerprint's descriptor if it is not catalogued yet, and note that
        namespace `ns_id` uses it (a tenant reads only the fingerprints it registered)."""
        if fp.hex not in self._fp_cache:
            conn.execute(
                self.insert(conn, FingerprintRow)
                .values(hex=fp.hex, descriptor=dict(fp.descriptor), created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["hex"])
            )
            # Cached only once committed: a refused publish must not leave the cache
            # believing its fingerprint is catalogued.
            self.after_commit(conn, lambda: self._fp_cache.put(fp.hex, fp))
        if ns_id is None or (ns_id, fp.hex) in self._ns_fp_cache:
            return
        conn.execute(
            self.insert(conn, NamespaceFingerprint)
            .values(namespace_id=ns_id, fingerprint=fp.hex, created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["namespace_id", "fingerprint"])
        )
        self.after_commit(conn, lambda: self._ns_fp_cache.put((ns_id, fp.hex), True))

    def fingerprint(
        self, conn: sa.Connection, hex_: str, ns_id: int | None = None
    ) -> Fingerprint | None:
        """The catalogued fingerprint with this hex (only if namespace `ns_id` uses it, when
        given), or None."""
        if ns_id is not None and (ns_id, hex_) not in self._ns_fp_cache:
            used = conn.execute(
                sa.select(sa.literal(1)).where(
                    NamespaceFingerprint.namespace_id == ns_id,
                    NamespaceFingerprint.fingerprint == hex_,
                )
            ).first()
            if used is None:
                return None
            self._ns_fp_cache.put((ns_id, hex_), True)
        found = self._fp_cache.get(hex_)
        if found is None:
            desc = conn.execute(
                sa.select(FingerprintRow.descriptor).where(FingerprintRow.hex == hex_)
            ).scalar()
            if desc is None:
                return None
            found = Fingerprint.from_descriptor(desc)
            self._fp_cache.put(hex_, found)
        return found

    @staticmethod
    def event(
        conn: sa.Connection,
        kind: str,
        namespace: str | None,
        subject: str | None,
        actor: str | None,
        details: dict[str, Any],
    ) -> None:
        """Append one row to the history (in the caller's transaction)."""
        conn.execute(
            sa.insert(Event).values(
                at=utcnow(),
                kind=kind,
                namespace=namespace,
                subject=subject,
                actor=actor,
                details=details,
            )
        )
