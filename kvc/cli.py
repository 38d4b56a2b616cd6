"""The `kvc` command line."""

from __future__ import annotations

import click

from kvc import __version__


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Example: kvc --version",
)
@click.version_option(__version__, "-V", "--version", prog_name="kvc")
def cli() -> None:
    """kvc keeps the attention state (KV cache) of language-model prompts as durable,
    verified, forkable chunks in an object store or a local directory, catalogued in
    SQLite or PostgreSQL, so any worker can restore the longest stored prefix of a new
    prompt instead of recomputing it."""


def main() -> None:
    cli(prog_name="kvc")
