"""What every kvc command shares: settings options, one-line errors, JSON output, opening things."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import click
from pydantic import ValidationError
from tqdm import tqdm

from kvc.settings import Settings, load

F = TypeVar("F", bound=Callable[..., Any])

# Exit codes: 0 ok, 1 problems found (or the command failed), 2 usage or configuration error.
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def fail(message: str, code: int = EXIT_PROBLEMS) -> NoReturn:
    """One clear line on stderr, no traceback, a meaningful exit code."""
    click.echo(f"kvc: error: {message}", err=True)
    sys.exit(code)


def emit(as_json: bool, doc: Any, text: str) -> None:
    """stdout carries only the JSON document with --json; text otherwise."""
    click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str) if as_json else text)


def settings_options(fn: F) -> F:
    """--home, --catalog, --store (repeatable), --namespace, --chunk-size, --json; builds `settings`."""

    @click.option(
        "--home",
        type=click.Path(),
        default=None,
        help="Embedded default home (env KVC_HOME, default ./.kvc).",
    )
    @click.option(
        "--catalog",
        "catalog_url",
        default=None,
        metavar="URL",
        help="Catalog: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB (env KVC_CATALOG_URL).",
    )
    @click.option(
        "--store",
        "stores",
        multiple=True,
        metavar="URL",
        help="Store URL, repeatable: file:///DIR or s3://BUCKET/PREFIX?endpoint_url=... (env KVC_STORES, comma-separated).",
    )
    @click.option(
        "--namespace",
        default=None,
        help="Namespace (tenant) to work in (env KVC_NAMESPACE, default 'default').",
    )
    @click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON document on stdout (logs go to stderr).",
    )
    @functools.wraps(fn)
    def wrapper(
        home: str | None,
        catalog_url: str | None,
        stores: tuple[str, ...],
        namespace: str | None,
        as_json: bool,
        **kwargs: Any,
    ) -> Any:
        try:
            settings = load(
                home=home, catalog_url=catalog_url, stores=list(stores) or None, namespace=namespace
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            fail(f"invalid setting {where}: {first['msg'].removeprefix('Value error, ')}", EXIT_USAGE)
        return fn(settings=settings, as_json=as_json, **kwargs)

    return wrapper  # type: ignore[return-value]


def create_home(settings: Settings) -> None:
    """Make the embedded home when the catalog is the embedded one (commands that create call
    this); a home that cannot be made is one line, exit 2."""
    if settings.catalog_url is not None:
        return
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        fail(f"cannot create home {settings.home}: a file is in the way", EXIT_USAGE)
    except OSError as exc:
        fail(f"cannot create home {settings.home}: {exc.strerror or exc}", EXIT_USAGE)


@contextmanager
def open_catalog(
    settings: Settings, *, upgrade: bool = False, journal: bool = True, pool_size: int = 5
) -> Iterator[Any]:
    """The configured catalog, with errors turned into one line (exit 2 for configuration).

    With `journal` (the default) every committed ref, pin, quarantine and GC purge
    is journaled to the configured stores (`settings.resolved_stores`, opened on
    the first change; docs/format.md, "Journal records").
    """
    from catalog import Catalog
    from catalog.database import safe_url
    from catalog.errors import CatalogError, CatalogUnavailableError, SchemaVersionError

    url = settings.resolved_catalog_url
    if upgrade:  # only a command that creates makes the home
        create_home(settings)
    try:
        cat = Catalog.open(url, upgrade=upgrade, pool_size=pool_size)
    except SchemaVersionError as exc:
        fail(str(exc), EXIT_USAGE)
    except CatalogUnavailableError as exc:  # a server that is down: not the caller's mistake
        fail(str(exc))
    except CatalogError as exc:
        fail(str(exc), EXIT_USAGE)
    except Exception as exc:  # unreachable server, permissions, ...
        fail(
            f"cannot open catalog {safe_url(url)}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}"
        )
    store_journal = None
    if journal:
        from restore.journal import StoreJournal

        store_journal = StoreJournal.from_urls(settings.resolved_stores)
        cat.add_change_listener(store_journal)
    try:
        yield cat
    finally:
        cat.close()
        if store_journal is not None:
            store_journal.close()


def open_stores(settings: Settings) -> list[Any]:
    from chunkstore import open_store
    from chunkstore.errors import StoreURLError

    out = []
    for url in settings.resolved_stores:
        try:
            out.append(open_store(url))
        except StoreURLError as exc:
            fail(str(exc), EXIT_USAGE)
    return out


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        stream=sys.stderr,
        format="kvc: %(levelname)s %(name)s: %(message)s",
    )


class ProgressBars:
    """A `maintenance.progress.Progress` drawing one tqdm bar per stage on stderr.

    stdout stays clean for --json; a bar is noise when stderr is a file or pipe.
    """

    def __init__(self, as_json: bool, unit: str = "blob") -> None:
        self.unit = unit
        self.disable = as_json or not sys.stderr.isatty()
        self.stage: str | None = None
        self.bar: tqdm[Any] | None = None

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if self.bar is None or stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(
                total=total,
                desc=stage,
                unit=self.unit,
                file=sys.stderr,
                disable=self.disable,
                leave=False,
            )
        if total is not None:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> ProgressBars:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
