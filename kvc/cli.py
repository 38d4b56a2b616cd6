"""The `kvc` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from kvc import __version__


def default_catalog_url() -> str:
    home = Path(os.environ.get("KVC_HOME", ".kvc"))
    return f"sqlite:///{home.resolve() / 'catalog.db'}"


def fail(message: str, code: int = 1) -> NoReturn:
    """One clear line on stderr, no traceback, a meaningful exit code."""
    click.echo(f"kvc: error: {message}", err=True)
    sys.exit(code)


def emit(as_json: bool, doc: dict[str, Any], text: str) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True) if as_json else text)


catalog_option = click.option(
    "--catalog",
    "catalog_url",
    envvar="KVC_CATALOG_URL",
    default=None,
    metavar="URL",
    help="Catalog database: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB "
    "(env KVC_CATALOG_URL; default: $KVC_HOME/catalog.db, KVC_HOME defaults to ./.kvc).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Example: kvc db upgrade --catalog sqlite:///$PWD/.kvc/catalog.db",
)
@click.version_option(__version__, "-V", "--version", prog_name="kvc")
def cli() -> None:
    """kvc keeps the attention state (KV cache) of language-model prompts as durable,
    verified, forkable chunks in an object store or a local directory, catalogued in
    SQLite or PostgreSQL, so any worker can restore the longest stored prefix of a new
    prompt instead of recomputing it."""


@cli.group()
def db() -> None:
    """Manage the catalog database schema (Alembic migrations)."""


@db.command("upgrade", epilog="Example: kvc db upgrade --catalog postgresql+psycopg://kvc@db/kvc")
@catalog_option
@json_option
@click.option("--revision", default="head", show_default=True, help="Target schema revision.")
def db_upgrade(catalog_url: str | None, as_json: bool, revision: str) -> None:
    """Create or upgrade the catalog schema to REVISION (idempotent). Back up first."""
    from catalog import database
    from catalog.errors import CatalogError

    url = catalog_url or default_catalog_url()
    if url.startswith("sqlite:///") and not catalog_url:
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = database.create_engine(url)
        before = database.current_revision(engine)
        database.upgrade(engine, revision)
        after = database.current_revision(engine)
        engine.dispose()
    except CatalogError as exc:
        fail(str(exc), 2)
    except Exception as exc:  # database unreachable, permissions, ...
        fail(f"cannot upgrade {database.safe_url(url)}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    emit(
        as_json,
        {"catalog": database.safe_url(url), "from": before, "to": after},
        f"{database.safe_url(url)}: schema {before or 'empty'} -> {after}",
    )


@db.command("current", epilog="Example: kvc db current --json")
@catalog_option
@json_option
def db_current(catalog_url: str | None, as_json: bool) -> None:
    """Show the catalog's schema revision and whether it is the one this kvc needs.

    Exits 1 when the database needs `kvc db upgrade`."""
    from catalog import database
    from catalog.errors import CatalogError

    url = catalog_url or default_catalog_url()
    try:
        engine = database.create_engine(url)
        current = database.current_revision(engine)
        engine.dispose()
        head = database.head_revision()
    except CatalogError as exc:
        fail(str(exc), 2)
    except Exception as exc:
        fail(f"cannot read {database.safe_url(url)}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    up_to_date = current == head
    emit(
        as_json,
        {"catalog": database.safe_url(url), "current": current, "head": head, "up_to_date": up_to_date},
        f"{database.safe_url(url)}: schema {current or 'empty'}"
        + ("" if up_to_date else f" (this kvc needs {head}: run `kvc db upgrade`)"),
    )
    if not up_to_date:
        sys.exit(1)


def main() -> None:
    cli(prog_name="kvc")
