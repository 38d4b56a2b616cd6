"""`kvc rebuild --from STORE_URL [--from ...]`: recreate a lost catalog from the stores alone."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from catalog.base import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    ProgressBars,
    emit,
    fail,
    open_catalog,
    settings_options,
)
from kvc.settings import Settings

_EPILOG = """\b
Examples:
  kvc rebuild --from file:///var/lib/kvc/blobs --from s3://kv/prod?region=eu-west-1 \\
      --catalog sqlite:///new.db
  kvc rebuild --from s3://kv/prod --dry-run --json

\b
Stores hold the descriptor of every fingerprint their blobs name, so nothing
else is needed. Blobs written before stores kept descriptors need a
--fingerprint-file: JSON fingerprint descriptors (bare, or {"descriptor": ...}),
one per line or one JSON list. Fingerprints the target catalog already knows
need not be given; chunks of any other fingerprint are skipped and listed.

Refs, pins and quarantine marks come from the stores' journal (a ref or pin
the catalog already has is kept and reported if the journal disagrees); blobs
GC purged stay purged. Demands, access statistics and the event history are
not recovered. Exit 0 when everything was catalogued (or already was), 1 when
something was skipped or disagreed (corrupt copy, unknown fingerprint, orphan,
invalid, conflict, refused descriptor or journal record, unresolved ref), 2 for usage errors. --no-verify reads
headers only (faster; the payload is not checked, and a replica previously
marked corrupt becomes durable again)."""


def _load_fingerprints(path: str | None) -> dict[str, Any]:
    from catalog import Fingerprint
    from catalog.errors import IdentityError

    if path is None:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read --fingerprint-file {path}: {exc.strerror or exc}", EXIT_USAGE)
    try:
        stripped = text.strip()
        if stripped.startswith("["):
            items = json.loads(stripped)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        fail(
            f"--fingerprint-file {path} is not JSON (a list or one object per line): {exc}",
            EXIT_USAGE,
        )
    out: dict[str, Any] = {}
    for i, item in enumerate(items, 1):
        # Accept a bare descriptor or an object wrapping one (e.g. {"hex": ..., "descriptor": ...}).
        desc = item.get("descriptor", item) if isinstance(item, dict) else item
        try:
            fp = Fingerprint.from_descriptor(desc)
        except IdentityError as exc:
            fail(f"--fingerprint-file {path}, entry {i}: {exc}", EXIT_USAGE)
        if isinstance(item, dict) and "hex" in item and item["hex"] != fp.hex:
            fail(
                f"--fingerprint-file {path}, entry {i}: descriptor hashes to {fp.hex}, not {item['hex']}",
                EXIT_USAGE,
            )
        out[fp.hex] = fp
    return out


@contextmanager
def _dry_run_catalog(settings: Settings) -> Iterator[Any]:
    """The target catalog for a dry run, opened without creating or upgrading anything;
    None when there is no catalog there yet (a dry run then compares against nothing)."""
    from catalog import database
    from catalog.errors import CatalogError

    url = settings.resolved_catalog_url
    try:
        empty = not database.has_schema(url)
    except CatalogError as exc:
        fail(str(exc), EXIT_USAGE)
    except Exception as exc:  # unreachable server, ...
        fail(
            f"cannot open catalog {database.safe_url(url)}: "
            f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"
        )
    if empty:
        yield None
        return
    with open_catalog(settings) as cat:
        yield cat


def _summary(report: Any) -> str:
    would = "would be " if report.dry_run else ""
    copies = ", ".join(f"{n} in {s}" for s, n in report.copies.items())
    lines = [
        *(["dry run: nothing was written"] if report.dry_run else []),
        f"{report.blobs} blobs ({copies}); {report.descriptors} fingerprint descriptors in the stores",
        f"{report.recorded} chunks {would}recorded, {report.already_present} already catalogued, "
        f"{report.replicas_added} replicas {would}added",
        *(f"namespace {ns}: chunk size {cs}" for ns, cs in report.namespaces.items()),
    ]
    if report.namespaces_added:
        lines.append(f"namespaces {would}added: {', '.join(report.namespaces_added)}")
    if report.fingerprints_added:
        lines.append(f"fingerprints {would}added: {', '.join(report.fingerprints_added)}")
    for where, why in report.rejected_descriptors.items():
        lines.append(f"refused descriptor {where}: {why}")
    for store, why in report.unlisted.items():
        lines.append(f"could not list {store}: {why}")
    for key, bad in report.corrupt.items():
        for store, why in bad.items():
            lines.append(f"bad copy of {key} in {store}: {why}")
    if report.lost:
        lines.append(
            f"skipped {len(report.lost)} blobs with no good copy: {', '.join(report.lost)}"
        )
    for hex_, n in report.unknown_fingerprints.items():
        lines.append(
            f"skipped {n} chunks of unknown fingerprint {hex_} "
            "(no descriptor in the stores; pass --fingerprint-file)"
        )
    if report.orphans:
        lines.append(f"skipped {len(report.orphans)} orphan chunks (parent missing)")
    for key, why in report.invalid.items():
        lines.append(f"skipped {key}: {why}")
    for c in report.conflicts:
        lines.append(
            f"conflict at prefix {c.prefix_hash.hex()}: catalog keeps {c.kept}, "
            f"not {c.rejected} (in {', '.join(c.stores)})"
        )
    j = report.journal
    verb = "would add" if report.dry_run else "added"
    lines.append(
        f"journal: {j.records} records; {verb} {len(j.refs_added)} refs, {len(j.pins_added)} "
        f"pins, {len(j.quarantines_added)} quarantines; {len(j.purged)} purged blobs left out"
    )
    lines += [f"skipped untrusted journal record {name}" for name in j.untrusted]
    lines += [f"kept the catalog's {what} (the journal disagrees)" for what in j.disagreements]
    lines += [
        f"not recreated: {what} (its prefix or fingerprint is not catalogued)"
        for what in j.unresolved
    ]
    lines.append(f"not recovered: {report.not_recovered}")
    return "\n".join(lines)


@click.command("rebuild", epilog=_EPILOG)
@settings_options
@click.option(
    "--from",
    "from_urls",
    required=True,
    multiple=True,
    metavar="STORE_URL",
    help="Store whose blobs to read (repeat for several; their contents are merged).",
)
@click.option(
    "--fingerprint-file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="JSON fingerprint descriptors for blobs whose store holds none (older stores).",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
    default=None,
    help="Chunk size of a new namespace when the stores hold no parent/child pair to infer it from.",
)
@click.option("--no-verify", is_flag=True, help="Parse headers only; do not check blob digests.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Read and verify everything, report what would be added, write nothing.",
)
def rebuild_cmd(
    settings: Settings,
    as_json: bool,
    from_urls: tuple[str, ...],
    fingerprint_file: str | None,
    chunk_size: int | None,
    no_verify: bool,
    dry_run: bool,
) -> None:
    """Recreate the catalog's namespaces, fingerprints, chunks and replicas from the stores.

    The target catalog (--catalog) gets its schema created if it is empty
    (not with --dry-run). Safe to run again: each run only adds what is
    missing, and reports chunks the catalog holds with other bytes as
    conflicts without overwriting them."""
    from catalog.database import safe_url
    from chunkstore import open_store
    from chunkstore.errors import StoreURLError
    from maintenance.rebuild import rebuild

    if len(set(from_urls)) != len(from_urls):
        fail("a --from store is given twice", EXIT_USAGE)
    fingerprints = _load_fingerprints(fingerprint_file)
    stores = []
    try:
        for url in from_urls:
            try:
                stores.append(open_store(url))
            except StoreURLError as exc:
                fail(str(exc), EXIT_USAGE)
        bar = ProgressBars(as_json)
        # No journal: what rebuild recreates is what the journal already says.
        opener = (
            _dry_run_catalog(settings)
            if dry_run
            else open_catalog(settings, upgrade=True, journal=False)
        )
        try:
            with opener as cat:
                report = rebuild(
                    cat,
                    stores,
                    fingerprints=fingerprints,
                    verify=not no_verify,
                    chunk_size=chunk_size,
                    dry_run=dry_run,
                    progress=bar,
                )
        except Exception as exc:  # store unreachable mid-way, database errors, ...
            fail(
                f"rebuild from {', '.join(s.name for s in stores)} failed: "
                f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"
            )
        finally:
            bar.close()
    finally:
        for store in stores:
            store.close()
    doc = {"catalog": safe_url(settings.resolved_catalog_url), **report.to_dict()}
    emit(as_json, doc, _summary(report))
    if not report.complete:
        sys.exit(EXIT_PROBLEMS)


def register(cli: click.Group) -> None:
    cli.add_command(rebuild_cmd)
