"""Catalog-side garbage collection: the GC lock, roots, retention plans and applying them."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import aliased

from catalog.catalog import Catalog
from catalog.clock import utcnow
from catalog.errors import CatalogInputError, NotFoundError
from catalog.schema import Chunk, Demand, Event, Lock, Pin, PrefixNode, Ref, Replica

log = logging.getLogger(__name__)

GC_LOCK = "gc"
_BATCH = 500  # keys per IN (...) list

Reason = Literal["quarantined", "age", "bytes", "resumed"]
# Called with (location, blob key); returns False (or raises) when it cannot delete there.
DeleteBlob = Callable[[str, str], "bool | None"]


# -- the lock ----------------------------------------------------------------------------


def acquire_lock(cat: Catalog, name: str, holder: str, ttl_s: float) -> bool:
    """Take the lease `name` for `ttl_s` seconds; False while another holder's lease is live.

    The holder that already has it renews it. An expired lease is taken over with a
    compare-and-swap on its expiry, so of two takers exactly one wins.
    """
    if ttl_s <= 0:
        raise CatalogInputError("a lock needs a positive ttl")

    def run() -> bool:
        with cat.db.write() as conn:
            now = utcnow()
            expires = now + timedelta(seconds=ttl_s)
            ins = (
                cat.db.insert(conn, Lock)
                .values(name=name, holder=holder, acquired_at=now, expires_at=expires)
                .on_conflict_do_nothing(index_elements=["name"])
            )
            if conn.execute(ins).rowcount == 1:
                cat.db.event(conn, "lock.acquire", None, name, holder, {"ttl_s": ttl_s})
                return True
            row = conn.execute(
                sa.select(Lock.holder, Lock.expires_at).where(Lock.name == name)
            ).first()
            if row is None:  # released between our insert and select: the caller may retry
                return False
            if row.holder != holder and row.expires_at > now:
                return False
            res = conn.execute(
                sa.update(Lock)
                .where(
                    Lock.name == name,
                    Lock.holder == row.holder,
                    # The swap: of two takers of an expired lease only the first sees it expired.
                    Lock.expires_at <= now if row.holder != holder else sa.true(),
                )
                .values(holder=holder, acquired_at=now, expires_at=expires)
            )
            if res.rowcount != 1:
                return False
            if row.holder != holder:
                cat.db.event(
                    conn,
                    "lock.takeover",
                    None,
                    name,
                    holder,
                    {"previous": row.holder, "expired_at": row.expires_at.isoformat()},
                )
            return True

    return cat.db.retrying(run)


def release_lock(cat: Catalog, name: str, holder: str) -> bool:
    """Give the lease back; False when `holder` does not hold it (it expired and was taken)."""

    def run() -> bool:
        with cat.db.write() as conn:
            res = conn.execute(sa.delete(Lock).where(Lock.name == name, Lock.holder == holder))
            if res.rowcount == 1:
                cat.db.event(conn, "lock.release", None, name, holder, {})
            return bool(res.rowcount == 1)

    return cat.db.retrying(run)


def lock_holder(cat: Catalog, name: str) -> tuple[str, datetime] | None:
    """Who holds the lease `name` and until when (None when nobody does)."""
    with cat.db.read() as conn:
        row = conn.execute(sa.select(Lock.holder, Lock.expires_at).where(Lock.name == name)).first()
    return None if row is None else (row.holder, row.expires_at)


# -- planning ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GcItem:
    """One chunk a plan purges, and why."""

    chunk_id: int
    prefix_hash: bytes
    fingerprint: str
    blob_key: str
    stored_bytes: int
    reason: Reason
    # The chunk's last_seen_at when planned: a publish that re-records it in the
    # meantime moves it, and applying the plan then spares the chunk.
    last_seen_at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix_hash.hex(),
            "fingerprint": self.fingerprint,
            "blob_key": self.blob_key,
            "stored_bytes": self.stored_bytes,
            "reason": self.reason,
        }


@dataclass
class GcPlan:
    """What a GC run would purge in one namespace; computed without changing anything."""

    namespace: str
    computed_at: datetime
    items: list[GcItem] = field(default_factory=list)
    # Quarantined nodes kept because a ref or a live demand depends on them.
    kept_quarantined: list[bytes] = field(default_factory=list)
    roots: int = 0
    bytes_before: int = 0

    @property
    def purged_bytes(self) -> int:
        return sum(i.stored_bytes for i in self.items)

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - self.purged_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "computed_at": self.computed_at.isoformat(),
            "roots": self.roots,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "purged_bytes": self.purged_bytes,
            "items": [i.to_json() for i in self.items],
            "kept_quarantined": [h.hex() for h in self.kept_quarantined],
        }


@dataclass
class _Node:
    parent: bytes
    quarantined: bool
    created_at: datetime
    chunks: list[Any] = field(default_factory=list)
    children: int = 0  # children still kept
    last_use: datetime | None = None
    uses: int = 0
    size: int = 0


def _lineage(nodes: dict[bytes, _Node], start: bytes) -> Iterable[bytes]:
    h: bytes | None = start
    seen: set[bytes] = set()
    while h is not None and h in nodes and h not in seen:
        seen.add(h)
        yield h
        h = nodes[h].parent
    return


def _protected(
    cat: Catalog, conn: sa.Connection, ns_id: int, nodes: dict[bytes, _Node], now: datetime
) -> tuple[set[bytes], int]:
    heads = list(conn.execute(sa.select(Ref.head_hash).where(Ref.namespace_id == ns_id)).scalars())
    heads += list(
        conn.execute(
            sa.select(Demand.prefix_hash).where(
                Demand.namespace_id == ns_id, Demand.expires_at > now
            )
        ).scalars()
    )
    heads += list(
        conn.execute(
            sa.select(Pin.prefix_hash).where(
                Pin.namespace_id == ns_id, sa.or_(Pin.expires_at.is_(None), Pin.expires_at > now)
            )
        ).scalars()
    )
    protected: set[bytes] = set()
    for h in heads:
        for a in _lineage(nodes, h):
            if a in protected:
                break  # the rest of this lineage is already in
            protected.add(a)
    return protected, len(set(heads))


def _load(cat: Catalog, conn: sa.Connection, ns_id: int) -> dict[bytes, _Node]:
    nodes = {
        r.prefix_hash: _Node(r.parent_hash, bool(r.quarantined), r.created_at)
        for r in conn.execute(
            sa.select(
                PrefixNode.prefix_hash,
                PrefixNode.parent_hash,
                PrefixNode.quarantined,
                PrefixNode.created_at,
            ).where(PrefixNode.namespace_id == ns_id)
        )
    }
    rows = conn.execute(
        sa.select(
            Chunk.id,
            Chunk.prefix_hash,
            Chunk.fingerprint,
            Chunk.blob_key,
            Chunk.stored_bytes,
            Chunk.created_at,
            Chunk.last_access_at,
            Chunk.access_count,
            Chunk.last_seen_at,
            Chunk.state,
        )
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .where(PrefixNode.namespace_id == ns_id)
    )
    for r in rows:
        n = nodes.get(r.prefix_hash)
        if n is None:
            # Published between the two reads (each statement sees the latest commit on
            # PostgreSQL): too new for this plan, and not under any chunk the mark holds.
            continue
        n.chunks.append(r)
        n.size += int(r.stored_bytes)
        n.uses += int(r.access_count or 0)
        used = r.last_access_at or r.created_at
        if n.last_use is None or used > n.last_use:
            n.last_use = used
    for n in nodes.values():
        if n.parent in nodes:
            nodes[n.parent].children += 1
    return nodes


def plan_gc(
    cat: Catalog,
    namespace: str,
    *,
    max_age_s: float | None,
    max_bytes: int | None,
    now: datetime,
) -> GcPlan:
    """Which chunks of `namespace` to purge: quarantined subtrees, then old leaves, then
    the least valuable leaves while the namespace holds more than `max_bytes`.

    Roots (ref heads, unexpired pins and unexpired demand) and their ancestors are
    never purged. A
    node goes only once every node below it goes, so a chunk with live descendants
    goes only with its whole subtree. A prefix node is the unit: all its chunks (every
    fingerprint and shard) go together; its value is their summed access count, then
    their latest use (access, or creation when never accessed).
    """
    with cat.db.read() as conn:
        ns = cat.db.namespace(conn, namespace)
        if ns is None:
            raise NotFoundError(f"no namespace {namespace!r}")
        nodes = _load(cat, conn, ns[0])
        protected, n_roots = _protected(cat, conn, ns[0], nodes, now)
    plan = GcPlan(namespace, now, roots=n_roots)
    plan.bytes_before = sum(n.size for n in nodes.values())
    purged: dict[bytes, Reason] = {}

    def purge(h: bytes, reason: Reason) -> None:
        purged[h] = reason
        parent = nodes[h].parent
        if parent in nodes:
            nodes[parent].children -= 1

    # Quarantine covers descendants too; close over ancestors anyway (a child published
    # under a node later quarantined is still unrestorable).
    bad_memo: dict[bytes, bool] = {}
    for h in nodes:
        path = []
        a: bytes | None = h
        while a is not None and a in nodes and a not in bad_memo:
            path.append(a)
            a = nodes[a].parent
        verdict = bad_memo.get(a, False) if a is not None else False
        for x in reversed(path):
            verdict = verdict or nodes[x].quarantined
            bad_memo[x] = verdict
    bad = {h for h, v in bad_memo.items() if v}
    for h in sorted(bad):
        if h in protected:
            if nodes[h].quarantined:
                plan.kept_quarantined.append(h)
        else:
            purge(h, "quarantined")
    if plan.kept_quarantined:
        log.warning(
            "gc %s: %d quarantined node(s) kept because a ref or demand depends on them",
            namespace,
            len(plan.kept_quarantined),
        )

    def leaves() -> list[bytes]:
        return [
            h
            for h, n in nodes.items()
            if h not in purged and h not in protected and n.children == 0
        ]

    def last_use(n: _Node) -> datetime:
        return n.last_use or n.created_at

    if max_age_s is not None:
        cutoff = now - timedelta(seconds=max_age_s)
        stack = [h for h in leaves() if last_use(nodes[h]) < cutoff]
        while stack:
            h = stack.pop()
            purge(h, "age")
            p = nodes[h].parent
            if (
                p in nodes
                and p not in purged
                and p not in protected
                and nodes[p].children == 0
                and last_use(nodes[p]) < cutoff
            ):
                stack.append(p)

    if max_bytes is not None:
        total = plan.bytes_before - sum(nodes[h].size for h in purged)
        heap = [(nodes[h].uses, last_use(nodes[h]), h) for h in leaves()]
        heapq.heapify(heap)
        while total > max_bytes and heap:
            _, _, h = heapq.heappop(heap)
            purge(h, "bytes")
            total -= nodes[h].size
            p = nodes[h].parent
            if p in nodes and p not in purged and p not in protected and nodes[p].children == 0:
                n = nodes[p]
                heapq.heappush(heap, (n.uses, last_use(n), p))

    for h, reason in purged.items():
        for c in nodes[h].chunks:
            plan.items.append(
                GcItem(
                    int(c.id),
                    h,
                    c.fingerprint,
                    c.blob_key,
                    int(c.stored_bytes),
                    reason,
                    c.last_seen_at,
                )
            )
    return plan


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

    A blob another kept chunk still names keeps its bytes and replicas (keys are
    content addressed). A replica whose bytes `delete_blob` could not delete stays,
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
            # 1. Lock the planned rows, in id order (as publishers lock theirs).
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
            nodes = _load(cat, conn, ns[0])
            protected, _ = _protected(cat, conn, ns[0], nodes, now)
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
            replicas = _mark_deleting(conn, live, ids, result, ns_name, actor, now)
            return live, replicas

    live, replicas = cat.db.retrying(mark)
    _delete_and_drop(cat, ns_name, live, replicas, delete_blob, result, actor, progress)
    return result


def _mark_deleting(
    conn: sa.Connection,
    live: list[GcItem],
    ids: set[int],
    result: GcResult,
    ns_name: str | None,
    actor: str | None,
    now: datetime,
) -> dict[str, list[str]]:
    """Mark the replicas of the purged chunks' blobs `deleting` (unless a kept chunk shares one)."""
    keys = sorted({i.blob_key for i in live})
    shared: set[str] = set()
    for batch in _batches(keys):
        for k, cid in conn.execute(
            sa.select(Chunk.blob_key, Chunk.id).where(Chunk.blob_key.in_(batch))
        ):
            if cid not in ids:
                shared.add(k)
    result.shared_blobs = sorted(shared)
    doomed = [k for k in keys if k not in shared]
    replicas: dict[str, list[str]] = {}
    for batch in _batches(doomed):
        conn.execute(sa.update(Replica).where(Replica.blob_key.in_(batch)).values(state="deleting"))
        for k, loc in conn.execute(
            sa.select(Replica.blob_key, Replica.location)
            .where(Replica.blob_key.in_(batch))
            .order_by(Replica.blob_key, Replica.location)
        ):
            replicas.setdefault(k, []).append(loc)
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


def resume_gc(
    cat: Catalog,
    delete_blob: DeleteBlob,
    *,
    actor: str | None = "gc",
    progress: Callable[[int], object] | None = None,
) -> GcResult:
    """Finish what an interrupted or partly failed GC left: chunks still `purging` and
    replicas still `deleting` whose blob no ready chunk names. Run under the GC lock.

    Until this runs, a publish of those chunks is refused with `PurgeInProgressError`
    (its bytes would be deleted under it), so `kvc gc` runs it before anything else.
    """
    result = GcResult()

    def mark() -> tuple[list[GcItem], dict[str, list[str]]]:
        with cat.db.write() as conn:
            now = utcnow()
            live = [
                GcItem(
                    int(r.id),
                    r.prefix_hash,
                    r.fingerprint,
                    r.blob_key,
                    int(r.stored_bytes),
                    "resumed",
                )
                for r in conn.execute(
                    sa.select(
                        Chunk.id,
                        Chunk.prefix_hash,
                        Chunk.fingerprint,
                        Chunk.blob_key,
                        Chunk.stored_bytes,
                    )
                    .where(Chunk.state == "purging")
                    .order_by(Chunk.id)
                    .with_for_update()
                )
            ]
            ids = {i.chunk_id for i in live}
            replicas = _mark_deleting(conn, live, ids, result, None, actor, now) if live else {}
            ready = sa.select(Chunk.id).where(
                Chunk.blob_key == Replica.blob_key, Chunk.state == "ready"
            )
            for k, loc in conn.execute(
                sa.select(Replica.blob_key, Replica.location)
                .where(Replica.state == "deleting", ~ready.exists())
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
