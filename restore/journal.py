"""The journal: refs, pins, quarantines and GC purges written to the stores as documents.

`StoreJournal` is a catalog change listener (`catalog.changes`) that writes
one immutable document per committed change to every store it was given;
`attach_journal(catalog, stores)` subscribes one. This module owns the record
format (`encode_change`, `record_stem`, `body_digest`); reading the records
back (`maintenance.journal.read_journal`, `resync_journal`) checks against it.
The format, the naming that keeps concurrent writers apart, and the clock
assumption are in docs/format.md ("Journal records").
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
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
from restore.errors import JournalWriteError

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
KINDS = frozenset(_KIND_DIR)


# -- encoding ----------------------------------------------------------------------------


def canonical(body: dict[str, Any]) -> bytes:
    """A record body's bytes: the JSON its digest is taken over and that is stored."""
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def body_digest(body: dict[str, Any]) -> str:
    """The digest a record carries in its `blake3` field: of its canonical body without it."""
    return blake3.blake3(canonical(body)).hexdigest()


def name_key(text: str) -> str:
    """A ref's or pin's name as it appears in its records' document names."""
    return blake3.blake3(text.encode("utf-8")).hexdigest()


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _body(change: Change) -> tuple[str, dict[str, Any]]:
    """(the record's key within its namespace, its body without the digest)."""
    if isinstance(change, RefSet):
        r = change.ref
        return name_key(r.name), {
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
        return name_key(p.name), {
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
        return name_key(change.name), {
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


def record_stem(kind: str, namespace: str, key: str, at: datetime) -> str:
    """The start of the name of every record of `kind` for `key` in `namespace` made `at`.

    `journal/<kind dir>/<namespace hash>/<key>/<time>`; a record's name adds a
    random part and `.json`, so concurrent writers never collide.
    """
    return (
        f"{JOURNAL_PREFIX}{_KIND_DIR[kind]}/{name_key(namespace)}/{key}/"
        f"{at.astimezone(UTC).strftime(_TIME_FORMAT)}"
    )


def encode_change(change: Change) -> tuple[str, bytes]:
    """The document name and bytes of the record of `change` (a fresh name on every call)."""
    key, body = _body(change)
    body["v"] = VERSION
    body["blake3"] = body_digest(body)
    stem = record_stem(body["kind"], body["namespace"], key, change.at)
    return f"{stem}-{uuid.uuid4().hex}.json", canonical(body)


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


__all__ = [
    "JOURNAL_PREFIX",
    "KINDS",
    "VERSION",
    "StoreJournal",
    "attach_journal",
    "body_digest",
    "canonical",
    "encode_change",
    "ensure_journal",
    "name_key",
    "record_stem",
]
