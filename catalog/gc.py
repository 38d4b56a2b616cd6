"""Catalog-side garbage collection, planning: the GC lock, roots and retention plans (`catalog.purge` applies them)."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa

from catalog.catalog import Catalog
from catalog.clock import utcnow
from catalog.errors import CatalogInputError, NotFoundError
from catalog.schema import Chunk, Demand, Lock, Pin, PrefixNode, Ref

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
class TreeNode:
    """A prefix node as GC sees it: its chunks, kept children, last use and size."""

    parent: bytes
    quarantined: bool
    created_at: datetime
    chunks: list[Any] = field(default_factory=list)
    children: int = 0  # children still kept
    last_use: datetime | None = None
    uses: int = 0
    size: int = 0


def _lineage(nodes: dict[bytes, TreeNode], start: bytes) -> Iterable[bytes]:
    h: bytes | None = start
    seen: set[bytes] = set()
    while h is not None and h in nodes and h not in seen:
        seen.add(h)
        yield h
        h = nodes[h].parent
    return


def protected_nodes(
    cat: Catalog, conn: sa.Connection, ns_id: int, nodes: dict[bytes, TreeNode], now: datetime
) -> tuple[set[bytes], int]:
    """The nodes GC must keep (roots and their lineage: refs, pins, live demand) and how many roots."""
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


def load_tree(cat: Catalog, conn: sa.Connection, ns_id: int) -> dict[bytes, TreeNode]:
    """The namespace's prefix tree with each node's chunks (what planning and applying read)."""
    nodes = {
        r.prefix_hash: TreeNode(r.parent_hash, bool(r.quarantined), r.created_at)
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
        nodes = load_tree(cat, conn, ns[0])
        protected, n_roots = protected_nodes(cat, conn, ns[0], nodes, now)
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

    def last_use(n: TreeNode) -> datetime:
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
