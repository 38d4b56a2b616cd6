"""`kvc pins`: named holds that keep a prefix and its lineage from GC, optionally until they expire."""

from __future__ import annotations

from typing import Any

import click

from kvc.commands.common import EXIT_USAGE, emit, fail, open_catalog, settings_options
from kvc.commands.format import reporting, resolve_prefix, short, when
from kvc.settings import Settings


def _doc(p: Any) -> dict[str, Any]:
    return {
        "name": p.name,
        "prefix": p.prefix_hash.hex(),
        "reason": p.reason,
        "created_by": p.created_by,
        "created_at": p.created_at.isoformat(),
        "expires_at": None if p.expires_at is None else p.expires_at.isoformat(),
        "live": p.live,
    }


def _line(p: Any) -> str:
    until = "never expires" if p.expires_at is None else f"expires {when(p.expires_at)}"
    state = "" if p.live else "  (expired: no longer protects)"
    reason = f"  {p.reason}" if p.reason else ""
    return f"{p.name}  {short(p.prefix_hash)}  {until}{state}{reason}"


@click.group("pins")
def pins() -> None:
    """Pins: named holds on a prefix. A live pin is a GC root, like a ref: the pinned
    prefix and all its ancestors are never purged by retention. Unlike a ref a pin
    does not move as a conversation grows, and it can expire by itself (--ttl)."""


@pins.command(
    "set", epilog='Example: kvc pins set system-v3 3f2a9c1b --ttl 86400 --reason "launch week"'
)
@settings_options
@click.argument("name")
@click.argument("prefix")
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Expire after this long (default: never; remove it with `kvc pins rm`).",
)
@click.option("--reason", default=None, help="Why (shown in `kvc pins list` and the history).")
def pins_set(
    settings: Settings, as_json: bool, name: str, prefix: str, ttl: float | None, reason: str | None
) -> None:
    """Pin PREFIX (a prefix hash, or a unique hex prefix of 8+ characters) as NAME.

    Setting an existing pin moves it to PREFIX and restarts its expiry. Exit 1 if the
    prefix is not catalogued in the namespace or is being purged."""
    if reason is not None and not reason.strip():
        fail("--reason must not be empty", EXIT_USAGE)
    with open_catalog(settings) as cat, reporting():
        h = resolve_prefix(cat, settings.namespace, prefix)
        p = cat.pin(settings.namespace, name, h, ttl_s=ttl, reason=reason, actor="kvc pins set")
    emit(as_json, _doc(p), f"pinned {short(h)} as {name!r}: " + _line(p).split("  ", 2)[-1])


@pins.command("list", epilog="Example: kvc pins list --json")
@settings_options
@click.option("--live", "live_only", is_flag=True, help="Only pins that have not expired.")
def pins_list(settings: Settings, as_json: bool, live_only: bool) -> None:
    """List the namespace's pins: name, prefix, expiry, reason."""
    with open_catalog(settings) as cat, reporting():
        found = cat.list_pins(settings.namespace, include_expired=not live_only)
    emit(
        as_json,
        {"namespace": settings.namespace, "pins": [_doc(p) for p in found]},
        "\n".join(_line(p) for p in found) or f"no pins in namespace {settings.namespace!r}",
    )


@pins.command("rm", epilog="Example: kvc pins rm system-v3")
@settings_options
@click.argument("name")
def pins_rm(settings: Settings, as_json: bool, name: str) -> None:
    """Remove a pin (the prefix stays until retention GC purges it). Exit 1 if unknown."""
    with open_catalog(settings) as cat, reporting():
        cat.unpin(settings.namespace, name, actor="kvc pins rm")
    emit(
        as_json,
        {"namespace": settings.namespace, "removed": name},
        f"removed pin {name!r} in namespace {settings.namespace!r}",
    )


def register(cli: click.Group) -> None:
    cli.add_command(pins)
