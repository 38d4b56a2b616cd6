"""Catalog-side garbage collection, applying: mark a plan's chunks, delete their bytes, drop their rows."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import aliased

from catalog.catalog import Catalog
from catalog.changes import ChunkPurged, PinRemoved
from catalog.clock import utcnow
from catalog.errors import NotFoundError
from catalog.gc import DeleteBlob, GcItem, GcPlan, load_tree, protected_nodes
from catalog.models import Shard
from catalog.schema import Chunk, Event, Namespace, Pin, PrefixNode, Ref, Replica
from catalog.transactions import exclude_holders

log = logging.getLogger(__name__)

_BATCH = 500  # keys per IN (...) list

# The states an interrupted run leaves, written into the statement (not bound): only then
# does the planner use the partial indexes that hold just those rows (ix_chunks_purging,
# ix_replicas_deleting) instead of reading every chunk or replica of the catalog.
_PURGING = sa.literal("purging", literal_execute=True)
_DELETING = sa.literal("deleting", literal_execute=True)

# -- applying ----------------------------------------------------------------------------


@dataclass
class GcResult:
    """What applying a plan did."""

    chunks_removed: int = 0
    prefixes_removed: int = 0
    blobs_deleted: list[tuple[str, str]] = field(default_factory=list)  # (location, key)
    # Replicas whose bytes could not be deleted: left in state `deleting` for a later run.
    blobs_kept: list[tuple[str, str, str]] = field(default_factory=list)  # (location, key, why)
    shared_blobs: list[str] = field(default_factory=list)  # still used by a kept chunk
    # Planned chunks spared because, since planning, their node became a root, gained
    # a kept child, or was re-recorded by a publish (or another GC purges them).
    skipped: int = 0
    resumed: int = 0  # chunks and replicas a previous, interrupted run left to finish

    def to_json(self) -> dict[str, Any]:
        return {
            "chunks_removed": self.chunks_removed,
            "prefixes_removed": self.prefixes_removed,
            "blobs_deleted": [{"location": loc, "blob_key": k} for loc, k in self.blobs_deleted],
            "blobs_kept": [
                {"location": loc, "blob_key": k, "reason": why} for loc, k, why in self.blobs_kept
            ],
            "shared_blobs": self.shared_blobs,
            "skipped": self.skipped,
            "resumed": self.resumed,
        }


def _batches(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), _BATCH):
        yield items[i : i + _BATCH]


def _events(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        conn.execute(sa.insert(Event), rows)


def apply_gc(
    cat: Catalog,
    plan: GcPlan,
    delete_blob: DeleteBlob,
    *,
    actor: str | None = "gc",
    progress: Callable[[int], object] | None = None,
) -> GcResult:
    """Carry out a plan: mark its chunks `purging` and their replicas `deleting`, delete
    the bytes, then drop the rows.

    Run under the GC lock. Marking first locks the planned chunk rows (on PostgreSQL;
    SQLite has one writer), the same rows a publish that extends or re-records them and
    a ref move onto them lock, so the two are ordered: whatever committed first is seen
    by the other. A publish or ref move that comes after the mark finds the chunks
    `purging` and is refused (`PurgeInProgressError`, nothing changed; the publisher
    retries after this run). The mark spares a planned node that has since become a
    root, gained a child that stays, or been re-recorded, and with it its ancestors.

    A blob another kept chunk of the namespace still names keeps its bytes and replicas
    (keys are content addressed); bytes another namespace also holds a replica of at that
    location are not deleted either (only this namespace's row goes). A replica whose bytes `delete_blob` could not delete stays,
    marked `deleting`, so bytes are never left without a row naming them;
    `resume_gc` (which `kvc gc` runs first) finishes it later.
    """
    result = GcResult()
    ns_name = plan.namespace
    items = list(plan.items)

    def mark() -> tuple[list[GcItem], dict[str, list[str]]]:
        with cat.db.write() as conn:
            now = utcnow()
            ns = cat.db.namespace(conn, ns_name)
            if ns is None:
                raise NotFoundError(f"no namespace {ns_name!r}")
            # 1. Wait for the publishes, ref moves and pins under way in the namespace (and
            # keep new ones out until this commits), then lock the planned rows in id order.
            exclude_holders(conn, ns[0])
            state: dict[int, Any] = {}
            for batch in _batches(sorted({i.chunk_id for i in items})):
                for r in conn.execute(
                    sa.select(Chunk.id, Chunk.state, Chunk.last_seen_at)
                    .where(Chunk.id.in_(batch))
                    .order_by(Chunk.id)
                    .with_for_update()
                ):
                    state[int(r.id)] = r
            # 2. Read the tree after the lock, and keep only what is still unneeded.
            nodes = load_tree(cat, conn, ns[0])
            protected, _ = protected_nodes(cat, conn, ns[0], nodes, now)
            planned: dict[bytes, dict[int, GcItem]] = {}
            for i in items:
                planned.setdefault(i.prefix_hash, {})[i.chunk_id] = i

            def unchanged(h: bytes) -> bool:
                n = nodes.get(h)
                if n is None or h in protected:
                    return False
                for c in n.chunks:
                    item = planned[h].get(int(c.id))
                    now_row = state.get(int(c.id))
                    if item is None or now_row is None or now_row.state != "ready":
                        return False  # a chunk added since planning, or another GC's
                    if item.last_seen_at is not None and now_row.last_seen_at != item.last_seen_at:
                        return False  # re-recorded by a publish since planning
                return True

            keep = {h for h in planned if unchanged(h)}
            children: dict[bytes, list[bytes]] = {}
            for h, n in nodes.items():
                children.setdefault(n.parent, []).append(h)
            changed = True
            while changed:  # a node goes only with its whole subtree
                changed = False
                for h in sorted(keep):
                    if any(c not in keep for c in children.get(h, ())):
                        keep.discard(h)
                        changed = True
            live = [i for i in items if i.prefix_hash in keep]
            result.skipped = len(items) - len(live)
            ids = {i.chunk_id for i in live}
            for batch in _batches(sorted(ids)):
                conn.execute(sa.update(Chunk).where(Chunk.id.in_(batch)).values(state="purging"))
            replicas = _mark_deleting(conn, ns[0], live, ids, result, ns_name, actor, now)
            return live, replicas

    live, replicas = cat.db.retrying(mark)
    _delete_and_drop(cat, ns_name, live, replicas, delete_blob, result, actor, progress)
    return result


def _mark_deleting(
    conn: sa.Connection,
    ns_id: int,
    live: list[GcItem],
    ids: set[int],
    result: GcResult,
    ns_name: str | None,
    actor: str | None,
    now: datetime,
) -> dict[str, list[str]]:
    """Mark namespace `ns_id`'s replicas of the purged chunks' blobs `deleting` (unless a
    kept chunk of the namespace shares one); return the (key -> locations) to delete.

    Bytes that another namespace also holds a replica of at the same location stay: this
    namespace's row is forgotten, the bytes are not deleted (nor is the other's row marked).
    """
    keys = sorted({i.blob_key for i in live})
    shared: set[str] = set()
    for batch in _batches(keys):
        for k, cid in conn.execute(
            sa.select(Chunk.blob_key, Chunk.id)
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .where(Chunk.blob_key.in_(batch), PrefixNode.namespace_id == ns_id)
        ):
            if cid not in ids:
                shared.add(k)
    result.shared_blobs += sorted(shared)
    doomed = [k for k in keys if k not in shared]
    replicas: dict[str, list[str]] = {}
    for batch in _batches(doomed):
        others = {
            (k, loc)
            for k, loc in conn.execute(
                sa.select(Replica.blob_key, Replica.location).where(
                    Replica.blob_key.in_(batch), Replica.namespace_id != ns_id
                )
            )
        }
        forget: list[tuple[str, str]] = []
        for k, loc in conn.execute(
            sa.select(Replica.blob_key, Replica.location)
            .where(Replica.blob_key.in_(batch), Replica.namespace_id == ns_id)
            .order_by(Replica.blob_key, Replica.location)
        ):
            if (k, loc) in others:
                forget.append((k, loc))
            else:
                replicas.setdefault(k, []).append(loc)
        for k, loc in forget:
            conn.execute(
                sa.delete(Replica).where(
                    Replica.blob_key == k, Replica.namespace_id == ns_id, Replica.location == loc
                )
            )
        for k, locs in replicas.items():
            if k in batch:
                conn.execute(
                    sa.update(Replica)
                    .where(
                        Replica.blob_key == k,
                        Replica.namespace_id == ns_id,
                        Replica.location.in_(locs),
                    )
                    .values(state="deleting")
                )
    _events(
        conn,
        [
            {
                "at": now,
                "kind": "replica.deleting",
                "namespace": ns_name,
                "subject": k,
                "actor": actor,
                "details": {"locations": locs, "reason": "gc"},
            }
            for k, locs in replicas.items()
        ],
    )
    return replicas


def _delete_and_drop(
    cat: Catalog,
    ns_name: str | None,
    live: list[GcItem],
    replicas: dict[str, list[str]],
    delete_blob: DeleteBlob,
    result: GcResult,
    actor: str | None,
    progress: Callable[[int], object] | None,
) -> None:
    # Delete bytes outside any transaction (slow, remote).
    gone: list[tuple[str, str]] = []
    for key, locs in replicas.items():
        for loc in locs:
            try:
                ok = delete_blob(loc, key)
            except Exception as exc:
                result.blobs_kept.append((loc, key, f"{type(exc).__name__}: {exc}"))
                continue
            if ok is False:
                result.blobs_kept.append((loc, key, "location not reachable"))
            else:
                gone.append((loc, key))
            if progress is not None:
                progress(1)
    result.blobs_deleted += gone
    reason_of = {i.chunk_id: i for i in live}

    # Drop rows: deleted replicas, the chunks, and prefix nodes left empty and childless.
    def drop() -> tuple[int, int]:
        with cat.db.write() as conn:
            now = utcnow()
            by_loc: dict[str, list[str]] = {}
            for loc, key in gone:
                by_loc.setdefault(loc, []).append(key)
            for loc, ks in by_loc.items():
                for batch in _batches(ks):
                    conn.execute(
                        sa.delete(Replica).where(
                            Replica.location == loc,
                            Replica.blob_key.in_(batch),
                            Replica.state == "deleting",
                        )
                    )
            removed = 0
            for batch in _batches(sorted(reason_of)):
                _announce_purged(cat, conn, batch, now)
                removed += int(
                    conn.execute(
                        sa.delete(Chunk).where(Chunk.id.in_(batch), Chunk.state == "purging")
                    ).rowcount
                )
            # Deepest first so a parent sees its children gone.
            hashes = sorted({i.prefix_hash for i in live})
            depth: dict[bytes, int] = {}
            for batch in _batches(hashes):
                depth.update(
                    (h, d)
                    for h, d in conn.execute(
                        sa.select(PrefixNode.prefix_hash, PrefixNode.depth).where(
                            PrefixNode.prefix_hash.in_(batch)
                        )
                    )
                )
            prefixes = 0
            child = aliased(PrefixNode)
            for h in sorted(depth, key=lambda x: -depth[x]):
                res = conn.execute(
                    sa.delete(PrefixNode).where(
                        PrefixNode.prefix_hash == h,
                        ~sa.exists().where(Chunk.prefix_hash == h),
                        ~sa.exists().where(child.parent_hash == h),
                        ~sa.exists().where(Ref.head_hash == h),
                    )
                )
                if res.rowcount:
                    prefixes += 1
                    # Only an expired pin can name a purged prefix (a live one is a root).
                    for pin_ns, pin_name in conn.execute(
                        sa.select(Namespace.name, Pin.name)
                        .join(Namespace, Namespace.id == Pin.namespace_id)
                        .where(Pin.prefix_hash == h)
                    ):
                        cat.db.changed(conn, PinRemoved(pin_ns, pin_name, now))
                    conn.execute(sa.delete(Pin).where(Pin.prefix_hash == h))
            _events(
                conn,
                [
                    {
                        "at": now,
                        "kind": "chunk.purge",
                        "namespace": ns_name,
                        "subject": i.prefix_hash.hex(),
                        "actor": actor,
                        "details": {
                            "fingerprint": i.fingerprint,
                            "blob_key": i.blob_key,
                            "stored_bytes": i.stored_bytes,
                            "reason": i.reason,
                        },
                    }
                    for i in live
                ]
                + [
                    {
                        "at": now,
                        "kind": "replica.delete",
                        "namespace": ns_name,
                        "subject": key,
                        "actor": actor,
                        "details": {"location": loc, "reason": "gc"},
                    }
                    for loc, key in gone
                ],
            )
            cat.db.event(
                conn,
                "gc",
                ns_name,
                None,
                actor,
                {
                    "chunks": removed,
                    "prefixes": prefixes,
                    "blobs_deleted": len(gone),
                    "blobs_kept": len(result.blobs_kept),
                    "shared_blobs": len(result.shared_blobs),
                    "resumed": result.resumed,
                },
            )
            return removed, prefixes

    removed, prefixes = cat.db.retrying(drop)
    result.chunks_removed += removed
    result.prefixes_removed += prefixes


def _announce_purged(cat: Catalog, conn: sa.Connection, ids: Sequence[int], now: datetime) -> None:
    """Tell the change listeners (the journal) about the chunk rows about to be dropped."""
    for r in conn.execute(
        sa.select(
            Namespace.name,
            Chunk.fingerprint,
            Chunk.prefix_hash,
            Chunk.layer_lo,
            Chunk.layer_hi,
            Chunk.head_lo,
            Chunk.head_hi,
            Chunk.blob_key,
        )
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .join(Namespace, Namespace.id == PrefixNode.namespace_id)
        .where(Chunk.id.in_(ids), Chunk.state == "purging")
        .order_by(Chunk.id)
    ):
        shard = Shard(r.layer_lo, r.layer_hi, r.head_lo, r.head_hi)
        cat.db.changed(
            conn, ChunkPurged(r.name, r.fingerprint, r.prefix_hash, shard, r.blob_key, now)
        )


def resume_gc(
    cat: Catalog,
    delete_blob: DeleteBlob,
    *,
    actor: str | None = "gc",
    progress: Callable[[int], object] | None = None,
) -> GcResult:
    """Finish what an interrupted or partly failed GC left: chunks still `purging` and
    replicas still `deleting` whose blob no ready chunk of their namespace names. Run under
    the GC lock.

    Until this runs, a publish of those chunks is refused with `PurgeInProgressError`
    (its bytes would be deleted under it), so `kvc gc` runs it before anything else.
    """
    result = GcResult()

    def mark() -> tuple[list[GcItem], dict[str, list[str]]]:
        with cat.db.write() as conn:
            now = utcnow()
            live: list[GcItem] = []
            by_ns: dict[tuple[int, str], list[GcItem]] = {}
            for r in conn.execute(
                sa.select(
                    Chunk.id,
                    Chunk.prefix_hash,
                    Chunk.fingerprint,
                    Chunk.blob_key,
                    Chunk.stored_bytes,
                    Namespace.id.label("ns_id"),
                    Namespace.name.label("ns_name"),
                )
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .join(Namespace, Namespace.id == PrefixNode.namespace_id)
                .where(Chunk.state == _PURGING)
                .order_by(Chunk.id)
                .with_for_update(of=Chunk)
            ):
                item = GcItem(
                    int(r.id),
                    r.prefix_hash,
                    r.fingerprint,
                    r.blob_key,
                    int(r.stored_bytes),
                    "resumed",
                )
                live.append(item)
                by_ns.setdefault((r.ns_id, r.ns_name), []).append(item)
            ids = {i.chunk_id for i in live}
            replicas: dict[str, list[str]] = {}
            for (ns_id, ns_name), items in sorted(by_ns.items()):
                found = _mark_deleting(conn, ns_id, items, ids, result, ns_name, actor, now)
                for k, locs in found.items():
                    known = replicas.setdefault(k, [])
                    known += [loc for loc in locs if loc not in known]
            # Replicas left `deleting` whose blob no ready chunk of their namespace names.
            ready = (
                sa.select(Chunk.id)
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .where(
                    Chunk.blob_key == Replica.blob_key,
                    Chunk.state == "ready",
                    PrefixNode.namespace_id == Replica.namespace_id,
                )
            )
            for k, loc in conn.execute(
                sa.select(Replica.blob_key, Replica.location)
                .where(Replica.state == _DELETING, ~ready.exists())
                .distinct()
                .order_by(Replica.blob_key, Replica.location)
            ):
                if loc not in replicas.setdefault(k, []):
                    replicas[k].append(loc)
            result.resumed = len(live) + sum(len(v) for v in replicas.values())
            return live, replicas

    live, replicas = cat.db.retrying(mark)
    if live or replicas:
        log.info(
            "gc: resuming %d purging chunk(s), %d blob(s) being deleted", len(live), len(replicas)
        )
        _delete_and_drop(cat, None, live, replicas, delete_blob, result, actor, progress)
    return result
