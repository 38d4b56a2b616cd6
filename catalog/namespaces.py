"""Namespaces, fingerprints, counts and the event history."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from catalog.base import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from catalog.errors import CatalogInputError
from catalog.identity import (
    Fingerprint,
    fingerprint_hex,
)
from catalog.models import (
    EventInfo,
)
from catalog.schema import (
    Chunk,
    Event,
    PrefixNode,
    Ref,
    Replica,
)
from catalog.transactions import Database

log = logging.getLogger(__name__)


def check_chunk_size(chunk_size: object) -> None:
    """Refuse a chunk size outside MIN_CHUNK_SIZE..MAX_CHUNK_SIZE, naming the bounds."""
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
    ):
        raise CatalogInputError(
            f"chunk_size must be an int in {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE}, got {chunk_size!r}"
        )


class Namespaces:
    """Namespaces and fingerprints (created on first use, cached), statistics and history."""

    db: Database

    def ensure_namespace(self, name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
        """Create the namespace if needed; return its chunk size (fixed at creation).

        A new namespace's `chunk_size` must be in MIN_CHUNK_SIZE..MAX_CHUNK_SIZE
        (`CatalogInputError`); an existing one keeps the size it was created with.
        """
        check_chunk_size(chunk_size)

        def run() -> int:
            with self.db.write() as conn:
                ns = self.db.namespace(conn, name, create_chunk_size=chunk_size)
                assert ns is not None
                return ns[1]

        return self.db.retrying(run)

    def namespace_chunk_size(self, name: str) -> int | None:
        with self.db.read() as conn:
            ns = self.db.namespace(conn, name)
        return None if ns is None else ns[1]

    def register_fingerprint(self, fp: Fingerprint, *, namespace: str | None = None) -> None:
        def run() -> None:
            with self.db.write() as conn:
                ns_id = None
                if namespace is not None:
                    ns = self.db.namespace(conn, namespace, create_chunk_size=DEFAULT_CHUNK_SIZE)
                    assert ns is not None
                    ns_id = ns[0]
                self.db.ensure_fingerprint(conn, fp, ns_id)

        self.db.retrying(run)

    def get_fingerprint(
        self, fp: Fingerprint | str, *, namespace: str | None = None
    ) -> Fingerprint | None:
        """The catalogued fingerprint (with its descriptor), or None; with `namespace`, only
        one that namespace registered or published under."""
        with self.db.read() as conn:
            if namespace is None:
                return self.db.fingerprint(conn, fingerprint_hex(fp))
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                return None
            return self.db.fingerprint(conn, fingerprint_hex(fp), ns[0])

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Counts and bytes for a namespace (or all): chunks, prefixes, refs, replicas by state."""
        with self.db.read() as conn:
            ns_filter: Any = sa.true()
            ns_id: int | None = None
            if namespace is not None:
                ns = self.db.namespace(conn, namespace)
                if ns is None:
                    return {
                        "namespace": namespace,
                        "chunks": 0,
                        "prefixes": 0,
                        "refs": 0,
                        "stored_bytes": 0,
                        "kv_bytes": 0,
                        "replicas": {},
                    }
                ns_id = ns[0]
                ns_filter = PrefixNode.namespace_id == ns_id
            chunks = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(Chunk.stored_bytes), 0),
                    sa.func.coalesce(sa.func.sum(Chunk.kv_bytes), 0),
                )
                .select_from(Chunk)
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .where(ns_filter)
            ).one()
            prefixes = conn.execute(
                sa.select(sa.func.count()).select_from(PrefixNode).where(ns_filter)
            ).scalar_one()
            refs_q = sa.select(sa.func.count()).select_from(Ref)
            if namespace is not None:
                refs_q = refs_q.join(PrefixNode, PrefixNode.prefix_hash == Ref.head_hash).where(
                    ns_filter
                )
            refs = conn.execute(refs_q).scalar_one()
            if ns_id is None:
                by_state = conn.execute(
                    sa.select(Replica.state, sa.func.count()).group_by(Replica.state)
                ).all()
            else:
                by_state = _namespace_replicas(conn, ns_id)
        return {
            "namespace": namespace,
            "chunks": int(chunks[0]),
            "stored_bytes": int(chunks[1]),
            "kv_bytes": int(chunks[2]),
            "prefixes": int(prefixes),
            "refs": int(refs),
            "replicas": {state: int(n) for state, n in by_state},
        }

    def events(
        self,
        *,
        namespace: str | None = None,
        kind: str | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[EventInfo]:
        q = sa.select(Event).where(Event.seq > since_seq).order_by(Event.seq).limit(limit)
        if namespace is not None:
            q = q.where(Event.namespace == namespace)
        if kind is not None:
            q = q.where(Event.kind == kind)
        with self.db.read() as conn:
            rows = conn.execute(q).all()
        return [
            EventInfo(r.seq, r.at, r.kind, r.namespace, r.subject, r.actor, r.details) for r in rows
        ]


def _namespace_replicas(conn: sa.Connection, ns_id: int) -> list[Any]:
    """(state, count) of namespace `ns_id`'s replicas, read from its own chunks.

    Replicas have no index by namespace (one drew SQLite's lookups into reading a
    namespace's every replica per chunk), so counting them by namespace read the whole
    table: 2 s at 7.3M chunks for one namespace's 74k. A replica of the namespace names
    the blob of one of its chunks (a blob's header names its one chunk), except those an
    interrupted GC left `deleting` after purging the chunk: the first are reached from
    the namespace's nodes, chunk by chunk, by key (the join names the node's namespace,
    not the constant, so that no planner starts from the replicas), the second through
    the small partial index of `deleting` replicas.
    """
    counts: dict[str, int] = {}
    for state, n in conn.execute(
        sa.select(Replica.state, sa.func.count())
        .select_from(PrefixNode)
        .join(Chunk, Chunk.prefix_hash == PrefixNode.prefix_hash)
        .join(
            Replica,
            (Replica.blob_key == Chunk.blob_key)
            & (Replica.namespace_id == PrefixNode.namespace_id),
        )
        .where(PrefixNode.namespace_id == ns_id, Replica.state != "deleting")
        .group_by(Replica.state)
    ):
        counts[state] = n
    deleting = conn.execute(
        sa.select(sa.func.count())
        .select_from(Replica)
        .where(Replica.state == "deleting", Replica.namespace_id == ns_id)
    ).scalar_one()
    if deleting:
        counts["deleting"] = deleting
    return list(counts.items())
