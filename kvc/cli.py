"""The `kvc` command line: a click group; each subcommand group lives in kvc/commands/."""

from __future__ import annotations

import errno
import importlib

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


@click.group(
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
    Exit codes: 0 ok, 1 problems found or the command failed, 2 usage error."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"kvc.commands.{_name}").register(cli)


# A path the user gave that cannot be used: a configuration error (exit 2), not a failure.
_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST}
)


def main() -> None:
    """`kvc`: errors nobody can fix by reading a traceback are one `kvc: error:` line."""
    from catalog.errors import CatalogError
    from chunkstore.errors import ChunkStoreError, StoreURLError

    try:
        cli(prog_name="kvc")
    except (ChunkStoreError, CatalogError) as exc:  # before OSError: some are ConnectionErrors
        fail(str(exc), EXIT_USAGE if isinstance(exc, StoreURLError) else EXIT_PROBLEMS)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        fail(
            f"{where}{exc.strerror or exc}",
            EXIT_USAGE if exc.errno in _PATH_ERRNOS else EXIT_PROBLEMS,
        )
