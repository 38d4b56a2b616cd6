"""The journal: refs, pins, quarantines and GC purges written to the stores as documents, and read back.

Writing: `StoreJournal` is a catalog change listener (`catalog.changes`) that
writes one immutable document per committed change to every store it was
given; `attach_journal(catalog, stores)` subscribes one. Reading:
`read_journal(stores)` merges the journals of any number of stores into the
latest value of every ref and pin, every quarantine and every purged blob, so
that a rebuilt catalog gets its names back and does not resurrect what an
operator or GC removed. The record format, the naming that keeps concurrent
writers apart, and the clock assumption are in docs/format.md ("Journal records").

A record is trusted only whole: a document that does not parse, whose digest
does not match its body, or whose name does not match its content is skipped
and reported (`JournalState.skipped`), and the next older record of the same
name is used instead.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import blake3

from catalog.base import CatalogAPI
from catalog.catalog import Catalog
from catalog.changes import (
    Change,
    ChunkPurged,
    PinRemoved,
    PinSet,
    Quarantined,
    RefDeleted,
    RefSet,
)
from chunkstore import ChunkStore, open_store
from chunkstore.errors import BlobNotFoundError
from restore.errors import JournalWriteError
from restore.progress import Progress

log = logging.getLogger(__name__)

JOURNAL_PREFIX = "journal/"
VERSION = 1
_TIME_FORMAT = "%Y%m%dT%H%M%S.%fZ"
# The directory of each record kind under journal/ (the record's group, see docs/format.md).
_KIND_DIR = {
    "ref.set": "ref",
    "ref.delete": "ref",
    "pin.set": "pin",
    "pin.remove": "pin",
    "quarantine": "quarantine",
    "purge": "purge",
}


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


# -- encoding ----------------------------------------------------------------------------


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _h(text: str) -> str:
    return blake3.blake3(text.encode("utf-8")).hexdigest()


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _body(change: Change) -> tuple[str, dict[str, Any]]:
    """(the record's key within its namespace, its body without the digest)."""
    if isinstance(change, RefSet):
        r = change.ref
        return _h(r.name), {
            "kind": "ref.set",
            "namespace": r.namespace,
            "name": r.name,
            "fingerprint": r.fingerprint,
            "head": r.head_hash.hex(),
            "pending_token": r.pending_token,
            "forked_from": r.forked_from,
            "at": _iso(change.at),
        }
    if isinstance(change, PinSet):
        p = change.pin
        return _h(p.name), {
            "kind": "pin.set",
            "namespace": p.namespace,
            "name": p.name,
            "prefix": p.prefix_hash.hex(),
            "reason": p.reason,
            "created_by": p.created_by,
            "expires_at": None if p.expires_at is None else _iso(p.expires_at),
            "at": _iso(change.at),
        }
    if isinstance(change, (RefDeleted, PinRemoved)):
        kind = "ref.delete" if isinstance(change, RefDeleted) else "pin.remove"
        return _h(change.name), {
            "kind": kind,
            "namespace": change.namespace,
            "name": change.name,
            "at": _iso(change.at),
        }
    if isinstance(change, Quarantined):
        return change.prefix_hash.hex(), {
            "kind": "quarantine",
            "namespace": change.namespace,
            "prefix": change.prefix_hash.hex(),
            "reason": change.reason,
            "at": _iso(change.at),
        }
    if not isinstance(change, ChunkPurged):
        raise TypeError(f"not a journaled change: {type(change).__name__}")
    s = change.shard
    return change.blob_key, {
        "kind": "purge",
        "namespace": change.namespace,
        "fingerprint": change.fingerprint,
        "prefix": change.prefix_hash.hex(),
        "shard": [s.layer_lo, s.layer_hi, s.head_lo, s.head_hi],
        "blob_key": change.blob_key,
        "at": _iso(change.at),
    }


def encode_change(change: Change) -> tuple[str, bytes]:
    """The document name and bytes of the record of `change` (a fresh name on every call)."""
    key, body = _body(change)
    body["v"] = VERSION
    body["blake3"] = blake3.blake3(_canonical(body)).hexdigest()
    at = change.at.astimezone(UTC)
    name = (
        f"{JOURNAL_PREFIX}{_KIND_DIR[body['kind']]}/{_h(body['namespace'])}/{key}/"
        f"{at.strftime(_TIME_FORMAT)}-{uuid.uuid4().hex}.json"
    )
    return name, _canonical(body)


# -- writing -----------------------------------------------------------------------------


class StoreJournal:
    """A change listener writing each committed change as one document to every store.

    Safe for many threads (each record has its own name). A store that refuses
    a record does not stop the others; once all were tried, the call raises
    `JournalWriteError` (the catalog logs and counts it, the change stays
    committed). Use `StoreJournal.from_urls` to open the stores on the first
    change (and close them with the journal).
    """

    def __init__(self, stores: Sequence[ChunkStore]) -> None:
        self._stores: list[ChunkStore] | None = list(stores)
        self._urls: list[str] = []
        self._owned = False
        self._lock = threading.Lock()
        self.written = 0  # documents written (over all stores)
        self.failures = 0  # (record, store) pairs that did not land

    @classmethod
    def from_urls(cls, urls: Sequence[str]) -> StoreJournal:
        """A journal to the stores at these URLs, opened when the first change arrives."""
        journal = cls(())
        journal._stores, journal._urls, journal._owned = None, list(urls), True
        return journal

    @property
    def stores(self) -> list[ChunkStore]:
        with self._lock:
            if self._stores is None:
                opened: list[ChunkStore] = []
                try:
                    for url in self._urls:
                        opened.append(open_store(url))
                except Exception:
                    for s in opened:
                        s.close()
                    raise
                self._stores = opened
            return self._stores

    def __call__(self, change: Change) -> None:
        name, data = encode_change(change)
        failed: list[str] = []
        stores = self.stores
        for store in stores:
            try:
                store.put_document(name, data)
            except Exception as exc:
                failed.append(f"{store.name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            with self._lock:
                self.written += 1
        if failed:
            with self._lock:
                self.failures += len(failed)
            raise JournalWriteError(
                f"journal record {name} did not land in {len(failed)} of {len(stores)} "
                f"store(s): {'; '.join(failed)}"
            )

    def close(self) -> None:
        """Close the stores this journal opened itself (`from_urls`); others are the caller's."""
        with self._lock:
            stores, owned = self._stores, self._owned
            if owned:
                self._stores = None
        if owned and stores:
            for s in stores:
                s.close()


def attach_journal(catalog: Catalog, stores: Sequence[ChunkStore]) -> StoreJournal:
    """Journal every committed ref, pin, quarantine and GC purge of `catalog` to `stores`.

    Returns the listener (detach it with `catalog.remove_change_listener`).
    The stores stay the caller's to close.
    """
    journal = StoreJournal(stores)
    catalog.add_change_listener(journal)
    return journal


def ensure_journal(catalog: CatalogAPI, stores: Sequence[ChunkStore]) -> StoreJournal | None:
    """Journal `catalog`'s committed refs, pins, quarantines and purges to each of `stores`
    that no journal of this catalog covers yet; return the journal attached (None if every
    store was covered already, or for a catalog without change listeners: a `kvc serve`
    service, which journals to its own stores).

    What every writer (`Checkpointer`, `Session`) calls, so a library user never has to."""
    add = getattr(catalog, "add_change_listener", None)
    listeners = getattr(catalog, "change_listeners", None)
    if add is None or listeners is None:
        return None
    covered = {s.name for j in listeners if isinstance(j, StoreJournal) for s in j.stores}
    missing = [s for s in stores if s.name not in covered]
    if not missing:
        return None
    journal = StoreJournal(missing)
    add(journal)
    return journal


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
    if not isinstance(digest, str) or blake3.blake3(_canonical(doc)).hexdigest() != digest:
        raise _Untrusted("digest mismatch")
    if doc.get("v") != VERSION:
        raise _Untrusted("unknown version")
    kind = doc.get("kind")
    if kind not in _KIND_DIR:
        raise _Untrusted("unknown kind")
    ns, at = _str(doc, "namespace"), _time(doc, "at")
    if kind in ("ref.set", "ref.delete", "pin.set", "pin.remove"):
        key = _h(_str(doc, "name"))
    elif kind == "quarantine":
        key = _str(doc, "prefix")
    else:
        key = _str(doc, "blob_key")
    expected = f"{JOURNAL_PREFIX}{_KIND_DIR[kind]}/{_h(ns)}/{key}/{at.strftime(_TIME_FORMAT)}-"
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
    "JOURNAL_PREFIX",
    "JournalState",
    "PinRecord",
    "PurgeRecord",
    "QuarantineRecord",
    "RefRecord",
    "StoreJournal",
    "attach_journal",
    "encode_change",
    "ensure_journal",
    "read_journal",
    "resync_journal",
]
