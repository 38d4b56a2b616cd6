"""A GC run over a catalog and its stores: the lock, the refusal rule, retention, then the orphan sweep.

Order (ARCHITECTURE 9): take the catalog's GC lock (one run at a time; a
crashed run's lease expires); refuse while the catalog records `missing`
replicas in the stores, unless forced; finish what an interrupted run left
`purging`/`deleting`; plan and apply the namespace's retention (quarantined
chunks, and with `max_age_s`/`max_bytes` the least valuable leaves), deleting
purged blobs' bytes from the stores given; then sweep orphan blobs
(`maintenance.sweep`). A dry run takes no lock, resumes nothing, deletes nothing.
The catalog side is `catalog.gc`; this module only adds the stores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from catalog.admin import count_replicas_in_state
from catalog.catalog import Catalog
from catalog.gc import (
    GC_LOCK,
    DeleteBlob,
    GcPlan,
    acquire_lock,
    lock_holder,
    plan_gc,
    release_lock,
)
from catalog.purge import GcResult, apply_gc, resume_gc
from chunkstore import ChunkStore
from chunkstore.errors import BlobNotFoundError
from maintenance.errors import GcLockedError, MissingReplicasError
from maintenance.progress import Progress, StageCounter
from maintenance.sweep import SweepReport, sweep_orphans

log = logging.getLogger(__name__)

LOCK_TTL_S = 6 * 3600.0  # longer than any GC run; a crashed run's lock expires after it


@dataclass
class PurgeReport:
    """The catalog side of a GC run: what an interrupted run left and was finished
    (`resumed`, None in a dry run), the plan (None when the namespace does not exist)
    and what applying it did (`result`, None in a dry run or for an empty plan)."""

    namespace: str
    resumed: GcResult | None = None
    plan: GcPlan | None = None
    result: GcResult | None = None

    def to_dict(self) -> dict[str, Any]:
        resumed = None if self.resumed is None else self.resumed.to_json()
        if self.plan is None:
            return {"namespace": self.namespace, "items": [], "resumed": resumed}
        doc = self.plan.to_json()
        doc["resumed"] = resumed
        if self.result is not None:
            doc["result"] = self.result.to_json()
        return doc


@dataclass
class GcRunReport:
    """What a whole GC run did: the catalog-side purge (`retention`) and the orphan sweep."""

    dry_run: bool
    grace_s: float
    max_age_s: float | None
    max_bytes: int | None
    stores: list[str]
    retention: PurgeReport
    sweep: SweepReport

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "grace_s": self.grace_s,
            "max_age_s": self.max_age_s,
            "max_bytes": self.max_bytes,
            "stores": list(self.stores),
            "retention": self.retention.to_dict(),
            "deleted": [o.to_dict() for o in self.sweep.deleted],
            "deleted_bytes": self.sweep.deleted_bytes,
            "kept_catalogued": self.sweep.kept_catalogued,
            "kept_young": self.sweep.kept_young,
            "errors": list(self.sweep.errors),
        }


def default_holder() -> str:
    """A GC lock holder name for this process: host and pid."""
    return f"gc {socket.gethostname()}:{os.getpid()}"


def store_deleter(stores: Sequence[ChunkStore]) -> DeleteBlob:
    """A `catalog.gc` blob deleter for these stores: False for any other location (not ours to reach)."""
    by_name = {s.name: s for s in stores}

    def delete_blob(location: str, key: str) -> bool:
        store = by_name.get(location)
        if store is None:
            return False  # another store or a worker's pool: not ours to reach
        with contextlib.suppress(BlobNotFoundError):  # already gone is what we wanted
            store.delete(key)
        return True

    return delete_blob


def purge(
    catalog: Catalog,
    stores: Sequence[ChunkStore],
    namespace: str,
    *,
    max_age_s: float | None = None,
    max_bytes: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
    actor: str | None = "gc",
) -> PurgeReport:
    """Finish an interrupted run, then plan (and unless `dry_run` apply) `namespace`'s purge.

    Run under the GC lock (`run_gc` takes it). Purged blobs' bytes are deleted
    from `stores`; replicas elsewhere stay `deleting` for a run that can reach
    them. `progress` gets the stages "gc resume" and "gc purge" (totals unknown).
    """
    now = now or datetime.now(UTC)
    delete_blob = store_deleter(stores)
    report = PurgeReport(namespace=namespace)
    if not dry_run:
        # First finish what an interrupted run left `purging`/`deleting` (publishes of
        # those chunks are refused until it is done).
        report.resumed = resume_gc(
            catalog, delete_blob, actor=actor, progress=StageCounter(progress, "gc resume")
        )
    if catalog.namespace_chunk_size(namespace) is None:
        return report
    report.plan = plan_gc(catalog, namespace, max_age_s=max_age_s, max_bytes=max_bytes, now=now)
    if not dry_run and report.plan.items:
        report.result = apply_gc(
            catalog,
            report.plan,
            delete_blob,
            actor=actor,
            progress=StageCounter(progress, "gc purge"),
        )
    return report


def run_gc(
    catalog: Catalog,
    stores: Sequence[ChunkStore],
    namespace: str,
    *,
    grace_s: float = 3600.0,
    max_age_s: float | None = None,
    max_bytes: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    holder: str | None = None,
    lock_ttl_s: float = LOCK_TTL_S,
    now: datetime | None = None,
    progress: Progress | None = None,
    actor: str | None = "gc",
) -> GcRunReport:
    """One GC run: under the GC lock, purge `namespace` (`purge`), then sweep orphans in `stores`.

    Raises `GcLockedError` while another run holds the lock, and
    `MissingReplicasError` while the catalog records missing replicas in
    `stores` (unless `force`); nothing is changed then. A dry run needs no lock
    and is never refused. `holder` names this run in the lock (default: host
    and pid). Catalog errors propagate (the lock is released first).
    """
    now = now or datetime.now(UTC)
    holder = holder or default_holder()
    # A dry run changes nothing, so it needs no lock (and is not refused by one).
    if not dry_run and not acquire_lock(catalog, GC_LOCK, holder, lock_ttl_s):
        other = lock_holder(catalog, GC_LOCK)
        who = f"{other[0]} until {other[1]:%Y-%m-%d %H:%M:%S} UTC" if other else "another run"
        raise GcLockedError(
            f"another GC is running ({who}); try again later",
            holder=other[0] if other else None,
            until=other[1] if other else None,
        )
    try:
        broken = count_replicas_in_state(catalog, [s.name for s in stores], "missing")
        if broken and not force and not dry_run:
            raise MissingReplicasError(
                f"the catalog records {broken} missing replica(s) in the stores; "
                "check them with fsck first (or force the run)",
                missing=broken,
            )
        purged = purge(
            catalog,
            stores,
            namespace,
            max_age_s=max_age_s,
            max_bytes=max_bytes,
            dry_run=dry_run,
            now=now,
            progress=progress,
            actor=actor,
        )
        swept = sweep_orphans(
            catalog, stores, grace_s=grace_s, dry_run=dry_run, now=now, progress=progress
        )
    finally:
        if not dry_run:
            release_lock(catalog, GC_LOCK, holder)
    return GcRunReport(
        dry_run=dry_run,
        grace_s=grace_s,
        max_age_s=max_age_s,
        max_bytes=max_bytes,
        stores=[s.name for s in stores],
        retention=purged,
        sweep=swept,
    )
