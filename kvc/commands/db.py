"""`kvc db upgrade|current` and `kvc init`: the catalog schema and the embedded home."""

from __future__ import annotations

import sys
from typing import Any

import click

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    create_home,
    emit,
    fail,
    settings_options,
)
from kvc.settings import Settings


@click.group()
def db() -> None:
    """Manage the catalog database schema (Alembic migrations)."""


def _engine(settings: Settings, *, create: bool) -> Any:
    """The catalog's engine; with `create`, the embedded home and the SQLite file may be
    created, else nothing is (a missing catalog is an error)."""
    from catalog import database
    from catalog.errors import CatalogError

    url = settings.resolved_catalog_url
    if create:
        create_home(settings)
    try:
        return database.create_engine(url, create=create)
    except CatalogError as exc:
        fail(str(exc), EXIT_USAGE)


@db.command("upgrade", epilog="Example: kvc db upgrade --catalog postgresql+psycopg://kvc@db/kvc")
@settings_options
@click.option("--revision", default="head", show_default=True, help="Target schema revision.")
def db_upgrade(settings: Settings, as_json: bool, revision: str) -> None:
    """Create or upgrade the catalog schema to REVISION (idempotent). Back up first."""
    from catalog import database

    url = database.safe_url(settings.resolved_catalog_url)
    engine = _engine(settings, create=True)
    try:
        before = database.current_revision(engine)
        database.upgrade(engine, revision)
        after = database.current_revision(engine)
    except Exception as exc:
        fail(f"cannot upgrade {url}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    finally:
        engine.dispose()
    emit(
        as_json,
        {"catalog": url, "from": before, "to": after},
        f"{url}: schema {before or 'empty'} -> {after}",
    )


@db.command("current", epilog="Example: kvc db current --json")
@settings_options
def db_current(settings: Settings, as_json: bool) -> None:
    """Show the catalog's schema revision and whether it is the latest this kvc knows.

    Exits 1 when the database needs `kvc db upgrade` (or a newer kvc)."""
    from catalog import database

    url = database.safe_url(settings.resolved_catalog_url)
    engine = _engine(settings, create=False)
    try:
        current = database.current_revision(engine)
        head = database.head_revision()
        state = database.schema_state(current)
    except Exception as exc:
        fail(f"cannot read {url}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    finally:
        engine.dispose()
    ok = state == "latest"
    why = {
        "latest": "(the latest)",
        "behind": f"(behind: the latest is {head}; run `kvc db upgrade`)",
        "empty": f"(no kvc schema yet: run `kvc db upgrade` or `kvc init` to create {head})",
        "unknown": f"(not a revision this kvc knows; its latest is {head}: a newer kvc wrote it)",
    }[state]
    emit(
        as_json,
        {"catalog": url, "current": current, "head": head, "state": state, "up_to_date": ok},
        f"{url}: schema {current or 'empty'} {why}",
    )
    if not ok:
        sys.exit(EXIT_PROBLEMS)


@click.command("init", epilog="Example: KVC_HOME=/var/lib/kvc kvc init")
@settings_options
def init(settings: Settings, as_json: bool) -> None:
    """Create the home (catalog schema and local store) if needed; safe to run again."""
    from catalog.database import safe_url
    from kvc.commands.common import open_catalog, open_stores

    with open_catalog(settings, upgrade=True) as cat:
        cat.ensure_namespace(settings.namespace, settings.chunk_size)
        revision = cat.current_revision()
    stores = open_stores(settings)
    doc = {
        "home": str(settings.home.resolve()),
        "catalog": safe_url(settings.resolved_catalog_url),
        "schema": revision,
        "stores": [s.name for s in stores],
        "namespace": settings.namespace,
    }
    for s in stores:
        s.close()
    emit(as_json, doc, "\n".join(f"{k}: {v}" for k, v in doc.items()))


def register(cli: click.Group) -> None:
    cli.add_command(db)
    cli.add_command(init)
