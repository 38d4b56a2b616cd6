"""fsck: check that the catalog's replicas in the given stores exist (and verify), mark and repair them.

Each replica at one of the stores must exist with its receipt's size; with
`read_data` its bytes must hash to its key and decode as a valid record.
Broken replicas are marked `missing` or `corrupt` (restores then skip them); a
replica marked broken that checks out again is marked `durable` (a `corrupt`
one only after `read_data`: without it, one a reader marked corrupt is
reported as corrupt, since existence and size cannot clear it). Replicas at
other locations (other stores, workers) are counted as not checked. With
`repair`, a missing or corrupt replica gets the bytes of another replica of
the same blob in one of the stores, once those verify.

A store that fails with anything but "not found" (unreachable, permissions)
is left alone for the rest of the run: its replicas keep their state, since
the outcome is unknown.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from catalog.admin import replicas_elsewhere, replicas_to_check
from catalog.catalog import Catalog
from catalog.errors import IdentityError
from catalog.identity import AttentionLayout
from chunkstore import ChunkStore
from chunkstore.errors import (
    BlobNotFoundError,
    ChunkFormatError,
    ChunkIntegrityError,
    ChunkStoreError,
)
from maintenance.bounds import verify_within_layout
from maintenance.progress import Progress
from restore.descriptors import store_descriptor
from restore.errors import InputError
from restore.write_behind import to_replica_receipt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaProblem:
    """A replica fsck found missing, corrupt or unreachable: its state before, and why."""

    blob_key: str
    location: str
    was: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "blob_key": self.blob_key,
            "location": self.location,
            "was": self.was,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Revived:
    """A replica marked broken whose bytes checked out again: now `durable`."""

    blob_key: str
    location: str
    was: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "blob_key": self.blob_key,
            "location": self.location,
            "was": self.was,
            "state": "durable",
        }


@dataclass(frozen=True)
class Repaired:
    """A broken replica rewritten from the verified bytes of another store's replica."""

    blob_key: str
    location: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"blob_key": self.blob_key, "location": self.location, "source": self.source}


@dataclass
class FsckReport:
    """What an fsck run checked and found. `clean` is true when nothing was missing,
    corrupt or unreachable (repaired problems still count: they were found)."""

    read_data: bool
    stores: list[str]
    checked: int = 0
    ok: int = 0
    missing: list[ReplicaProblem] = field(default_factory=list)
    corrupt: list[ReplicaProblem] = field(default_factory=list)
    unreachable: list[ReplicaProblem] = field(default_factory=list)
    skipped_after_error: int = 0  # replicas in a store after it failed
    revived: list[Revived] = field(default_factory=list)
    repaired: list[Repaired] = field(default_factory=list)
    not_checked: dict[str, int] = field(default_factory=dict)  # location -> replicas

    @property
    def clean(self) -> bool:
        return not (self.missing or self.corrupt or self.unreachable)

    def to_dict(self) -> dict[str, Any]:
        return {
            "read_data": self.read_data,
            # Without read_data, "ok" means present with the receipt's size, never verified.
            "contents_verified": self.read_data,
            "stores": list(self.stores),
            "checked": self.checked,
            "ok": self.ok,
            "missing": [p.to_dict() for p in self.missing],
            "corrupt": [p.to_dict() for p in self.corrupt],
            "unreachable": [p.to_dict() for p in self.unreachable],
            "skipped_after_error": self.skipped_after_error,
            "revived": [r.to_dict() for r in self.revived],
            "repaired": [r.to_dict() for r in self.repaired],
            "not_checked": dict(self.not_checked),
            "clean": self.clean,
        }


def layouts(catalog: Catalog) -> Callable[[str], AttentionLayout | None]:
    """The attention layout of a catalogued fingerprint by hex (None if unknown), cached."""

    @functools.cache
    def layout_of(hex_: str) -> AttentionLayout | None:
        try:
            fp = catalog.get_fingerprint(hex_)
        except IdentityError:  # a header naming no valid hex: verification refuses it
            return None
        return None if fp is None else fp.layout

    return layout_of


def in_subset(key: str, subset: tuple[int, int] | None) -> bool:
    """Whether blob `key` is in part n of t (`subset` = (n, t)); every key is in None."""
    # Blob keys are uniform digests, so their leading bits split the work evenly and stably.
    return subset is None or int(key[:8], 16) % subset[1] == subset[0] - 1


def fsck(
    catalog: Catalog,
    stores: Sequence[ChunkStore],
    *,
    read_data: bool = False,
    subset: tuple[int, int] | None = None,
    repair: bool = True,
    progress: Progress | None = None,
    actor: str | None = "fsck",
) -> FsckReport:
    """Check (and with `repair` fix) every catalogued replica in `stores`; return what was found.

    `subset` = (n, t) checks only part n of t of the blobs (by key), to spread
    the work over runs. `progress("fsck", done, total)` is called after each
    replica. Catalog errors propagate; store errors are reported per store.
    """
    if subset is not None and not 1 <= subset[0] <= subset[1]:
        raise InputError(f"subset {subset[0]}/{subset[1]}: need 1 <= n <= t")
    by_name = {s.name: s for s in stores}
    layout_of = layouts(catalog)
    report = FsckReport(read_data=read_data, stores=sorted(by_name))
    rows = [r for r in replicas_to_check(catalog, by_name) if in_subset(r.blob_key, subset)]
    report.not_checked = replicas_elsewhere(catalog, by_name)
    down: dict[str, str] = {}  # store -> first error; its remaining replicas are not checked
    verified: dict[str, list[str]] = {}

    def mark(key: str, loc: str, state: str, reason: str, was: str) -> None:
        if was != state:  # already marked: no new event
            catalog.mark_replica(key, loc, state, reason=reason, actor=actor)

    for done, row in enumerate(rows, 1):
        if progress is not None:
            progress("fsck", done, len(rows))
        key, loc, state, size = row.blob_key, row.location, row.state, row.size
        if loc in down:
            continue
        store = by_name[loc]
        report.checked += 1
        try:
            st = store.stat(key)
            if st.size != size:
                reason = f"size {st.size}, receipt says {size}"
                report.corrupt.append(ReplicaProblem(key, loc, state, reason))
                mark(key, loc, "corrupt", reason, state)
                continue
            if read_data:
                data = store.get(key)
                try:
                    verify_within_layout(data, key, layout_of)
                finally:
                    if isinstance(data, memoryview):
                        data.release()
            elif state == "corrupt":
                # A reader found these bytes bad; existence and size cannot say otherwise.
                reason = "marked corrupt by a reader (--read-data verifies it again)"
                report.corrupt.append(ReplicaProblem(key, loc, state, reason))
                continue
        except BlobNotFoundError:
            report.missing.append(ReplicaProblem(key, loc, state, "not in the store"))
            mark(key, loc, "missing", "fsck: not in the store", state)
            continue
        except (ChunkIntegrityError, ChunkFormatError) as exc:
            report.corrupt.append(ReplicaProblem(key, loc, state, str(exc)))
            mark(key, loc, "corrupt", f"fsck: {exc}", state)
            continue
        except (ChunkStoreError, OSError) as exc:
            # Outcome unknown: leave the replica's state alone.
            log.info("fsck: %s is unreachable, skipping its replicas: %s", loc, exc)
            report.unreachable.append(ReplicaProblem(key, loc, state, str(exc)))
            down[loc] = str(exc)
            report.checked -= 1
            continue
        report.ok += 1
        if read_data:
            verified.setdefault(loc, []).append(key)
        # Bytes that are back (or verified in full) make a broken replica usable again;
        # stat alone cannot clear a `corrupt` mark.
        if state == "missing" or (state == "corrupt" and read_data):
            catalog.mark_replica(key, loc, "durable", reason="fsck: verified", actor=actor)
            report.revived.append(Revived(key, loc, state))
    for loc, keys in verified.items():
        catalog.touch_verified(loc, keys)
    if repair:
        report.repaired = _repair(catalog, by_name, report.missing + report.corrupt, down, actor)
    report.skipped_after_error = sum(1 for r in rows if r.location in down) - len(
        report.unreachable
    )
    return report


def _repair(
    catalog: Catalog,
    stores: dict[str, ChunkStore],
    broken: list[ReplicaProblem],
    down: dict[str, str],
    actor: str | None,
) -> list[Repaired]:
    """Copy verified bytes from a good replica over each broken one; return what was repaired."""
    bad = {(b.blob_key, b.location) for b in broken}
    layout_of = layouts(catalog)
    out: list[Repaired] = []
    for item in broken:
        key, loc = item.blob_key, item.location
        if loc in down:
            continue
        for src_name, src in stores.items():
            if src_name == loc or (key, src_name) in bad or src_name in down:
                continue
            try:
                data = bytes(src.get(key))
                header = verify_within_layout(data, key, layout_of)  # only verified bytes
                target = stores[loc]
                fp = catalog.get_fingerprint(header.fingerprint)
                if fp is not None:  # the store keeps describing its own blobs
                    store_descriptor(target, fp)
                target.delete(key)  # a same-size corrupt copy would otherwise be kept
                receipt = target.put(key, data)
            except (ChunkStoreError, OSError, ValueError):
                continue
            catalog.record_replica(key, to_replica_receipt(receipt, target.tier), actor=actor)
            log.info("fsck: repaired %s at %s from %s", key, loc, src_name)
            out.append(Repaired(key, loc, src_name))
            break
    return out
