"""`kvc fsck` and `kvc gc`: thin wrappers over maintenance.fsck and maintenance.collect that format their reports."""

from __future__ import annotations

import os
import socket
import sys
from datetime import UTC, datetime
from typing import Any

import click

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    ProgressBars,
    emit,
    fail,
    open_catalog,
    open_stores,
    settings_options,
)
from kvc.commands.format import human_bytes, reporting
from kvc.settings import Settings


def _subset(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        n_s, t_s = text.split("/")
        n, t = int(n_s), int(t_s)
    except ValueError:
        fail(f"malformed --subset {text!r}: expected n/t, e.g. 1/4", EXIT_USAGE)
    if not 1 <= n <= t:
        fail(f"malformed --subset {text!r}: need 1 <= n <= t", EXIT_USAGE)
    return n, t


# -- fsck -------------------------------------------------------------------------------


@click.command(
    "fsck",
    epilog="Example: kvc fsck --read-data --subset 1/7   (a seventh of the blobs each night)",
)
@settings_options
@click.option(
    "--read-data",
    is_flag=True,
    help="Download every blob and verify its digest and record (slow; default: existence and size).",
)
@click.option(
    "--subset",
    "subset_text",
    metavar="n/t",
    default=None,
    help="Check only part n of t (by blob key), to spread the work over runs.",
)
@click.option(
    "--repair/--no-repair",
    default=True,
    show_default=True,
    help="Copy a verified good replica over each missing or corrupt one.",
)
def fsck(
    settings: Settings, as_json: bool, read_data: bool, subset_text: str | None, repair: bool
) -> None:
    """Check every catalogued replica in the configured stores.

    Each replica must exist with its receipt's size; with --read-data its bytes
    must hash to its key and decode as a valid record. Broken replicas are
    marked `missing` or `corrupt` in the catalog (restores then skip them); a
    replica marked broken that checks out again is marked `durable`. Replicas
    at locations that are not configured stores (other stores, workers) are
    reported as not checked. A missing or corrupt replica is repaired from
    another replica of the same blob in a configured store, once that copy
    verifies (disable with --no-repair). Exit 1 when problems were found
    (repaired or not), 0 when clean."""
    from maintenance.fsck import fsck as check

    subset = _subset(subset_text)
    stores = open_stores(settings)
    try:
        with open_catalog(settings) as cat, reporting(), ProgressBars(as_json) as bars:
            report = check(
                cat,
                stores,
                read_data=read_data,
                subset=subset,
                repair=repair,
                progress=bars,
                actor="kvc fsck",
            )
    finally:
        for s in stores:
            s.close()
    doc = report.to_dict()
    doc["subset"] = subset_text
    skipped = report.skipped_after_error
    lines = [f"missing  {m.blob_key} at {m.location}" for m in report.missing]
    lines += [f"corrupt  {c.blob_key} at {c.location}: {c.reason}" for c in report.corrupt]
    lines += [f"unreachable {u.location}: {u.reason}" for u in report.unreachable]
    lines += [f"revived  {r.blob_key} at {r.location} (was {r.was})" for r in report.revived]
    lines += [f"repaired {r.blob_key} at {r.location} from {r.source}" for r in report.repaired]
    # Without --read-data "ok" is only "present with the recorded size": say so on the line
    # that is read, since rotted bytes of the same size pass.
    ok = (
        f"{report.ok} ok"
        if read_data
        else f"{report.ok} present (contents not read: use --read-data to verify)"
    )
    lines.append(
        f"checked {report.checked} replica(s) in {len(report.stores)} store(s)"
        f"{' reading data' if read_data else ''}: {ok}, {len(report.missing)} missing, "
        f"{len(report.corrupt)} corrupt" + (f", {skipped} skipped after errors" if skipped else "")
    )
    for loc, n in report.not_checked.items():
        lines.append(f"not checked: {n} replica(s) at {loc} (not a configured store)")
    emit(as_json, doc, "\n".join(lines))
    if not report.clean:
        sys.exit(EXIT_PROBLEMS)


# -- gc ----------------------------------------------------------------------------------


@click.command(
    "gc",
    epilog="Example: kvc gc --dry-run --max-age 604800   (then without --dry-run)",
)
@settings_options
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    metavar="SECONDS",
    help="Only blobs not modified for this long are orphans (a publish in flight is younger); "
    "keep it above the stores' refresh_after_s (900 s by default).",
)
@click.option(
    "--max-age",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Purge leaf chunks of the namespace not used for this long (roots are kept).",
)
@click.option(
    "--max-bytes",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Purge the least used leaf chunks while the namespace stores more than N bytes.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Run even though the catalog records missing replicas in a configured store.",
)
def gc(
    settings: Settings,
    as_json: bool,
    grace: float,
    max_age: float | None,
    max_bytes: int | None,
    dry_run: bool,
    force: bool,
) -> None:
    """Purge unneeded chunks of the namespace, then delete orphan blobs.

    Catalog side: chunks under a quarantined prefix, and with --max-age/--max-bytes
    the least valuable leaf chunks, are purged (bytes, replicas and rows). Refs,
    live pins (`kvc pins`) and live demand are roots: they and their ancestors are
    never purged, and a chunk with kept descendants goes only with its whole subtree.
    A chunk extended, re-published or rooted after planning is spared. A run that was
    interrupted is finished first (chunks it left `purging`, replicas `deleting`).

    Store side: a blob is an orphan when no replica row names it at that store and
    it has not been modified for --grace seconds (a crashed publish leaves such bytes;
    a publish that reuses a blob refreshes its time, so GC never deletes what a
    concurrent publish relies on).

    One GC runs at a time (a lock in the catalog; a crashed run's lock expires).
    Refuses to run while the catalog records `missing` replicas in a configured
    store (see `kvc fsck`) unless --force."""
    from maintenance.collect import run_gc
    from maintenance.errors import MissingReplicasError

    stores = open_stores(settings)
    now = datetime.now(UTC)
    holder = f"kvc gc {socket.gethostname()}:{os.getpid()}"
    try:
        with open_catalog(settings) as cat, reporting(), ProgressBars(as_json) as bars:
            try:
                report = run_gc(
                    cat,
                    stores,
                    settings.namespace,
                    grace_s=grace,
                    max_age_s=max_age,
                    max_bytes=max_bytes,
                    dry_run=dry_run,
                    force=force,
                    holder=holder,
                    now=now,
                    progress=bars,
                    actor="kvc gc",
                )
            except MissingReplicasError as exc:
                fail(
                    f"the catalog records {exc.missing} missing replica(s) in the configured "
                    "stores; check with `kvc fsck` (or run with --force)",
                    EXIT_PROBLEMS,
                )
    finally:
        for store in stores:
            store.close()
    for error in report.sweep.errors:
        click.echo(f"kvc: warning: {error}", err=True)
    emit(as_json, report.to_dict(), "\n".join(_gc_lines(report, settings.namespace)))
    if report.sweep.errors:
        sys.exit(EXIT_PROBLEMS)


def _gc_lines(report: Any, namespace: str) -> list[str]:
    lines: list[str] = []
    res = report.retention.resumed
    if res is not None:
        if res.resumed:
            lines.append(
                f"finished an earlier run: {res.chunks_removed} chunk(s) purged, "
                f"{len(res.blobs_deleted)} blob(s) deleted"
            )
        lines += [f"kept blob {k} at {loc}: {why}" for loc, k, why in res.blobs_kept]
    plan = report.retention.plan
    if plan is not None:
        verb = "would purge" if report.dry_run else "purged"
        lines += [
            f"{verb} chunk prefix {i.prefix_hash.hex()[:16]} blob {i.blob_key[:16]} ({i.reason})"
            for i in plan.items
        ]
        lines += [
            f"kept quarantined prefix {h.hex()[:16]}: a ref or demand needs it"
            for h in plan.kept_quarantined
        ]
        result = report.retention.result
        if result is not None:
            lines += [f"kept blob {k} at {loc}: {why}" for loc, k, why in result.blobs_kept]
        lines.append(
            f"{verb} {len(plan.items)} chunk(s) of namespace {namespace}, "
            f"{human_bytes(plan.purged_bytes)}; {human_bytes(plan.bytes_after)} remain"
        )
    sweep = report.sweep
    verb = "would delete" if report.dry_run else "deleted"
    lines += [f"{verb} orphan blob {o.blob_key} at {o.store} ({o.age_s} s old)" for o in sweep.deleted]
    lines.append(
        f"{verb} {len(sweep.deleted)} orphan blob(s), {human_bytes(sweep.deleted_bytes)}; "
        f"kept {sweep.kept_catalogued} catalogued, {sweep.kept_young} younger than "
        f"{report.grace_s:g} s"
    )
    return lines


def register(cli: click.Group) -> None:
    cli.add_command(fsck)
    cli.add_command(gc)
