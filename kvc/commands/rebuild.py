"""`kvc rebuild --from STORE_URL`: recreate a lost catalog's chunk facts from blob headers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    emit,
    fail,
    open_catalog,
    settings_options,
)
from kvc.settings import Settings

_EPILOG = """\b
Example:
  kvc rebuild --from s3://kv/prod?region=eu-west-1 \\
      --catalog sqlite:///new.db --fingerprint-file fingerprints.jsonl

\b
Fingerprint file: JSON fingerprint descriptors (bare, or {"descriptor": ...}), one
per line or one JSON list. Fingerprints the target catalog already knows need
not be given; chunks of any other fingerprint are skipped and listed.

Refs (named continuations), pins and the event history live only in the
catalog and cannot be rebuilt. Exit 0 when every blob was catalogued, 1 when
some were skipped (corrupt, unknown fingerprint, orphan, invalid), 2 for usage
errors. --no-verify reads headers only (faster; the payload is not checked,
and a replica previously marked corrupt becomes durable again)."""


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


@click.command("rebuild", epilog=_EPILOG)
@settings_options
@click.option(
    "--from", "from_url", required=True, metavar="STORE_URL", help="Store whose blobs to read."
)
@click.option(
    "--fingerprint-file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="JSON fingerprint descriptors for fingerprints the target catalog does not know.",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(1, 65536),
    default=None,
    help="Chunk size of a new namespace when the store holds no parent/child pair to infer it from.",
)
@click.option("--no-verify", is_flag=True, help="Parse headers only; do not check blob digests.")
def rebuild_cmd(
    settings: Settings,
    as_json: bool,
    from_url: str,
    fingerprint_file: str | None,
    chunk_size: int | None,
    no_verify: bool,
) -> None:
    """Recreate the catalog's chunk, prefix and replica facts from the blobs in STORE_URL.

    The target catalog (--catalog) gets its schema created if it is empty.
    Safe to run again and against several stores: each run only adds what is
    missing (a second store adds its replicas)."""
    from catalog.database import safe_url
    from chunkstore import open_store
    from chunkstore.errors import StoreURLError
    from restore.rebuild import rebuild

    fingerprints = _load_fingerprints(fingerprint_file)
    try:
        store = open_store(from_url)
    except StoreURLError as exc:
        fail(str(exc), EXIT_USAGE)
    bar = tqdm(
        desc="rebuild",
        unit="blob",
        file=sys.stderr,
        disable=as_json or not sys.stderr.isatty(),
        leave=False,
    )

    def progress(_stage: str, done: int, total: int | None) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        with open_catalog(settings, upgrade=True) as cat:
            report = rebuild(
                cat,
                store,
                fingerprints=fingerprints,
                verify=not no_verify,
                chunk_size=chunk_size,
                progress=progress,
            )
    except Exception as exc:  # store unreachable mid-way, database errors, ...
        fail(
            f"rebuild from {store.name} failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}"
        )
    finally:
        bar.close()
        store.close()
    doc = {"catalog": safe_url(settings.resolved_catalog_url), **report.to_dict()}
    lines = [
        f"{report.blobs} blobs in {report.store}: {report.recorded} chunks recorded, "
        f"{report.already_present} already catalogued, {report.replicas_added} replicas added",
        *(f"namespace {ns}: chunk size {cs}" for ns, cs in report.namespaces.items()),
    ]
    if report.corrupt:
        lines.append(f"skipped {len(report.corrupt)} corrupt blobs: {', '.join(report.corrupt)}")
    for hex_, n in report.unknown_fingerprints.items():
        lines.append(f"skipped {n} chunks of unknown fingerprint {hex_} (pass --fingerprint-file)")
    if report.orphans:
        lines.append(f"skipped {len(report.orphans)} orphan chunks (parent missing)")
    for key, why in report.invalid.items():
        lines.append(f"skipped {key}: {why}")
    if report.conflicts:
        lines.append(f"{report.conflicts} conflicts (another blob was kept for the same chunk)")
    lines.append(f"note: {report.refs_note}")
    emit(as_json, doc, "\n".join(lines))
    if not report.complete:
        sys.exit(EXIT_PROBLEMS)


def register(cli: click.Group) -> None:
    cli.add_command(rebuild_cmd)
