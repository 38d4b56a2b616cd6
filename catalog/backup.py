"""Backups of an embedded SQLite catalog with SQLite's online backup API, consistent while writers run.

A backup copies one snapshot of the database: the source connection holds a
read transaction for the whole copy, so every step sees the same committed
state (in WAL mode writers go on meanwhile; their commits after the snapshot
are not in the backup). The copy goes to a temporary file next to the target,
is switched to a self-contained rollback journal, checked (`PRAGMA
integrity_check`, the Alembic revision equals the source's), fsynced and only
then renamed onto the target: there is never a half-written backup at the
target path.

PostgreSQL catalogs are refused: back them up with `pg_dump` (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from catalog.database import safe_url
from catalog.errors import CatalogError, CatalogInputError, CatalogUnavailableError

if TYPE_CHECKING:
    from catalog.catalog import Catalog

log = logging.getLogger(__name__)

# progress(stage, done, total): the shape of maintenance.progress.Progress (catalog cannot import it).
BackupProgress = Callable[[str, int, int | None], None]

PAGES_PER_STEP = 1024  # 4 MiB per step at SQLite's default page size


class BackupError(CatalogError):
    """The backup could not be made or did not verify; nothing was left at the target path."""


@dataclass(frozen=True)
class BackupReport:
    """A verified backup: where it is, what it was copied from, its size and schema revision."""

    path: str
    source: str
    pages: int
    page_size: int
    bytes: int
    revision: str
    integrity: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "pages": self.pages,
            "page_size": self.page_size,
            "bytes": self.bytes,
            "revision": self.revision,
            "integrity": self.integrity,
            "seconds": round(self.seconds, 3),
        }


def sqlite_path(catalog_or_url: Catalog | str) -> Path:
    """The database file of a SQLite catalog; `CatalogInputError` for any other catalog."""
    url: Any = catalog_or_url if isinstance(catalog_or_url, str) else catalog_or_url.engine.url
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise CatalogInputError(f"malformed catalog URL {url!r:.200}") from exc
    if parsed.get_backend_name() != "sqlite":
        raise CatalogInputError(
            f"catalog {safe_url(parsed)} is not an embedded SQLite catalog; back up PostgreSQL "
            "with `pg_dump -Fc` (and restore with `pg_restore`), or rebuild the catalog from "
            "the stores with `kvc rebuild`: see docs/operations.md#backup"
        )
    if parsed.database in (None, "", ":memory:"):
        raise CatalogInputError("an in-memory SQLite catalog has no file to back up")
    return Path(parsed.database)


def backup_sqlite(
    catalog_or_url: Catalog | str,
    path: str | os.PathLike[str],
    *,
    force: bool = False,
    pages_per_step: int = PAGES_PER_STEP,
    progress: BackupProgress | None = None,
) -> BackupReport:
    """Copy the SQLite catalog to `path` consistently, verify the copy, and report it.

    Safe while other processes read and write the catalog. `progress("backup",
    pages_done, pages_total)` is called after each step of `pages_per_step`
    pages. Refuses (`CatalogInputError`, nothing written) a PostgreSQL catalog,
    an existing `path` unless `force`, a `path` that is the catalog itself or
    whose directory does not exist. `CatalogUnavailableError`: the catalog
    file cannot be opened or read. `BackupError`: the copy failed or did not
    verify; nothing is left at `path`.
    """
    if pages_per_step < 1:
        raise CatalogInputError(f"pages_per_step must be at least 1, not {pages_per_step}")
    source = sqlite_path(catalog_or_url)
    target = Path(path)
    _check_target(source, target, force)
    started = time.monotonic()
    src = _open_source(source)
    try:
        # One read transaction for the whole copy: every step reads the same snapshot,
        # and no commit by another connection makes the backup restart.
        src.execute("BEGIN")
        revision = _revision(src, source)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            # mkstemp makes the file 0600; the backup gets the catalog's own permissions.
            os.chmod(tmp, source.stat().st_mode & 0o777)
            report = _copy(src, source, tmp, revision, pages_per_step, progress)
            src.execute("COMMIT")
            _publish(tmp, target, force)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    finally:
        src.close()
    seconds = time.monotonic() - started
    log.info("backed up %s to %s: %d pages, revision %s", source, target, report.pages, revision)
    return BackupReport(
        path=str(target.resolve()),
        source=str(source),
        pages=report.pages,
        page_size=report.page_size,
        bytes=report.bytes,
        revision=revision,
        integrity=report.integrity,
        seconds=seconds,
    )


def _check_target(source: Path, target: Path, force: bool) -> None:
    if not target.parent.is_dir():
        raise CatalogInputError(f"directory {target.parent} of backup {target} does not exist")
    if target.is_dir():
        raise CatalogInputError(f"backup target {target} is a directory; give a file path")
    if source.exists() and target.exists() and os.path.samefile(source, target):
        raise CatalogInputError(f"backup target {target} is the catalog itself")
    if target.exists() and not force:
        raise CatalogInputError(f"backup target {target} exists; choose another path or --force")


def _open_source(source: Path) -> sqlite3.Connection:
    if not source.is_file():
        raise CatalogUnavailableError(f"SQLite catalog {source} does not exist")
    try:
        # mode=rw: never create an empty database where the catalog should be.
        conn = sqlite3.connect(
            f"{source.resolve().as_uri()}?mode=rw", uri=True, timeout=30, isolation_level=None
        )
        conn.execute("PRAGMA busy_timeout=30000")
    except sqlite3.Error as exc:
        raise CatalogUnavailableError(f"cannot open SQLite catalog {source}: {exc}") from exc
    return conn


def _revision(conn: sqlite3.Connection, where: Path) -> str:
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.DatabaseError as exc:
        if "no such table" in str(exc):
            row = None
        else:
            raise CatalogUnavailableError(f"cannot read SQLite catalog {where}: {exc}") from exc
    if row is None:
        raise CatalogInputError(
            f"{where} has no kvc schema (no Alembic revision): nothing to back up"
        )
    return str(row[0])


@dataclass(frozen=True)
class _Copied:
    pages: int
    page_size: int
    bytes: int
    integrity: str


def _copy(
    src: sqlite3.Connection,
    source: Path,
    tmp: Path,
    revision: str,
    pages_per_step: int,
    progress: BackupProgress | None,
) -> _Copied:
    def step(_status: int, remaining: int, total: int) -> None:
        if progress is not None:
            progress("backup", total - remaining, total)

    dst = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        try:
            src.backup(dst, pages=pages_per_step, progress=step, sleep=0.05)
        except sqlite3.Error as exc:
            raise BackupError(f"backup of {source} failed: {exc}") from exc
        # The copy keeps the source's WAL flag; a rollback journal makes it one self-contained file.
        dst.execute("PRAGMA journal_mode=DELETE")
        integrity = [str(r[0]) for r in dst.execute("PRAGMA integrity_check").fetchall()]
        if integrity != ["ok"]:
            raise BackupError(
                f"backup of {source} failed integrity_check: {'; '.join(integrity)[:500]}"
            )
        copied = _revision(dst, tmp)
        if copied != revision:
            raise BackupError(f"backup of {source} has revision {copied}, the source {revision}")
        pages = int(dst.execute("PRAGMA page_count").fetchone()[0])
        page_size = int(dst.execute("PRAGMA page_size").fetchone()[0])
    finally:
        dst.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    return _Copied(pages, page_size, tmp.stat().st_size, integrity[0])


def _publish(tmp: Path, target: Path, force: bool) -> None:
    """Move the verified copy onto `target` (never over an existing file unless `force`)."""
    try:
        if force:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # fails if target appeared meanwhile: no clobbering
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: check, then rename
                if target.exists():
                    raise FileExistsError(target) from None
                os.replace(tmp, target)
            else:
                tmp.unlink()
    except FileExistsError:
        raise CatalogInputError(
            f"backup target {target} exists; choose another path or --force"
        ) from None
    except OSError as exc:
        raise BackupError(f"cannot move the backup to {target}: {exc.strerror or exc}") from exc
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
