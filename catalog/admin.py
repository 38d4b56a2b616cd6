"""Operator queries: what `kvc show`, `kvc stores`, fsck and GC read from the SQL catalog.

Read-only and typed: each function takes the SQL `Catalog`, runs one or a few
queries on its own connection and returns frozen values (never rows), so code
outside `catalog/` formats facts without knowing the schema.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from catalog.models import TIERS, EventInfo
from catalog.schema import Chunk, Event, Namespace, PrefixNode, Ref, Replica, Store

if TYPE_CHECKING:
    from catalog.catalog import Catalog

_BATCH = 500  # keys per IN (...) list

# What the database layer raises past the catalog's own errors (a broken query, a lost
# server): callers outside catalog/ catch these without importing SQLAlchemy.
DATABASE_ERRORS: tuple[type[Exception], ...] = (SQLAlchemyError,)


def database_error_detail(exc: BaseException) -> str:
    """One line naming a database error: its class and the driver's first message line."""
    detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
    return f"{exc.__class__.__name__}: {detail}"


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica of a blob, any state: where it is, its receipt, when last verified."""

    blob_key: str
    location: str
    tier: str
    state: str
    size: int
    worker: str | None
    checksum: str
    stored_at: datetime
    last_verified_at: datetime | None


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """One chunk at a prefix node: its fingerprint, shard, blob and use."""

    fingerprint: str
    layer_lo: int
    layer_hi: int
    head_lo: int
    head_hi: int
    blob_key: str
    codec: str
    stored_bytes: int
    kv_bytes: int
    created_at: datetime
    last_access_at: datetime | None
    access_count: int


@dataclass(frozen=True, slots=True)
class PrefixLinks:
    """What hangs on a prefix node: how many children extend it, which refs have it as head."""

    children: int
    refs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BlobChunk:
    """A chunk that names a blob: its prefix node and token range."""

    prefix_hash: bytes
    token_start: int
    token_end: int


@dataclass(frozen=True, slots=True)
class StoreRow:
    """A store the catalog knows (by name), with its kind and tier."""

    name: str
    kind: str
    tier: str


@dataclass(frozen=True, slots=True)
class ReplicaCount:
    """How many replicas at one location, of one tier, are in one state."""

    location: str
    tier: str
    state: str
    count: int


@dataclass(frozen=True, slots=True)
class ReplicaCheck:
    """What fsck checks of a replica: its blob, location, recorded state and receipt size."""

    blob_key: str
    location: str
    state: str
    size: int


def prefix_candidates(cat: Catalog, namespace: str, hexp: str, limit: int = 2) -> list[bytes]:
    """Prefix hashes in `namespace` starting with the hex string `hexp` (a range scan on the key)."""
    lo = bytes.fromhex(hexp.ljust(64, "0"))
    hi = bytes.fromhex(hexp.ljust(64, "f"))
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(PrefixNode.prefix_hash)
            .join(Namespace, Namespace.id == PrefixNode.namespace_id)
            .where(Namespace.name == namespace, PrefixNode.prefix_hash.between(lo, hi))
            .order_by(PrefixNode.prefix_hash)
            .limit(limit)
        ).scalars()
        return [bytes(h) for h in rows]


def blob_candidates(cat: Catalog, namespace: str, hexp: str, limit: int = 2) -> list[str]:
    """Blob keys of chunks in `namespace` starting with the hex string `hexp`."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk.blob_key)
            .distinct()
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .join(Namespace, Namespace.id == PrefixNode.namespace_id)
            .where(
                Namespace.name == namespace,
                Chunk.blob_key >= hexp,
                Chunk.blob_key <= hexp + "g",  # every hex continuation sorts below "g"
            )
            .order_by(Chunk.blob_key)
            .limit(limit)
        ).scalars()
        return list(rows)


def replicas_of(cat: Catalog, blob_keys: Sequence[str]) -> dict[str, list[ReplicaRow]]:
    """Every replica (any state) of these blobs, best tier first, then by location."""
    out: dict[str, list[ReplicaRow]] = {k: [] for k in blob_keys}
    if not blob_keys:
        return out
    rank = {t: i for i, t in enumerate(TIERS)}
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica).where(Replica.blob_key.in_(sorted(set(blob_keys))))
        ).all()
    for r in sorted(rows, key=lambda r: (rank.get(r.tier, 99), r.location)):
        out[r.blob_key].append(
            ReplicaRow(
                blob_key=r.blob_key,
                location=r.location,
                tier=r.tier,
                state=r.state,
                size=int(r.size),
                worker=r.worker,
                checksum=r.checksum,
                stored_at=r.stored_at,
                last_verified_at=r.last_verified_at,
            )
        )
    return out


def recent_events(cat: Catalog, subjects: Iterable[str], limit: int) -> list[EventInfo]:
    """The newest `limit` events whose subject is one of `subjects`, newest first."""
    wanted = sorted(set(subjects))
    if not wanted or limit <= 0:
        return []
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Event)
            .where(Event.subject.in_(wanted))
            .order_by(Event.seq.desc())
            .limit(limit)
        ).all()
    return [
        EventInfo(r.seq, r.at, r.kind, r.namespace, r.subject, r.actor, r.details) for r in rows
    ]


def chunks_at(cat: Catalog, prefix_hash: bytes) -> list[ChunkRow]:
    """The chunks (every fingerprint and shard) at a prefix node, oldest first."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk).where(Chunk.prefix_hash == prefix_hash).order_by(Chunk.id)
        ).all()
    return [
        ChunkRow(
            fingerprint=r.fingerprint,
            layer_lo=r.layer_lo,
            layer_hi=r.layer_hi,
            head_lo=r.head_lo,
            head_hi=r.head_hi,
            blob_key=r.blob_key,
            codec=r.codec,
            stored_bytes=int(r.stored_bytes),
            kv_bytes=int(r.kv_bytes),
            created_at=r.created_at,
            last_access_at=r.last_access_at,
            access_count=int(r.access_count),
        )
        for r in rows
    ]


def prefix_links(cat: Catalog, prefix_hash: bytes) -> PrefixLinks:
    """How many prefix nodes extend this one, and the names of the refs whose head it is."""
    with cat.engine.connect() as conn:
        children = conn.execute(
            sa.select(sa.func.count())
            .select_from(PrefixNode)
            .where(PrefixNode.parent_hash == prefix_hash)
        ).scalar_one()
        heads = conn.execute(
            sa.select(Ref.name).where(Ref.head_hash == prefix_hash).order_by(Ref.name)
        ).scalars()
        return PrefixLinks(children=int(children), refs=tuple(heads))


def chunks_of_blob(cat: Catalog, blob_key: str) -> list[BlobChunk]:
    """The chunks that name this blob key, with their prefix node's token range."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk.prefix_hash, PrefixNode.token_start, PrefixNode.token_count)
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .where(Chunk.blob_key == blob_key)
        ).all()
    return [
        BlobChunk(
            prefix_hash=bytes(r.prefix_hash),
            token_start=int(r.token_start),
            token_end=int(r.token_start) + int(r.token_count),
        )
        for r in rows
    ]


def replica_states(
    cat: Catalog, prefix_hashes: Sequence[bytes], fingerprint: str
) -> dict[str, int]:
    """Replica counts by state over the chunks of `fingerprint` at these prefix nodes."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica.state, sa.func.count())
            .join(Chunk, Chunk.blob_key == Replica.blob_key)
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .where(
                Chunk.prefix_hash.in_(list(prefix_hashes)),
                Chunk.fingerprint == fingerprint,
                PrefixNode.namespace_id == Replica.namespace_id,
            )
            .group_by(Replica.state)
            .order_by(Replica.state)
        ).all()
    return {s: int(n) for s, n in rows}


def known_stores(cat: Catalog) -> list[StoreRow]:
    """Every store the catalog has recorded a replica in, in the database's order."""
    with cat.engine.connect() as conn:
        rows = conn.execute(sa.select(Store)).all()
    return [StoreRow(name=r.name, kind=r.kind, tier=r.tier) for r in rows]


def replica_counts(cat: Catalog) -> list[ReplicaCount]:
    """Replica counts per (location, tier, state), in the database's order."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica.location, Replica.tier, Replica.state, sa.func.count()).group_by(
                Replica.location, Replica.tier, Replica.state
            )
        ).all()
    return [ReplicaCount(location=loc, tier=t, state=s, count=int(n)) for loc, t, s, n in rows]


# Which state of a blob's replica rows at one location (one per namespace holding it) fsck
# reports: the one that asks the most of it.
_CHECK_ORDER = {"missing": 0, "corrupt": 1, "deleting": 2, "durable": 3, "ready": 4}


def replicas_to_check(cat: Catalog, locations: Iterable[str]) -> list[ReplicaCheck]:
    """Every replica at these locations, once per (location, blob key) whatever the number of
    namespaces holding it, by location then blob key (what fsck walks)."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica.blob_key, Replica.location, Replica.state, Replica.size)
            .where(Replica.location.in_(sorted(set(locations))))
            .order_by(Replica.location, Replica.blob_key)
        ).all()
    out: dict[tuple[str, str], ReplicaCheck] = {}
    for r in rows:
        prev = out.get((r.location, r.blob_key))
        if prev is None or _CHECK_ORDER.get(r.state, 9) < _CHECK_ORDER.get(prev.state, 9):
            out[(r.location, r.blob_key)] = ReplicaCheck(
                r.blob_key, r.location, r.state, int(r.size)
            )
    return list(out.values())


def replicas_elsewhere(cat: Catalog, locations: Iterable[str]) -> dict[str, int]:
    """Replica counts at every location not among `locations`, by location."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica.location, sa.func.count())
            .where(Replica.location.not_in(sorted(set(locations))))
            .group_by(Replica.location)
            .order_by(Replica.location)
        ).all()
    return {loc: int(n) for loc, n in rows}


def count_replicas_in_state(cat: Catalog, locations: Iterable[str], state: str) -> int:
    """How many replicas at these locations are in `state` (e.g. `missing`, which stops GC)."""
    with cat.engine.connect() as conn:
        n: Any = conn.execute(
            sa.select(sa.func.count()).where(
                Replica.location.in_(list(locations)), Replica.state == state
            )
        ).scalar_one()
    return int(n)


def still_catalogued(cat: Catalog, location: str, keys: Sequence[str]) -> set[str]:
    """Which of these blob keys have a replica row at `location` now (in batches)."""
    out: set[str] = set()
    with cat.engine.connect() as conn:
        for i in range(0, len(keys), _BATCH):
            out.update(
                conn.execute(
                    sa.select(Replica.blob_key).where(
                        Replica.location == location, Replica.blob_key.in_(keys[i : i + _BATCH])
                    )
                ).scalars()
            )
    return out
