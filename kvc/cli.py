"""The `kvc` command line: a click group; each subcommand group lives in kvc/commands/."""

from __future__ import annotations

import importlib

import click

from kvc import __version__

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


def main() -> None:
    cli(prog_name="kvc")
