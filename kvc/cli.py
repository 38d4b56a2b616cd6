"""The `kvc` command line: a click group; each subcommand group lives in kvc/commands/."""

from __future__ import annotations

import errno
import importlib
from typing import Any

import click

from kvc import __version__
from kvc.commands.common import EXIT_PROBLEMS, EXIT_USAGE, fail

# Subcommand modules, each with `register(cli)`.
COMMAND_MODULES = (
    "db",
    "demo",
    "inspect",
    "pins",
    "maintenance",
    "rebuild",
    "backup",
    "serve",
    "daemon",
)


# A path the user gave that cannot be used: a configuration error (exit 2), not a failure.
_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST}
)


def _path_error(exc: BaseException | None) -> OSError | None:
    """The OSError about a path that cannot be used that `exc` is or was raised from, if any."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
            return exc
        exc = exc.__cause__
    return None


def report_error(exc: Exception) -> None:
    """Turn an error no command handled into one `kvc: error:` line and an exit code (a
    `SystemExit`); return only for an error that is not kvc's to describe (re-raise it)."""
    from catalog.admin import DATABASE_ERRORS, database_error_detail
    from catalog.errors import CatalogError, CatalogInputError, SchemaVersionError
    from chunkstore.errors import ChunkStoreError, StoreURLError

    if isinstance(exc, (ChunkStoreError, CatalogError)):  # before OSError: some are OSErrors
        usage = isinstance(exc, (StoreURLError, CatalogInputError, SchemaVersionError))
        fail(str(exc), EXIT_USAGE if usage or _path_error(exc) else EXIT_PROBLEMS)
    if isinstance(exc, DATABASE_ERRORS):
        fail(f"catalog error: {database_error_detail(exc)}", EXIT_PROBLEMS)
    if isinstance(exc, OSError) and exc.errno != errno.EPIPE:  # click handles a closed pipe
        where = f"{exc.filename}: " if exc.filename is not None else ""
        fail(
            f"{where}{exc.strerror or exc}",
            EXIT_USAGE if exc.errno in _PATH_ERRNOS else EXIT_PROBLEMS,
        )


class KvcGroup(click.Group):
    """The top-level group: whatever entry point runs it (the console script, `python -m
    kvc.cli`, click's test runner), an expected failure is one line, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if isinstance(exc, click.exceptions.ClickException | click.exceptions.Exit):
                raise
            report_error(exc)
            raise


@click.group(
    cls=KvcGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Example: kvc demo   (then: kvc log demo/chat-0 --namespace demo)",
)
@click.version_option(__version__, "-V", "--version", prog_name="kvc")
def cli() -> None:
    """kvc keeps the attention state (KV cache) of language-model prompts as durable,
    verified, forkable chunks in an object store or a local directory, catalogued in
    SQLite or PostgreSQL, so any worker can restore the longest stored prefix of a new
    prompt instead of recomputing it.

    Configuration: flags, then KVC_* environment variables, then ./kvc.toml (or
    KVC_CONFIG), then defaults: a SQLite catalog and a local store in ./.kvc.
    Exit codes: 0 ok, 1 problems found or the command failed, 2 usage or
    configuration error (see docs/cli.md)."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"kvc.commands.{_name}").register(cli)


def main() -> None:
    """`kvc`: errors nobody can fix by reading a traceback are one `kvc: error:` line
    (`KvcGroup.invoke`)."""
    cli(prog_name="kvc")


if __name__ == "__main__":
    main()
