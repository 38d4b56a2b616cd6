"""Rebuild, step 4: the stores' journal brought back into a catalog (refs, pins, quarantines, purges).

`maintenance.journal.read_journal` gives the latest record of every ref, pin,
quarantined prefix and GC purge over the stores. Rebuild applies it after the
chunks are recorded, adding only what the catalog lacks:

- a blob GC purged after its newest stored copy was written is not brought
  back (`purged_since_stored`, applied before the chunks are recorded); a copy
  written after the purge (the chunk was published again) is;
- a ref or pin whose latest record is a deletion, or a pin that has expired,
  is not recreated;
- a ref or pin the catalog already has with another value is reported as a
  disagreement and left as it is;
- a ref whose head (or fingerprint), or a pin whose prefix, is not in the
  catalog is reported as unresolved;
- a quarantine is applied once its prefix is catalogued.

With `dry_run` nothing is written: what would be added is counted against the
prefixes the catalog has plus those the rebuild would record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from catalog.catalog import Catalog
from catalog.clock import utcnow
from catalog.errors import CatalogError, NotFoundError
from catalog.models import ReplicaReceipt
from maintenance.journal import JournalState

log = logging.getLogger(__name__)


@dataclass
class JournalOutcome:
    """What applying the journal did (with a dry run: would do)."""

    records: int = 0  # journal documents listed over all stores
    untrusted: list[str] = field(default_factory=list)  # torn or altered records, skipped
    purged: list[str] = field(default_factory=list)  # blob keys not resurrected
    refs_added: list[str] = field(default_factory=list)  # "namespace/name"
    pins_added: list[str] = field(default_factory=list)
    quarantines_added: list[str] = field(default_factory=list)  # "namespace/prefix hex"
    disagreements: list[str] = field(default_factory=list)  # kept the catalog's value
    unresolved: list[str] = field(default_factory=list)  # head/prefix not catalogued

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "untrusted": list(self.untrusted),
            "purged": list(self.purged),
            "refs_added": list(self.refs_added),
            "pins_added": list(self.pins_added),
            "quarantines_added": list(self.quarantines_added),
            "disagreements": list(self.disagreements),
            "unresolved": list(self.unresolved),
        }


def purged_since_stored(
    journal: JournalState, receipts: Mapping[str, Iterable[ReplicaReceipt]]
) -> set[str]:
    """Blob keys whose latest purge is no older than their newest stored copy.

    Keys are content addresses: a chunk published again after a purge has the
    same key, and its fresh copy (a later `stored_at`) must come back.
    """
    last_purge: dict[str, datetime] = {}
    for p in journal.purged:
        if p.blob_key not in last_purge or p.at > last_purge[p.blob_key]:
            last_purge[p.blob_key] = p.at
    out: set[str] = set()
    for key, at in last_purge.items():
        copies = [r.stored_at for r in receipts.get(key, ())]
        if copies and max(copies) <= at:
            out.add(key)
    return out


def apply_journal(
    catalog: Catalog | None,
    journal: JournalState,
    outcome: JournalOutcome,
    *,
    known_prefixes: set[tuple[str, bytes]],
    known_fingerprint: Callable[[str], bool],
    dry_run: bool,
    actor: str | None,
) -> None:
    """Add the journal's refs, pins and quarantines the catalog lacks (see the module)."""
    now = utcnow()
    write = catalog is not None and not dry_run

    def has_prefix(ns: str, h: bytes) -> bool:
        if (ns, h) in known_prefixes:
            return True
        if catalog is None:
            return False
        try:
            catalog.get_prefix(ns, h)
        except (NotFoundError, CatalogError):
            return False
        return True

    for (ns, name), ref in sorted(journal.refs.items()):
        label = f"{ns}/{name}"
        if ref.deleted:
            continue
        existing = _ref(catalog, ns, name)
        if existing is not None:
            if existing.head_hash != ref.head_hash or existing.fingerprint != ref.fingerprint:
                outcome.disagreements.append(f"ref {label}")
            continue
        if not has_prefix(ns, ref.head_hash) or not known_fingerprint(ref.fingerprint):
            outcome.unresolved.append(f"ref {label}")
            continue
        if write:
            assert catalog is not None
            try:
                catalog.create_ref(
                    ns,
                    name,
                    ref.fingerprint,
                    ref.head_hash,
                    pending_token=ref.pending_token,
                    forked_from=ref.forked_from,
                    actor=actor,
                )
            except NotFoundError:  # its fingerprint is known to the stores, not the catalog
                outcome.unresolved.append(f"ref {label}")
                continue
        outcome.refs_added.append(label)

    for (ns, name), pin in sorted(journal.pins.items()):
        label = f"{ns}/{name}"
        if pin.deleted or (pin.expires_at is not None and pin.expires_at <= now):
            continue
        existing_pin = _pin(catalog, ns, name)
        if existing_pin is not None:
            if existing_pin.prefix_hash != pin.prefix_hash:
                outcome.disagreements.append(f"pin {label}")
            continue
        if not has_prefix(ns, pin.prefix_hash):
            outcome.unresolved.append(f"pin {label}")
            continue
        if write:
            assert catalog is not None
            ttl = None if pin.expires_at is None else (pin.expires_at - now).total_seconds()
            catalog.pin(ns, name, pin.prefix_hash, ttl_s=ttl, reason=pin.reason, actor=actor)
        outcome.pins_added.append(label)

    for q in sorted(journal.quarantines, key=lambda q: (q.namespace, q.prefix_hash)):
        label = f"{q.namespace}/{q.prefix_hash.hex()}"
        if not has_prefix(q.namespace, q.prefix_hash):
            outcome.unresolved.append(f"quarantine {label}")
            continue
        if catalog is not None and _quarantined(catalog, q.namespace, q.prefix_hash):
            continue
        if write:
            assert catalog is not None
            catalog.quarantine(q.namespace, q.prefix_hash, q.reason, actor=actor)
        outcome.quarantines_added.append(label)


def _ref(catalog: Catalog | None, ns: str, name: str) -> Any:
    if catalog is None:
        return None
    try:
        return catalog.get_ref(ns, name)
    except NotFoundError:
        return None


def _pin(catalog: Catalog | None, ns: str, name: str) -> Any:
    if catalog is None or catalog.namespace_chunk_size(ns) is None:
        return None
    return next((p for p in catalog.list_pins(ns) if p.name == name), None)


def _quarantined(catalog: Catalog, ns: str, h: bytes) -> bool:
    try:
        return catalog.get_prefix(ns, h).quarantined
    except NotFoundError:
        return False
