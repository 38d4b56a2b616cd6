"""`kvc backup PATH`: a consistent, verified copy of the embedded SQLite catalog (catalog.backup)."""

from __future__ import annotations

import click

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    ProgressBars,
    emit,
    fail,
    settings_options,
)
from kvc.commands.format import human_bytes
from kvc.settings import Settings

_EPILOG = """\b
Example:
  kvc backup /backups/catalog-$(date +%F).db

\b
Restoring (docs/operations.md, "Recovery runbook"): stop every writer, replace
the catalog file with the backup (and delete the old catalog.db-wal and
catalog.db-shm), then run `kvc db current` and `kvc fsck`. PostgreSQL catalogs
are backed up with pg_dump -Fc instead (exit 2 here)."""


@click.command("backup", epilog=_EPILOG)
@settings_options
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace PATH if it exists.")
def backup(settings: Settings, as_json: bool, path: str, force: bool) -> None:
    """Copy the SQLite catalog to PATH with SQLite's online backup API.

    Safe while kvc runs: the copy is one consistent snapshot (writers go on;
    what they commit after it starts is not in it). It is written to a temporary
    file next to PATH, checked (integrity_check, schema revision equal to the
    catalog's), fsynced and renamed onto PATH, so PATH never holds a partial
    backup. Refuses an existing PATH unless --force. Exit 0 with a verified
    backup, 1 when the backup failed, 2 for usage errors (a PostgreSQL catalog:
    use pg_dump; PATH exists)."""
    from catalog.backup import BackupError, backup_sqlite
    from catalog.errors import CatalogInputError, CatalogUnavailableError

    bar = ProgressBars(as_json, unit="page")
    try:
        report = backup_sqlite(settings.resolved_catalog_url, path, force=force, progress=bar)
    except CatalogInputError as exc:
        fail(str(exc), EXIT_USAGE)
    except (BackupError, CatalogUnavailableError) as exc:
        fail(str(exc), EXIT_PROBLEMS)
    except OSError as exc:
        fail(f"cannot write backup {path}: {exc.strerror or exc}", EXIT_PROBLEMS)
    finally:
        bar.close()
    emit(
        as_json,
        report.to_dict(),
        f"backed up {report.source} to {report.path}: {report.pages} pages, "
        f"{human_bytes(report.bytes)}, schema {report.revision}, integrity {report.integrity}",
    )


def register(cli: click.Group) -> None:
    cli.add_command(backup)
