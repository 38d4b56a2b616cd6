"""The catalog's relational schema (SQLAlchemy 2 typed ORM); migrations/ mirrors it exactly."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

import numpy as np
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Token ids of a prefix node kept in its sibling index (128 bytes).
HEAD_TOKENS = 32

# Bumped with every migration; a database whose alembic revision differs is refused.

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to the catalog; use UTC-aware datetimes")
        if value is not None and dialect.name == "sqlite":
            # SQLite keeps text: normalise to UTC so string order is time order.
            return value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


Hash = LargeBinary(32)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


class Namespace(Base):
    """A tenant. Its chain root salts every prefix hash beneath it."""

    __tablename__ = "namespaces"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    chunk_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]


class FingerprintRow(Base):
    """A model-and-execution identity with the full descriptor that was hashed."""

    __tablename__ = "fingerprints"
    hex: Mapped[str] = mapped_column(String(64), primary_key=True)
    descriptor: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]


class NamespaceFingerprint(Base):
    """That a namespace registered (or published under) a fingerprint: a tenant sees only its own."""

    __tablename__ = "namespace_fingerprints"
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(ForeignKey("fingerprints.hex"), primary_key=True)
    created_at: Mapped[datetime]


def tokens_to_be(tokens: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
    """Big-endian uint32 token ids: byte order equals token order (see PrefixNode)."""
    return np.asarray(tokens, dtype=np.int64).astype(">u4").tobytes()


def be_to_tokens(data: bytes) -> tuple[int, ...]:
    """The token ids `tokens_to_be` encoded."""
    return tuple(int(t) for t in np.frombuffer(data, dtype=">u4"))


class PrefixNode(Base):
    """A chunk's place in a namespace's prefix tree: its tokens and the prefix it extends.

    `tokens_be` holds the token ids as big-endian uint32, so byte order is token
    order: the stored sibling sharing the longest prefix with a query is one of
    its two neighbours in that order. The index holds only `tokens_head`, the
    first HEAD_TOKENS ids (a full 1 KiB key would overflow SQLite's index pages
    and quadruple the index); see catalog.lookup for how both are used.
    """

    __tablename__ = "prefixes"
    prefix_hash: Mapped[bytes] = mapped_column(Hash, primary_key=True)
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"))
    parent_hash: Mapped[bytes] = mapped_column(Hash)
    token_start: Mapped[int] = mapped_column(BigInteger)
    token_count: Mapped[int] = mapped_column(Integer)
    depth: Mapped[int] = mapped_column(Integer)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False)
    quarantine_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    # Last: a lookup reads the columns above for hundreds of rows and never
    # needs to step over the (up to 1 KiB) token ids to reach them.
    tokens_head: Mapped[bytes] = mapped_column(LargeBinary)
    tokens_be: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (
        Index("ix_prefixes_parent_head", "parent_hash", "tokens_head"),
        Index("ix_prefixes_namespace", "namespace_id"),
        # A node found by its own leading tokens whatever its parent: an engine whose
        # chunk keys already commit to their prefix (SGLang's page keys) finds a page
        # from its key alone (`prefixes_with_tokens`).
        Index("ix_prefixes_namespace_head", "namespace_id", "tokens_head"),
        # Only the quarantined nodes (usually none): a lookup's walk excludes them
        # with one probe into this small index instead of reading each node's row.
        Index(
            "ix_prefixes_quarantined",
            "prefix_hash",
            sqlite_where=text("quarantined"),
            postgresql_where=text("quarantined"),
        ),
        CheckConstraint("token_count >= 1", name="token_count_positive"),
        CheckConstraint("token_start >= 0", name="token_start_nonneg"),
    )


class Chunk(Base):
    """The KV of one (fingerprint, prefix, shard): which blob holds it, and how it is used."""

    __tablename__ = "chunks"
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    fingerprint: Mapped[str] = mapped_column(ForeignKey("fingerprints.hex"))
    prefix_hash: Mapped[bytes] = mapped_column(ForeignKey("prefixes.prefix_hash"))
    layer_lo: Mapped[int] = mapped_column(Integer)
    layer_hi: Mapped[int] = mapped_column(Integer)
    head_lo: Mapped[int] = mapped_column(Integer)
    head_hi: Mapped[int] = mapped_column(Integer)
    blob_key: Mapped[str] = mapped_column(String(64))
    codec: Mapped[str] = mapped_column(String(32))
    stored_bytes: Mapped[int] = mapped_column(BigInteger)
    kv_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="ready")
    created_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]
    last_access_at: Mapped[datetime | None]
    access_count: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (
        Index(
            "uq_chunks_identity",
            "fingerprint",
            "prefix_hash",
            "layer_lo",
            "layer_hi",
            "head_lo",
            "head_hi",
            unique=True,
        ),
        Index("ix_chunks_prefix_hash", "prefix_hash"),
        Index("ix_chunks_blob_key", "blob_key"),
        # Only the chunks an interrupted GC left `purging` (usually none): every GC run
        # looks for them first (`resume_gc`), with the state written as a literal.
        Index(
            "ix_chunks_purging",
            "id",
            sqlite_where=text("state = 'purging'"),
            postgresql_where=text("state = 'purging'"),
        ),
        CheckConstraint("layer_lo >= 0 AND layer_hi > layer_lo", name="layer_range"),
        CheckConstraint("head_lo >= 0 AND head_hi > head_lo", name="head_range"),
        CheckConstraint("state IN ('ready', 'purging')", name="state_known"),
    )


class Store(Base):
    """A place blobs live: a local directory or an object-store bucket/prefix."""

    __tablename__ = "stores"
    name: Mapped[str] = mapped_column(String(1024), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    tier: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]


class Replica(Base):
    """Where a blob's bytes are (a store, or a worker's pool), with the receipt that proves it.

    A row is one namespace's claim: tenants sharing a store each hold their own rows, so a
    mark or a removal by one never changes what another reads, and GC deletes bytes only
    once no namespace holds a replica of them at that location.
    """

    __tablename__ = "replicas"
    blob_key: Mapped[str] = mapped_column(String(64))
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"))
    location: Mapped[str] = mapped_column(String(1024))
    tier: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    size: Mapped[int] = mapped_column(BigInteger)
    etag: Mapped[str | None] = mapped_column(String(255))
    version: Mapped[str | None] = mapped_column(String(255))
    checksum: Mapped[str] = mapped_column(String(255))
    stored_at: Mapped[datetime]
    last_verified_at: Mapped[datetime | None]
    worker: Mapped[str | None] = mapped_column(String(255))

    __table_args__ = (
        PrimaryKeyConstraint("blob_key", "namespace_id", "location"),
        CheckConstraint(
            "state IN ('durable', 'ready', 'corrupt', 'missing', 'deleting')", name="state_known"
        ),
        CheckConstraint("tier IN ('resident', 'local', 'object')", name="tier_known"),
        # A store's replicas in a state (GC refuses to run while any is `missing`).
        Index("ix_replicas_location_state", "location", "state"),
        # Only the replicas an interrupted GC left `deleting` (usually none), as above.
        Index(
            "ix_replicas_deleting",
            "blob_key",
            "location",
            sqlite_where=text("state = 'deleting'"),
            postgresql_where=text("state = 'deleting'"),
        ),
    )


class Ref(Base):
    """A named continuation, like a git branch: a head prefix plus the pending token."""

    __tablename__ = "refs"
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(ForeignKey("fingerprints.hex"))
    head_hash: Mapped[bytes] = mapped_column(ForeignKey("prefixes.prefix_hash"))
    processed: Mapped[int] = mapped_column(BigInteger)
    pending_token: Mapped[int | None] = mapped_column(BigInteger)
    forked_from: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    __table_args__ = (Index("ix_refs_head", "head_hash"),)


class Demand(Base):
    """A worker's declared interest in a prefix until it expires (a GC root while live)."""

    __tablename__ = "demand"
    worker: Mapped[str] = mapped_column(String(255))
    prefix_hash: Mapped[bytes] = mapped_column(Hash)
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"))
    priority: Mapped[float]
    expires_at: Mapped[datetime]

    __table_args__ = (
        # The namespace is part of the key: one tenant's declaration never takes the
        # place of another's for the same worker name and hash.
        PrimaryKeyConstraint("namespace_id", "worker", "prefix_hash"),
        Index("ix_demand_expires", "expires_at"),
    )


class Pin(Base):
    """An operator's hold on a prefix (and so its lineage): a GC root until it expires, if ever."""

    __tablename__ = "pins"
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    # No foreign key: an expired pin may outlive the prefix GC purged after it expired.
    prefix_hash: Mapped[bytes] = mapped_column(Hash)
    reason: Mapped[str | None] = mapped_column(String(1024))
    created_by: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_pins_prefix", "prefix_hash"),)


class Event(Base):
    """Append-only history: what happened, to what, by whom, with a monotonic sequence."""

    __tablename__ = "events"
    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(64))
    namespace: Mapped[str | None] = mapped_column(String(255))
    subject: Mapped[str | None] = mapped_column(String(1024))
    actor: Mapped[str | None] = mapped_column(String(255))
    details: Mapped[dict[str, Any]]

    __table_args__ = (
        Index("ix_events_at", "at"),
        Index("ix_events_kind", "kind"),
        Index("ix_events_subject", "subject"),
    )


class Lock(Base):
    """A named lease (e.g. "gc": one collector at a time); an expired one may be taken over."""

    __tablename__ = "locks"
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime]
    expires_at: Mapped[datetime]
