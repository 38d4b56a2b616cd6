"""The orphan sweep: delete blobs no replica row names once they are older than a grace period.

A crashed publish leaves bytes in a store with no catalog row (invariant P3).
They are orphans only after `grace_s` seconds without modification: a publish
in flight is younger, and a publish that reuses a blob refreshes its time, so
the sweep never deletes what a concurrent publish relies on. The store is
listed a page at a time and each page's keys are looked up in the catalogue
(by key: memory and catalogue reads grow with the page, not with the store or
the catalog); a blob listed before its publish committed is young. The
candidates are looked up again at the end, and each candidate's time is read
once more just before it is deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from catalog.admin import still_catalogued
from catalog.catalog import Catalog
from chunkstore import ChunkStore
from chunkstore.errors import BlobNotFoundError, ChunkStoreError
from maintenance.progress import Progress, StageCounter
from restore.errors import InputError

log = logging.getLogger(__name__)

SWEEP_PAGE = 5000  # store keys looked up in the catalogue at a time


@dataclass(frozen=True)
class Orphan:
    """A blob the sweep deleted (or, in a dry run, would delete): where, its size and age."""

    store: str
    blob_key: str
    size: int
    age_s: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "blob_key": self.blob_key,
            "size": self.size,
            "age_s": self.age_s,
        }


@dataclass
class SweepReport:
    """What an orphan sweep deleted and kept; `errors` names each store that failed (one line each)."""

    dry_run: bool
    grace_s: float
    deleted: list[Orphan] = field(default_factory=list)
    kept_catalogued: int = 0
    kept_young: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def deleted_bytes(self) -> int:
        return sum(o.size for o in self.deleted)


def sweep_orphans(
    catalog: Catalog,
    stores: Sequence[ChunkStore],
    *,
    grace_s: float = 3600.0,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> SweepReport:
    """Delete (unless `dry_run`) the blobs in `stores` no replica row names, older than `grace_s`.

    Keep `grace_s` above the stores' `refresh_after_s`. `progress("gc <store>",
    listed, None)` is called for each blob listed. A store that fails is
    reported in `errors` and the sweep goes on with the next; catalog errors
    propagate.
    """
    if grace_s < 0:
        raise InputError(f"grace period {grace_s} s: must not be negative")
    now = now or datetime.now(UTC)
    report = SweepReport(dry_run=dry_run, grace_s=grace_s)
    for store in stores:
        _sweep_store(catalog, store, report, now, StageCounter(progress, f"gc {store.name}"))
    return report


def _sweep_store(
    catalog: Catalog, store: ChunkStore, report: SweepReport, now: datetime, listed: StageCounter
) -> None:
    grace = report.grace_s
    candidates: dict[str, tuple[int, float]] = {}
    try:
        keys = iter(store.keys())
        while page := list(islice(keys, SWEEP_PAGE)):
            catalogued = still_catalogued(catalog, store.name, page)
            for key in page:
                listed()
                if key in catalogued:
                    report.kept_catalogued += 1
                    continue
                try:
                    st = store.stat(key)
                except BlobNotFoundError:
                    continue
                # Not catalogued when looked up: a publish in flight wrote it since (young).
                age = (now - st.mtime).total_seconds()
                if age < grace:
                    report.kept_young += 1
                else:
                    candidates[key] = (st.size, age)
        # Catalogued since its page was looked up: not an orphan any more.
        for key in still_catalogued(catalog, store.name, sorted(candidates)):
            del candidates[key]
            report.kept_catalogued += 1
        for key, (size, age) in sorted(candidates.items()):
            if not report.dry_run:
                try:
                    # Refreshed by a publish since we looked: keep it.
                    mtime = store.stat(key).mtime
                    if (datetime.now(UTC) - mtime).total_seconds() < grace:
                        report.kept_young += 1
                        continue
                except BlobNotFoundError:
                    continue
                store.delete(key)
                log.info("gc: deleted orphan %s at %s", key, store.name)
            report.deleted.append(Orphan(store.name, key, size, round(age)))
    except ChunkStoreError as exc:
        log.info("gc: sweeping %s failed: %s", store.name, exc)
        report.errors.append(f"{store.name}: {exc}")
