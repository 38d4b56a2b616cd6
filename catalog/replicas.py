"""Replicas: where a blob's bytes are, with receipts and states (durable, corrupt, missing, deleting)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from catalog.clock import utcnow
from catalog.database import batches
from catalog.errors import (
    CatalogInputError,
    NotFoundError,
    PurgeInProgressError,
)
from catalog.identity import (
    Fingerprint,
    fingerprint_hex,
)
from catalog.models import (
    Shard,
)
from catalog.schema import (
    Chunk,
    Namespace,
    PrefixNode,
    Replica,
    Store,
)
from catalog.transactions import Database

log = logging.getLogger(__name__)


def add_replicas(
    db: Database,
    conn: sa.Connection,
    ns_id: int,
    items: Sequence[tuple[str, Any]],
    now: datetime,
) -> int:
    """Insert namespace `ns_id`'s replica rows (each with its receipt); revive its known-broken
    ones; return how many are new.

    Refused (`PurgeInProgressError`) while a GC, of any namespace, is deleting the same bytes
    at the same location: the bytes this receipt vouches for would be gone under it.
    """
    if not items:
        return 0
    stores = sorted({rc.location: rc.tier for _, rc in items if rc.tier != "resident"}.items())
    if stores:
        conn.execute(
            db.insert(conn, Store).on_conflict_do_nothing(index_elements=["name"]),
            [
                {"name": n, "kind": n.split(":", 1)[0], "tier": t, "created_at": now}
                for n, t in stores
            ],
        )
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rc in items:
        rows[(key, rc.location)] = {
            "blob_key": key,
            "namespace_id": ns_id,
            "location": rc.location,
            "tier": rc.tier,
            "state": "durable",
            "size": rc.size,
            "etag": rc.etag,
            "version": rc.version,
            "checksum": rc.checksum,
            "stored_at": rc.stored_at,
            "last_verified_at": rc.stored_at,
            "worker": rc.worker,
        }
    keys = sorted({k for k, _ in rows})
    existing: dict[tuple[str, str], str] = {}
    deleting: list[tuple[str, str]] = []
    found: list[Any] = []
    for batch in batches(keys):
        found += conn.execute(
            sa.select(
                Replica.blob_key, Replica.namespace_id, Replica.location, Replica.state
            ).where(Replica.blob_key.in_(batch))
        ).all()
    for r in found:
        k = (r.blob_key, r.location)
        if k not in rows:
            continue
        if r.state == "deleting":
            deleting.append(k)
        if r.namespace_id == ns_id:
            existing[k] = r.state
    if deleting:
        key, loc = sorted(deleting)[0]
        raise PurgeInProgressError(
            f"GC is deleting blob {key} at {loc}; nothing was changed: "
            "put it again and retry once the GC run finishes"
        )
    new = [v for k, v in sorted(rows.items()) if k not in existing]
    if new:
        conn.execute(
            db.insert(conn, Replica).on_conflict_do_nothing(
                index_elements=["blob_key", "namespace_id", "location"]
            ),
            new,
        )
    # A fresh receipt for a replica known to be broken means the bytes were put
    # again: it is durable once more. Healthy replicas are left untouched.
    for k, state in existing.items():
        if state in ("missing", "corrupt"):
            values = {
                c: v
                for c, v in rows[k].items()
                if c not in ("blob_key", "namespace_id", "location")
            }
            conn.execute(
                sa.update(Replica)
                .where(
                    Replica.blob_key == k[0],
                    Replica.namespace_id == ns_id,
                    Replica.location == k[1],
                )
                .values(**values)
            )
    return len(new)


def _namespaces_holding(conn: sa.Connection, blob_key: str, namespace: str | None) -> list[int]:
    """Ids of the namespaces (only `namespace`, if given) with a chunk naming `blob_key`,
    their chunk rows locked; `NotFoundError` if none, `PurgeInProgressError` if GC has them."""
    q = (
        sa.select(PrefixNode.namespace_id, Chunk.state)
        .select_from(Chunk)
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .where(Chunk.blob_key == blob_key)
        .order_by(Chunk.id)
    )
    if namespace is not None:
        q = q.join(Namespace, Namespace.id == PrefixNode.namespace_id).where(
            Namespace.name == namespace
        )
    rows = conn.execute(q.with_for_update(of=Chunk)).all()
    if not rows:
        raise NotFoundError(f"no catalogued chunk has blob key {blob_key}")
    ready = sorted({r.namespace_id for r in rows if r.state == "ready"})
    if not ready:
        raise PurgeInProgressError(f"the chunk with blob key {blob_key} is being purged by GC")
    return ready


def _in_namespace(namespace: str | None) -> Any:
    """A clause keeping only `namespace`'s replica rows (every namespace's for None)."""
    if namespace is None:
        return sa.true()
    return Replica.namespace_id == (
        sa.select(Namespace.id).where(Namespace.name == namespace).scalar_subquery()
    )


class Replicas:
    """Replica rows: add with a receipt, mark, verify, list and forget per location."""

    db: Database

    def record_replica(
        self, blob_key: str, receipt: Any, *, namespace: str | None = None, actor: str | None = None
    ) -> bool:
        """Add a replica (with its receipt) of a catalogued blob, e.g. after a write-behind upload."""

        def run() -> bool:
            with self.db.write() as conn:
                added = 0
                now = utcnow()
                for ns_id in _namespaces_holding(conn, blob_key, namespace):
                    added += add_replicas(self.db, conn, ns_id, [(blob_key, receipt)], now)
                self.db.event(
                    conn,
                    "replica",
                    namespace,
                    blob_key,
                    actor,
                    {"location": receipt.location, "tier": receipt.tier},
                )
                return bool(added)

        return self.db.retrying(run)

    def mark_replica(
        self,
        blob_key: str,
        location: str,
        state: str,
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> bool:
        """Set a replica's state (`corrupt`, `missing`, `deleting`, `durable`) with an event saying why.

        With `namespace`, only that namespace's replica row changes (a tenant's reader
        marks what it read); without, every namespace's row of these bytes (fsck, which
        read the bytes themselves). Returns False when there is no such replica (nothing
        changes then).
        """
        if state not in ("durable", "ready", "corrupt", "missing", "deleting"):
            raise CatalogInputError(f"unknown replica state {state!r}")

        def run() -> bool:
            with self.db.write() as conn:
                res = conn.execute(
                    sa.update(Replica)
                    .where(
                        Replica.blob_key == blob_key,
                        Replica.location == location,
                        _in_namespace(namespace),
                        # GC owns a replica it is deleting; a reader that found it gone is not news.
                        Replica.state != "deleting" if state != "deleting" else sa.true(),
                    )
                    .values(state=state)
                )
                if res.rowcount < 1:
                    return False
                self.db.event(
                    conn,
                    f"replica.{state}",
                    namespace,
                    blob_key,
                    actor,
                    {"location": location, "reason": reason},
                )
                return True

        return self.db.retrying(run)

    def touch_verified(
        self, location: str, blob_keys: Sequence[str], *, namespace: str | None = None
    ) -> int:
        """Record that these replicas' bytes were just read back and verified (fsck --read-data)."""
        if not blob_keys:
            return 0

        def run() -> int:
            with self.db.write() as conn:
                res = conn.execute(
                    sa.update(Replica)
                    .where(
                        Replica.location == location,
                        Replica.blob_key.in_(sorted(blob_keys)),
                        _in_namespace(namespace),
                    )
                    .values(last_verified_at=utcnow())
                )
                return int(res.rowcount)

        return self.db.retrying(run)

    def replicas_at(self, location: str, *, namespace: str | None = None) -> list[str]:
        """Blob keys with a replica at `location` (a store name, or `worker:<id>`)."""
        with self.db.read() as conn:
            rows = conn.execute(
                sa.select(Replica.blob_key)
                .where(Replica.location == location, _in_namespace(namespace))
                .distinct()
                .order_by(Replica.blob_key)
            )
            return list(rows.scalars())

    def remove_replicas(
        self,
        location: str,
        blob_keys: Sequence[str],
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> int:
        """Forget replicas at `location` (e.g. pages a daemon no longer holds); returns how many."""
        if not blob_keys:
            return 0

        def run() -> int:
            with self.db.write() as conn:
                res = conn.execute(
                    sa.delete(Replica).where(
                        Replica.location == location,
                        Replica.blob_key.in_(sorted(blob_keys)),
                        _in_namespace(namespace),
                    )
                )
                self.db.event(
                    conn,
                    "replica.remove",
                    namespace,
                    location,
                    actor,
                    {"replicas": res.rowcount, "reason": reason},
                )
                return int(res.rowcount)

        return self.db.retrying(run)

    def holds_blob(self, namespace: str, blob_key: str) -> bool:
        """Whether a chunk of `namespace` has this blob key (the service's tenancy check)."""
        with self.db.read() as conn:
            found = conn.execute(
                sa.select(sa.literal(1))
                .select_from(Chunk)
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .join(Namespace, Namespace.id == PrefixNode.namespace_id)
                .where(Chunk.blob_key == blob_key, Namespace.name == namespace)
                .limit(1)
            ).first()
        return found is not None

    def known_blob_keys(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        prefix_hashes: Sequence[bytes],
        shard: Shard,
    ) -> dict[bytes, str]:
        """Which of these prefixes already have a chunk for this fingerprint and shard (one query)."""
        fp = fingerprint_hex(fingerprint)
        if not prefix_hashes:
            return {}
        rows: list[Any] = []
        with self.db.read() as conn:
            for batch in batches(list(prefix_hashes)):  # one bind variable per hash
                rows += conn.execute(
                    sa.select(Chunk.prefix_hash, Chunk.blob_key)
                    .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                    .join(Namespace, Namespace.id == PrefixNode.namespace_id)
                    .where(
                        Namespace.name == namespace,
                        Chunk.state == "ready",  # one GC is purging must be put again
                        Chunk.fingerprint == fp,
                        Chunk.prefix_hash.in_(batch),
                        Chunk.layer_lo == shard.layer_lo,
                        Chunk.layer_hi == shard.layer_hi,
                        Chunk.head_lo == shard.head_lo,
                        Chunk.head_hi == shard.head_hi,
                    )
                ).all()
        return {r.prefix_hash: r.blob_key for r in rows}
