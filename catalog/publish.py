"""Publish: record chunks whose bytes are durable, in one transaction per batch (ARCHITECTURE.md section 4)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from catalog.base import DEFAULT_CHUNK_SIZE
from catalog.clock import utcnow
from catalog.database import batches
from catalog.errors import (
    MissingParentError,
    PublishError,
)
from catalog.identity import (
    Fingerprint,
    chain_hash,
    chain_root,
    is_hex64,
)
from catalog.models import (
    TIERS,
    ChunkRecord,
    Conflict,
    PublishResult,
)
from catalog.replicas import add_replicas
from catalog.schema import (
    HEAD_TOKENS,
    Chunk,
    PrefixNode,
    tokens_to_be,
)
from catalog.transactions import Database, hold

log = logging.getLogger(__name__)


def record_in(
    db: Database, conn: sa.Connection, records: Sequence[ChunkRecord], actor: str | None
) -> PublishResult:
    now = utcnow()
    recorded = present = replicas_added = 0
    conflicts: list[Conflict] = []
    ns_ids: dict[str, tuple[int, int]] = {}
    for r in records:
        if r.namespace not in ns_ids:
            ns = db.namespace(conn, r.namespace, create_chunk_size=DEFAULT_CHUNK_SIZE)
            assert ns is not None
            ns_ids[r.namespace] = ns
        db.ensure_fingerprint(conn, r.fingerprint, ns_ids[r.namespace][0])
    # Parents: the root, a node in this batch, or a catalogued node.
    own = {r.prefix_hash: r for r in records}
    needed = {r.parent_hash for r in records if r.token_start > 0 and r.parent_hash not in own}
    # Hold the nodes this batch extends or re-records before reading them: a GC
    # that marked them first makes this publish retry (PurgeInProgressError); one
    # that comes later waits for this transaction and then sees its children.
    hold(
        conn,
        [ns_id for ns_id, _ in ns_ids.values()],
        needed | set(own),
        "that this publish extends or re-records",
    )
    known = prefix_rows(conn, needed | set(own))
    for r in records:
        ns_id, chunk_size = ns_ids[r.namespace]
        mine = known.get(r.prefix_hash)
        if mine is not None and mine.namespace_id != ns_id:
            # Only a chain grafted onto another namespace's node could name it (and the
            # parent check below refuses those): answer as for any uncatalogued parent.
            raise MissingParentError(
                f"parent prefix {r.parent_hash.hex()} of chunk {r.prefix_hash.hex()} is not catalogued"
            )
        if r.token_start % chunk_size or len(r.tokens) > chunk_size:
            raise PublishError(
                f"chunk at token {r.token_start} with {len(r.tokens)} tokens does not fit "
                f"namespace {r.namespace!r}'s chunk size {chunk_size}"
            )
        if r.token_start == 0:
            continue
        parent = own.get(r.parent_hash) or known.get(r.parent_hash)
        if isinstance(parent, ChunkRecord) and parent.namespace != r.namespace:
            parent = None
        elif parent is not None and not isinstance(parent, ChunkRecord):
            # A parent in another namespace is a missing parent: a tenant's chain never
            # extends another's, whatever hashes it knows (they are computable).
            parent = parent if parent.namespace_id == ns_id else None
        if parent is None:
            raise MissingParentError(
                f"parent prefix {r.parent_hash.hex()} of chunk {r.prefix_hash.hex()} is not catalogued"
            )
        p_start, p_count = (
            (parent.token_start, len(parent.tokens))
            if isinstance(parent, ChunkRecord)
            else (parent.token_start, parent.token_count)
        )
        if p_start + p_count != r.token_start:
            raise PublishError(
                f"chunk {r.prefix_hash.hex()} starts at token {r.token_start} but its parent ends at {p_start + p_count}"
            )
    # Insert in key order so concurrent publishers lock rows in the same order.
    new_prefixes = [
        r for r in sorted(own.values(), key=lambda r: r.prefix_hash) if r.prefix_hash not in known
    ]
    if new_prefixes:
        conn.execute(
            db.insert(conn, PrefixNode).on_conflict_do_nothing(index_elements=["prefix_hash"]),
            [
                {
                    "prefix_hash": r.prefix_hash,
                    "namespace_id": ns_ids[r.namespace][0],
                    "parent_hash": r.parent_hash,
                    "token_start": r.token_start,
                    "token_count": len(r.tokens),
                    "tokens_be": tokens_to_be(r.tokens),
                    "tokens_head": tokens_to_be(r.tokens[:HEAD_TOKENS]),
                    "depth": r.token_start // ns_ids[r.namespace][1],
                    "quarantined": False,
                    "quarantine_reason": None,
                    "created_at": now,
                }
                for r in new_prefixes
            ],
        )
    quarantined = quarantined_among(conn, list(own))
    if quarantined:
        raise PublishError(
            f"prefix {sorted(quarantined)[0].hex()} is quarantined; refusing to publish under it"
        )
    # Chunks, replicas and stores in a fixed number of statements per batch.
    before = chunk_keys(conn, records)
    fresh: dict[tuple[Any, ...], ChunkRecord] = {}
    for r in records:
        if _ident(r) not in before:
            fresh.setdefault(_ident(r), r)
    if fresh:
        conn.execute(
            db.insert(conn, Chunk).on_conflict_do_nothing(),
            [
                {
                    "fingerprint": r.fingerprint.hex,
                    "prefix_hash": r.prefix_hash,
                    "layer_lo": r.shard.layer_lo,
                    "layer_hi": r.shard.layer_hi,
                    "head_lo": r.shard.head_lo,
                    "head_hi": r.shard.head_hi,
                    "blob_key": r.blob_key,
                    "codec": r.codec,
                    "stored_bytes": r.stored_bytes,
                    "kv_bytes": r.kv_bytes,
                    "state": "ready",
                    "created_at": now,
                    "last_seen_at": now,
                    "last_access_at": None,
                    "access_count": 0,
                }
                for _, r in sorted(fresh.items(), key=lambda kv: kv[1].prefix_hash)
            ],
        )
    after = chunk_keys(conn, records) if fresh else before
    kept_records: list[ChunkRecord] = []
    present_ids: list[tuple[bytes, int]] = []
    for r in records:
        chunk_id, kept = after[_ident(r)]
        if kept != r.blob_key:
            s = r.shard
            conflicts.append(Conflict(r.prefix_hash, kept, r.blob_key))
            db.event(
                conn,
                "conflict",
                r.namespace,
                r.prefix_hash.hex(),
                actor,
                {
                    "fingerprint": r.fingerprint.hex,
                    "kept": kept,
                    "rejected": r.blob_key,
                    "shard": [s.layer_lo, s.layer_hi, s.head_lo, s.head_hi],
                },
            )
            continue  # the rejected bytes get no replica rows
        kept_records.append(r)
        if _ident(r) in before:
            present += 1
            present_ids.append((r.prefix_hash, chunk_id))
        else:
            recorded += 1
    # A re-recorded chunk moves its last_seen_at (a GC planned before this publish
    # then spares it) only where the batch's chains end. Every node the batch
    # extends is spared through its child anyway (GC removes a node only with its
    # whole subtree), so publishes that share a system prompt do not all write, and
    # queue on, the same rows.
    extended = {r.parent_hash for r in kept_records if r.token_start > 0}
    seen_ids = sorted(chunk_id for h, chunk_id in present_ids if h not in extended)
    for batch in batches(seen_ids):
        if conn.dialect.name == "postgresql":
            # Lock before updating, in id order: publishes re-recording the same
            # chunks then queue instead of deadlocking (the UPDATE alone locks in
            # whatever order its plan visits the rows).
            conn.execute(
                sa.select(Chunk.id)
                .where(Chunk.id.in_(batch))
                .order_by(Chunk.id)
                .with_for_update(key_share=True)
            )
        conn.execute(sa.update(Chunk).where(Chunk.id.in_(batch)).values(last_seen_at=now))
    replicas_added = sum(
        add_replicas(
            db,
            conn,
            ns_id,
            [(r.blob_key, rc) for r in kept_records if r.namespace == name for rc in r.receipts],
            now,
        )
        for name, (ns_id, _) in sorted(ns_ids.items())
    )
    db.event(
        conn,
        "publish",
        records[0].namespace,
        records[-1].prefix_hash.hex(),
        actor,
        {
            "chunks": len(records),
            "recorded": recorded,
            "already_present": present,
            "conflicts": len(conflicts),
            "fingerprint": records[0].fingerprint.hex,
        },
    )
    return PublishResult(recorded, present, replicas_added, tuple(conflicts))


def chunk_keys(
    conn: sa.Connection, records: Sequence[ChunkRecord]
) -> dict[tuple[Any, ...], tuple[int, str]]:
    """(fingerprint, prefix, shard) -> (chunk id, blob key) of the catalogued chunks among `records`."""
    rows: list[Any] = []
    fps = sorted({r.fingerprint.hex for r in records})
    for batch in batches(sorted({r.prefix_hash for r in records})):
        rows += conn.execute(
            sa.select(
                Chunk.id,
                Chunk.fingerprint,
                Chunk.prefix_hash,
                Chunk.layer_lo,
                Chunk.layer_hi,
                Chunk.head_lo,
                Chunk.head_hi,
                Chunk.blob_key,
            ).where(Chunk.prefix_hash.in_(batch), Chunk.fingerprint.in_(fps))
        ).all()
    return {
        (r.fingerprint, r.prefix_hash, r.layer_lo, r.layer_hi, r.head_lo, r.head_hi): (
            r.id,
            r.blob_key,
        )
        for r in rows
    }


def prefix_rows(conn: sa.Connection, hashes: set[bytes]) -> dict[bytes, Any]:
    if not hashes:
        return {}
    rows: list[Any] = []
    for batch in batches(sorted(hashes)):
        rows += conn.execute(
            sa.select(
                PrefixNode.prefix_hash,
                PrefixNode.namespace_id,
                PrefixNode.token_start,
                PrefixNode.token_count,
            ).where(PrefixNode.prefix_hash.in_(batch))
        ).all()
    return {r.prefix_hash: r for r in rows}


def quarantined_among(conn: sa.Connection, hashes: list[bytes]) -> set[bytes]:
    out: set[bytes] = set()
    for batch in batches(hashes):
        out.update(
            conn.execute(
                sa.select(PrefixNode.prefix_hash).where(
                    PrefixNode.prefix_hash.in_(batch), PrefixNode.quarantined.is_(True)
                )
            ).scalars()
        )
    return out


def _ident(r: ChunkRecord) -> tuple[Any, ...]:
    s = r.shard
    return (r.fingerprint.hex, r.prefix_hash, s.layer_lo, s.layer_hi, s.head_lo, s.head_hi)


class Publishing:
    """`record_chunks`: ordered, idempotent publish of chunk records with their replica receipts."""

    db: Database

    def record_chunks(
        self, records: Sequence[ChunkRecord], *, actor: str | None = None
    ) -> PublishResult:
        """Record chunks whose bytes are durable (with receipts), parents first, in one transaction.

        Idempotent; a chunk whose parent is neither catalogued nor earlier in
        `records` is refused (`PublishError`) and nothing of the batch is recorded.
        """
        if not records:
            return PublishResult(0, 0, 0)
        ordered = sorted(records, key=lambda r: (r.namespace, r.token_start))
        for r in ordered:
            self._validate_record(r)
        return self.db.retrying(lambda: self._record(ordered, actor))

    def _validate_record(self, r: ChunkRecord) -> None:
        if not isinstance(r.fingerprint, Fingerprint):
            raise PublishError(
                "ChunkRecord.fingerprint must be a Fingerprint (its descriptor is stored)"
            )
        if len(r.prefix_hash) != 32 or len(r.parent_hash) != 32:
            raise PublishError("prefix_hash and parent_hash must be 32-byte hashes")
        if len(r.tokens) == 0:
            raise PublishError("a chunk must hold at least one token")
        if chain_hash(r.parent_hash, r.tokens) != r.prefix_hash:
            raise PublishError(
                f"prefix hash {r.prefix_hash.hex()} does not commit to its parent and tokens"
            )
        if r.token_start < 0:
            raise PublishError("token_start must be >= 0")
        if r.token_start == 0 and r.parent_hash != chain_root(r.namespace):
            raise PublishError("a chunk at token 0 must extend the namespace's chain root")
        r.shard.check_within(r.fingerprint.layout)
        if not is_hex64(r.blob_key):
            raise PublishError(f"blob key {r.blob_key!r:.80} is not a 64-hex digest")
        if not r.receipts:
            raise PublishError("a chunk is recorded only with at least one replica receipt")
        for rc in r.receipts:
            if rc.tier not in TIERS:
                raise PublishError(f"unknown tier {rc.tier!r}")
            if rc.size != r.stored_bytes:
                raise PublishError(
                    f"receipt from {rc.location} says {rc.size} bytes, the blob has {r.stored_bytes}"
                )

    def _record(self, records: Sequence[ChunkRecord], actor: str | None) -> PublishResult:
        with self.db.write() as conn:
            return record_in(self.db, conn, records, actor)
