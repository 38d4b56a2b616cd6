"""Opening a catalog database: engines for SQLite and PostgreSQL, Alembic upgrades, schema checks."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from catalog.errors import CatalogError, SchemaVersionError

log = logging.getLogger(__name__)

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30  # how long a SQLite writer waits for the write lock
# Each SQLite connection's own page cache. SQLite's default (2 MB) does not hold the
# pages one lookup of a 128k-token prompt reads from a 1M-chunk catalog (512 index
# entries, chunk and replica rows: about 8 MB), so every lookup read them all again
# from the OS: 16 MiB made the 1M lookup 1.36x the 10k one instead of 1.75x
# (docs/performance.md). Filled only as pages are read; up to 3 x pool_size connections.
SQLITE_CACHE_KIB = 16 * 1024


# Bind variables of one statement that lists hashes or keys: SQLite refuses more than
# SQLITE_MAX_VARIABLE_NUMBER (32766 in a default build since 3.32; PostgreSQL 65535), so
# longer lists are cut into batches of this many. A lookup of 128k tokens in chunks of
# 256 (512 hashes) is still one statement.
BIND_BATCH = 16384


def batches(items: Sequence[T], size: int = BIND_BATCH) -> Iterator[Sequence[T]]:
    """`items` in consecutive slices of at most `size` (one slice, itself, when it fits)."""
    if len(items) <= size:
        yield items
        return
    for i in range(0, len(items), size):
        yield items[i : i + size]


def safe_url(url: str | sa.URL) -> str:
    """The URL with any password hidden, for logs and errors."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<malformed URL>"


SQLITE_MAGIC = b"SQLite format 3\x00"


def _check_sqlite_catalog(path: Path, url: str) -> None:
    """Refuse, creating nothing, a SQLite catalog to read that is missing or is not a SQLite
    database: the same configuration error (`SchemaVersionError`) as a missing schema."""
    where = safe_url(url)
    if not path.exists():
        raise SchemaVersionError(
            f"catalog {where} does not exist; run `kvc init` (or `kvc db upgrade`) to create it"
        )
    if path.is_dir():
        raise SchemaVersionError(f"catalog {where} is a directory, not a SQLite database")
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise CatalogError(f"cannot read catalog {where}: {exc.strerror or exc}") from exc
    if head not in (b"", SQLITE_MAGIC):  # empty: created, never written (no schema yet)
        raise SchemaVersionError(f"catalog {where} is not a SQLite database")
    if not head:
        return
    # The header can be right and the rest not: ask SQLite itself, read-only (creates nothing).
    try:
        conn = sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=SQLITE_BUSY_TIMEOUT_S
        )
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        pass  # locked, cannot open its WAL, ...: the catalog's own connection will say
    except sqlite3.DatabaseError as exc:
        detail = "" if "not a database" in str(exc) else f" ({exc})"
        raise SchemaVersionError(f"catalog {where} is not a SQLite database{detail}") from exc


def _create_sqlite_file(path: Path, url: str) -> None:
    """Create an empty SQLite catalog file if there is none (SQLite makes it a database), so
    that a path that cannot be used is one clear `CatalogError`, not SQLite's 'unable to
    open database file'."""
    where = safe_url(url)
    if path.is_dir():
        raise CatalogError(f"cannot create catalog {where}: {path} is a directory")
    if path.exists():
        return
    if not path.parent.exists():
        raise CatalogError(f"cannot create catalog {where}: directory {path.parent} does not exist")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # someone else created it meanwhile
    except OSError as exc:
        raise CatalogError(f"cannot create catalog {where}: {exc.strerror or exc}") from exc
    os.close(fd)


def create_engine(url: str, *, pool_size: int = 5, create: bool = True) -> Engine:
    """An engine for `sqlite:///path` or `postgresql+psycopg://...`, configured for the catalog.

    `create=False` (reading a catalog): a SQLite file that does not exist, or is not a
    SQLite database, is a `SchemaVersionError` and nothing is created. `create=True`: the
    SQLite file is created if missing; a path where it cannot be is a `CatalogError`.

    `pool_size`: connections kept open; up to twice as many more are opened under load and
    closed again (size it to the threads that use the catalog at once)."""
    if pool_size < 1:
        raise ValueError(f"pool_size must be >= 1, got {pool_size!r}")
    pool = {"pool_size": pool_size, "max_overflow": 2 * pool_size}
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise CatalogError(
            f"malformed catalog URL {url!r:.200}: expected sqlite:///PATH or postgresql+psycopg://..."
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise CatalogError(
                "an in-memory SQLite catalog would vanish on close; give a file path: sqlite:///PATH"
            )
        db_path = Path(parsed.database)
        if create:
            _create_sqlite_file(db_path, url)
        else:
            _check_sqlite_catalog(db_path, url)
        engine = sa.create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}, **pool)

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: object) -> None:
            # WAL lets readers run beside one writer; busy_timeout queues writers
            # instead of failing at once; foreign keys are off by default in SQLite.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
            cur.close()
            # Let SQLAlchemy's "begin" event issue BEGIN itself, so writers can
            # take the write lock up front (BEGIN IMMEDIATE) and queue on
            # busy_timeout instead of failing when two upgrade a read lock.
            dbapi_conn.isolation_level = None

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: sa.Connection) -> None:
            immediate = conn.get_execution_options().get("kvc_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    if backend == "postgresql":
        if parsed.get_driver_name() not in ("psycopg", "psycopg2"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        try:
            return sa.create_engine(parsed, pool_pre_ping=True, **pool)
        except (NoSuchModuleError, ImportError) as exc:
            raise CatalogError(
                "PostgreSQL catalogs need psycopg: pip install 'kvc[postgres]'"
            ) from exc
    raise CatalogError(
        f"unsupported catalog URL scheme {parsed.drivername!r} in {safe_url(parsed)}: use sqlite:///PATH or postgresql+psycopg://..."
    )


def alembic_config(connection: sa.Connection | None = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise CatalogError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def known_revisions() -> set[str]:
    """Every schema revision this kvc's migrations know."""
    from alembic.script import ScriptDirectory

    return {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


SchemaState = Literal["latest", "behind", "empty", "unknown"]


def schema_state(current: str | None) -> SchemaState:
    """Where a database at revision `current` stands for this kvc: `latest`, `behind` (run
    `kvc db upgrade`), `empty` (no schema yet) or `unknown` (a revision these migrations do
    not have: a newer kvc wrote it)."""
    if current is None:
        return "empty"
    if current == head_revision():
        return "latest"
    return "behind" if current in known_revisions() else "unknown"


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    with engine.execution_options(kvc_write=True).begin() as conn:
        command.upgrade(alembic_config(conn), revision)


def downgrade(engine: Engine, revision: str) -> None:
    from alembic import command

    with engine.execution_options(kvc_write=True).begin() as conn:
        command.downgrade(alembic_config(conn), revision)


def check_schema(engine: Engine, url: str) -> None:
    """Refuse a database whose schema is not the one this code was written for."""
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    where = safe_url(url)
    if current is None:
        raise SchemaVersionError(
            f"catalog {where} has no kvc schema; run `kvc db upgrade` (or `kvc init`) first"
        )
    if schema_state(current) == "unknown":
        raise SchemaVersionError(
            f"catalog {where} is at schema revision {current}, which this kvc does not know "
            f"(its latest is {head}): a newer kvc upgraded it; use that kvc"
        )
    raise SchemaVersionError(
        f"catalog {where} is at schema revision {current}, this kvc needs {head}; "
        "run `kvc db upgrade` (back up the database first)"
    )


def has_schema(url: str) -> bool:
    """Whether a kvc catalog schema exists at `url`, creating nothing (a missing or empty
    SQLite file is no catalog). `CatalogError` for a malformed URL or a SQLite file that is
    not a database; the database's own error when it cannot be reached."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        parsed = None
    if parsed is not None and parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        if not path.is_file() or path.stat().st_size == 0:
            return False
    engine = create_engine(url, create=False)  # a SQLite file that is not a database says so
    try:
        return current_revision(engine) is not None
    finally:
        engine.dispose()
