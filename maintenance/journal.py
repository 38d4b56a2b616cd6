"""Reading the journal back: the stores' records of refs, pins, quarantines and GC purges, merged.

`read_journal(stores)` merges the journals of any number of stores into the
latest value of every ref and pin, every quarantine and every purged blob, so
that a rebuilt catalog gets its names back and does not resurrect what an
operator or GC removed; `resync_journal` makes a journal agree with its
catalog again after write failures. The records are written by
`restore.journal` (which owns their format, docs/format.md "Journal records").

A record is trusted only whole: a document that does not parse, whose digest
does not match its body, or whose name does not match its content is skipped
and reported (`JournalState.skipped`), and the next older record of the same
name is used instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from catalog.catalog import Catalog
from catalog.changes import PinRemoved, PinSet, RefDeleted, RefSet
from chunkstore import ChunkStore
from chunkstore.errors import BlobNotFoundError
from maintenance.progress import Progress
from restore.journal import (
    JOURNAL_PREFIX,
    KINDS,
    VERSION,
    StoreJournal,
    body_digest,
    name_key,
    record_stem,
)

log = logging.getLogger(__name__)


# -- what reading gives ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RefRecord:
    """The latest journaled value of a ref. When `deleted`, only the names and `at` mean anything
    (`fingerprint` is "", `head_hash` b"")."""

    namespace: str
    name: str
    fingerprint: str  # hex
    head_hash: bytes
    pending_token: int | None
    forked_from: str | None
    at: datetime
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class PinRecord:
    """The latest journaled value of a pin. When `deleted`, only the names and `at` mean anything."""

    namespace: str
    name: str
    prefix_hash: bytes
    reason: str | None
    created_by: str | None
    expires_at: datetime | None
    at: datetime
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    namespace: str
    prefix_hash: bytes
    reason: str
    at: datetime


@dataclass(frozen=True, slots=True)
class PurgeRecord:
    """GC dropped this chunk's row at `at`; its blob's bytes were deleted or are being deleted."""

    namespace: str
    fingerprint: str  # hex
    prefix_hash: bytes
    shard: tuple[int, int, int, int]  # layer_lo, layer_hi, head_lo, head_hi
    blob_key: str
    at: datetime


@dataclass(frozen=True, slots=True)
class JournalState:
    """What the journals of some stores say, merged: the latest record of every name.

    `refs` and `pins` are keyed by (namespace, name) and include deletions
    (`deleted=True`: do not recreate it). `purged_blobs` are the blob keys of
    `purged`. `skipped` names the documents that were read and not trusted
    (torn, altered, misnamed, of an unknown version).
    """

    refs: dict[tuple[str, str], RefRecord] = field(default_factory=dict)
    pins: dict[tuple[str, str], PinRecord] = field(default_factory=dict)
    quarantines: list[QuarantineRecord] = field(default_factory=list)
    purged_blobs: set[str] = field(default_factory=set)
    purged: list[PurgeRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    records: int = 0  # documents listed (over all stores, each name once)


def resync_journal(
    catalog: Catalog, stores: Sequence[ChunkStore], namespaces: Iterable[str] = ()
) -> int:
    """Make the journal in `stores` agree with the catalog's refs and pins; return records written.

    What an operator runs after journal failures (`Catalog.journal_failures`, the
    `change listener failed` log line): for `namespaces` and every namespace the
    journal already names, each ref or pin whose latest record differs from the
    catalog gets a record of its current value (at its own `updated_at` /
    `created_at`), and each name the journal holds that the catalog no longer has
    gets a removal (at now). Quarantines and purges cannot be recovered this way.
    Raises `JournalWriteError` when a record did not land in every store.
    """
    from catalog.clock import utcnow

    state = read_journal(stores)
    journal = StoreJournal(stores)
    wanted = sorted({*namespaces, *(ns for ns, _ in state.refs), *(ns for ns, _ in state.pins)})
    written = 0
    for ns in wanted:
        refs = {r.name: r for r in catalog.list_refs(ns)}
        pins = {p.name: p for p in catalog.list_pins(ns)}
        for name, ref in refs.items():
            rec = state.refs.get((ns, name))
            if (
                rec is None
                or rec.deleted
                or (
                    rec.head_hash,
                    rec.fingerprint,
                    rec.pending_token,
                    rec.forked_from,
                )
                != (ref.head_hash, ref.fingerprint, ref.pending_token, ref.forked_from)
            ):
                journal(RefSet(ref))
                written += 1
        for name, pin in pins.items():
            prec = state.pins.get((ns, name))
            if (
                prec is None
                or prec.deleted
                or (
                    prec.prefix_hash,
                    prec.expires_at,
                    prec.reason,
                )
                != (pin.prefix_hash, pin.expires_at, pin.reason)
            ):
                journal(PinSet(pin))
                written += 1
        now = utcnow()
        for (rns, name), rec in state.refs.items():
            if rns == ns and not rec.deleted and name not in refs:
                journal(RefDeleted(ns, name, now))
                written += 1
        for (pns, name), prec in state.pins.items():
            if pns == ns and not prec.deleted and name not in pins:
                journal(PinRemoved(ns, name, now))
                written += 1
    return written


# -- reading -----------------------------------------------------------------------------


class _Untrusted(ValueError):
    """A document that is not a whole, valid journal record (never raised out of this module)."""


def _str(doc: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    v = doc.get(key)
    if v is None and optional and key in doc:
        return None
    if not isinstance(v, str) or not v:
        raise _Untrusted(f"{key} is not a string")
    return v


def _hex(doc: dict[str, Any], key: str) -> bytes:
    v = _str(doc, key)
    if len(v) != 64:
        raise _Untrusted(f"{key} is not 64 hex digits")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise _Untrusted(f"{key} is not hex") from None


def _time(doc: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    v = _str(doc, key, optional=optional)
    if v is None:
        return None
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise _Untrusted(f"{key} is not an ISO time") from None
    if t.tzinfo is None:
        raise _Untrusted(f"{key} has no time zone")
    return t.astimezone(UTC)


def _decode(name: str, data: bytes) -> tuple[str, Any]:
    """(kind, record) of a document, or `_Untrusted`."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Untrusted("not JSON") from None
    if not isinstance(doc, dict):
        raise _Untrusted("not an object")
    digest = doc.pop("blake3", None)
    if not isinstance(digest, str) or body_digest(doc) != digest:
        raise _Untrusted("digest mismatch")
    if doc.get("v") != VERSION:
        raise _Untrusted("unknown version")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise _Untrusted("unknown kind")
    ns, at = _str(doc, "namespace"), _time(doc, "at")
    if kind in ("ref.set", "ref.delete", "pin.set", "pin.remove"):
        key = name_key(_str(doc, "name"))
    elif kind == "quarantine":
        key = _str(doc, "prefix")
    else:
        key = _str(doc, "blob_key")
    expected = f"{record_stem(kind, ns, key, at)}-"
    if not name.startswith(expected):
        raise _Untrusted("the name does not match the content")
    record: Any
    if kind == "ref.set":
        pending = doc.get("pending_token")
        if pending is not None and (isinstance(pending, bool) or not isinstance(pending, int)):
            raise _Untrusted("pending_token is not an int")
        fp = _str(doc, "fingerprint")
        if len(fp) != 64:
            raise _Untrusted("fingerprint is not 64 hex digits")
        record = RefRecord(
            ns,
            doc["name"],
            fp,
            _hex(doc, "head"),
            pending,
            _str(doc, "forked_from", optional=True),
            at,
        )
    elif kind == "ref.delete":
        record = RefRecord(ns, doc["name"], "", b"", None, None, at, deleted=True)
    elif kind == "pin.set":
        record = PinRecord(
            ns,
            doc["name"],
            _hex(doc, "prefix"),
            _str(doc, "reason", optional=True),
            _str(doc, "created_by", optional=True),
            _time(doc, "expires_at", optional=True),
            at,
        )
    elif kind == "pin.remove":
        record = PinRecord(ns, doc["name"], b"", None, None, None, at, deleted=True)
    elif kind == "quarantine":
        record = QuarantineRecord(ns, _hex(doc, "prefix"), _str(doc, "reason"), at)
    else:
        shard = doc.get("shard")
        if (
            not isinstance(shard, list)
            or len(shard) != 4
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
        ):
            raise _Untrusted("shard is not four ints")
        _hex(doc, "blob_key")
        record = PurgeRecord(
            ns, _str(doc, "fingerprint"), _hex(doc, "prefix"), tuple(shard), doc["blob_key"], at
        )
    return kind, record


def _group(name: str) -> str:
    """The record's group: `journal/<kind>/<namespace>/<key>` (the latest record of each counts)."""
    return name.rsplit("/", 1)[0]


def read_journal(stores: Iterable[ChunkStore], *, progress: Progress | None = None) -> JournalState:
    """The latest journaled state over `stores` (a record in several stores counts once).

    For each group (one ref, pin, quarantined prefix or purged blob) the
    records are tried newest first (by name, which starts with the record's
    time; ties by the rest of the name) until one is whole and valid, in any
    of the stores holding it; the ones tried and not trusted are in `skipped`.
    Store errors other than a vanished document (`StoreUnavailableError`)
    propagate: a partly read journal must not pass for a whole one.
    """
    holders: dict[str, list[ChunkStore]] = {}
    for store in stores:
        for name in store.documents(JOURNAL_PREFIX):
            holders.setdefault(name, []).append(store)
    groups: dict[str, list[str]] = {}
    for name in holders:
        groups.setdefault(_group(name), []).append(name)
    state = JournalState(records=len(holders))
    done = 0
    for group in sorted(groups):
        for name in sorted(groups[group], reverse=True):
            found = None
            for store in holders[name]:
                try:
                    found = _decode(name, store.get_document(name))
                    break
                except (_Untrusted, BlobNotFoundError) as exc:
                    log.warning("journal: skipping %s in %s: %s", name, store.name, exc)
            if found is None:
                state.skipped.append(name)
                continue
            _apply(state, *found)
            break
        done += 1
        if progress is not None:
            progress("journal", done, len(groups))
    return state


def _apply(state: JournalState, kind: str, record: Any) -> None:
    if kind in ("ref.set", "ref.delete"):
        state.refs[(record.namespace, record.name)] = record
    elif kind in ("pin.set", "pin.remove"):
        state.pins[(record.namespace, record.name)] = record
    elif kind == "quarantine":
        state.quarantines.append(record)
    else:
        state.purged.append(record)
        state.purged_blobs.add(record.blob_key)


__all__ = [
    "JournalState",
    "PinRecord",
    "PurgeRecord",
    "QuarantineRecord",
    "RefRecord",
    "read_journal",
    "resync_journal",
]
