"""The catalog: ordered publish records, token-exact lookup, refs, lineage, quarantine, history."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import numpy as np
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from catalog import database
from catalog.errors import (
    CatalogInputError,
    IdentityError,
    MissingParentError,
    NotFoundError,
    PublishError,
    PurgeInProgressError,
    RefConflictError,
)
from catalog.identity import (
    Fingerprint,
    chain_hash,
    chain_root,
    fingerprint_hex,
    prefix_hashes,
    token_array,
)
from catalog.models import (
    TIERS,
    USABLE_STATES,
    ChunkMatch,
    ChunkRecord,
    Conflict,
    EventInfo,
    InvalidationDirective,
    Match,
    PinInfo,
    PrefixInfo,
    PublishResult,
    RefInfo,
    ReplicaInfo,
    Shard,
)
from catalog.schema import (
    HEAD_TOKENS,
    Chunk,
    Demand,
    Event,
    FingerprintRow,
    Hash,
    Namespace,
    Pin,
    PrefixNode,
    Ref,
    Replica,
    Store,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CHUNK_SIZE = 256
_TIER_RANK = {t: i for i, t in enumerate(TIERS)}
_AFTER_COMMIT = "kvc_after_commit"  # conn.info key: callbacks run once the write commits
_RETRYABLE_PG = {"40001", "40P01"}  # serialization failure, deadlock detected


def utcnow() -> datetime:
    return datetime.now(UTC)


def tokens_to_be(tokens: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
    """Big-endian uint32 token ids: byte order equals token order (see PrefixNode)."""
    return np.asarray(tokens, dtype=np.int64).astype(">u4").tobytes()


def be_to_tokens(data: bytes) -> tuple[int, ...]:
    return tuple(int(t) for t in np.frombuffer(data, dtype=">u4"))


def _common_prefix(a: bytes, b: bytes) -> int:
    """Number of leading uint32 tokens shared by two big-endian token strings."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=">u4", count=n)
    y = np.frombuffer(b, dtype=">u4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class Catalog:
    """Facts about stored KV chunks, over SQLite or PostgreSQL; safe for many threads and processes.

    Open with `Catalog.open(url)`; close (or use as a context manager) to flush
    batched access statistics.
    """

    def __init__(self, engine: Engine, url: str, *, access_flush_s: float = 2.0) -> None:
        self.engine = engine
        self.url = database.safe_url(url)
        self._writer = engine.execution_options(kvc_write=True)
        self._ns_cache: dict[str, tuple[int, int]] = {}
        self._fp_cache: dict[str, Fingerprint] = {}
        self._access: list[tuple[str, Shard, list[bytes], datetime]] = []
        self._access_lock = threading.Lock()
        self._access_flush_s = access_flush_s
        self._flusher: threading.Thread | None = None
        self._closing = threading.Event()

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(cls, url: str, *, upgrade: bool = False, **kwargs: Any) -> Catalog:
        """Open the catalog at `url`; refuse a database of another schema revision.

        `upgrade=True` runs the migrations first (what `kvc init` does).
        """
        engine = database.create_engine(url)
        try:
            if upgrade:
                database.upgrade(engine)
            else:
                database.check_schema(engine, url)
        except Exception:
            engine.dispose()
            raise
        return cls(engine, url, **kwargs)

    def upgrade(self, revision: str = "head") -> None:
        database.upgrade(self.engine, revision)

    def current_revision(self) -> str | None:
        return database.current_revision(self.engine)

    def close(self) -> None:
        self._closing.set()
        if self._flusher is not None:
            self._flusher.join()
        self.flush_access()
        self.engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions --------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        pending: list[Callable[[], None]] = []
        with self._writer.begin() as conn:
            conn.info[_AFTER_COMMIT] = pending
            try:
                yield conn
            finally:
                conn.info.pop(_AFTER_COMMIT, None)
        for fn in pending:  # committed: now the caches may learn what it created
            fn()

    @staticmethod
    def _after_commit(conn: sa.Connection, fn: Callable[[], None]) -> None:
        """Run `fn` once `conn`'s write transaction commits (never if it rolls back)."""
        pending = conn.info.get(_AFTER_COMMIT)
        if pending is None:  # not in a _write transaction: nothing this created can roll back
            fn()
        else:
            pending.append(fn)

    def _retrying(self, fn: Callable[[], T], attempts: int = 8) -> T:
        """Run a write transaction, retrying deadlocks, serialization failures and busy SQLite."""
        for attempt in range(attempts):
            try:
                return fn()
            except (OperationalError, DBAPIError) as exc:
                code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
                busy = "database is locked" in str(exc.orig) or code in _RETRYABLE_PG
                if not busy or attempt == attempts - 1:
                    raise
                time.sleep(min(0.5, 0.01 * 2**attempt))
        raise AssertionError("unreachable")

    def _insert(self, conn: sa.Connection, table: Any) -> Any:
        dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
        return dialect.insert(table)

    # -- namespaces, fingerprints, stores ------------------------------------

    def _namespace(
        self, conn: sa.Connection, name: str, *, create_chunk_size: int | None = None
    ) -> tuple[int, int] | None:
        cached = self._ns_cache.get(name)
        if cached is not None:
            return cached
        row = conn.execute(
            sa.select(Namespace.id, Namespace.chunk_size).where(Namespace.name == name)
        ).first()
        if row is None and create_chunk_size is not None:
            chain_root(name)  # validates the name
            conn.execute(
                self._insert(conn, Namespace)
                .values(name=name, chunk_size=create_chunk_size, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["name"])
            )
            row = conn.execute(
                sa.select(Namespace.id, Namespace.chunk_size).where(Namespace.name == name)
            ).first()
        if row is None:
            return None
        found = (row[0], row[1])
        self._after_commit(conn, lambda: self._ns_cache.__setitem__(name, found))
        return found

    def ensure_namespace(self, name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
        """Create the namespace if needed; return its chunk size (fixed at creation)."""

        def run() -> int:
            with self._write() as conn:
                ns = self._namespace(conn, name, create_chunk_size=chunk_size)
                assert ns is not None
                return ns[1]

        return self._retrying(run)

    def namespace_chunk_size(self, name: str) -> int | None:
        with self.engine.connect() as conn:
            ns = self._namespace(conn, name)
        return None if ns is None else ns[1]

    def _ensure_fingerprint(self, conn: sa.Connection, fp: Fingerprint) -> None:
        if fp.hex in self._fp_cache:
            return
        conn.execute(
            self._insert(conn, FingerprintRow)
            .values(hex=fp.hex, descriptor=dict(fp.descriptor), created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["hex"])
        )
        # Cached only once committed: a refused publish must not leave the cache
        # believing its fingerprint is catalogued.
        self._after_commit(conn, lambda: self._fp_cache.__setitem__(fp.hex, fp))

    def register_fingerprint(self, fp: Fingerprint) -> None:
        def run() -> None:
            with self._write() as conn:
                self._ensure_fingerprint(conn, fp)

        self._retrying(run)

    def get_fingerprint(self, fp: Fingerprint | str) -> Fingerprint | None:
        """The catalogued fingerprint (with its descriptor), or None."""
        with self.engine.connect() as conn:
            return self._fingerprint(conn, fingerprint_hex(fp))

    # -- publish -------------------------------------------------------------

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
        return self._retrying(lambda: self._record(ordered, actor))

    def record_chunk(self, record: ChunkRecord, *, actor: str | None = None) -> PublishResult:
        return self.record_chunks([record], actor=actor)

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
        database_key_ok = len(r.blob_key) == 64 and all(c in "0123456789abcdef" for c in r.blob_key)
        if not database_key_ok:
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
        with self._write() as conn:
            return self._record_in(conn, records, actor)

    def _record_in(
        self, conn: sa.Connection, records: Sequence[ChunkRecord], actor: str | None
    ) -> PublishResult:
        now = utcnow()
        recorded = present = replicas_added = 0
        conflicts: list[Conflict] = []
        ns_ids: dict[str, tuple[int, int]] = {}
        for r in records:
            if r.namespace not in ns_ids:
                ns = self._namespace(conn, r.namespace, create_chunk_size=DEFAULT_CHUNK_SIZE)
                assert ns is not None
                ns_ids[r.namespace] = ns
            self._ensure_fingerprint(conn, r.fingerprint)
        # Parents: the root, a node in this batch, or a catalogued node.
        own = {r.prefix_hash: r for r in records}
        needed = {r.parent_hash for r in records if r.token_start > 0 and r.parent_hash not in own}
        # Hold the nodes this batch extends or re-records before reading them: a GC
        # that marked them first makes this publish retry (PurgeInProgressError); one
        # that comes later waits for this transaction and then sees its children.
        self._hold(conn, needed | set(own), "that this publish extends or re-records")
        known = self._prefix_rows(conn, needed | set(own))
        for r in records:
            chunk_size = ns_ids[r.namespace][1]
            if r.token_start % chunk_size or len(r.tokens) > chunk_size:
                raise PublishError(
                    f"chunk at token {r.token_start} with {len(r.tokens)} tokens does not fit "
                    f"namespace {r.namespace!r}'s chunk size {chunk_size}"
                )
            if r.token_start == 0:
                continue
            parent = own.get(r.parent_hash) or known.get(r.parent_hash)
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
            r
            for r in sorted(own.values(), key=lambda r: r.prefix_hash)
            if r.prefix_hash not in known
        ]
        if new_prefixes:
            conn.execute(
                self._insert(conn, PrefixNode).on_conflict_do_nothing(
                    index_elements=["prefix_hash"]
                ),
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
        quarantined = self._quarantined(conn, list(own))
        if quarantined:
            raise PublishError(
                f"prefix {sorted(quarantined)[0].hex()} is quarantined; refusing to publish under it"
            )
        # Chunks, replicas and stores in a fixed number of statements per batch.
        before = self._chunk_keys(conn, records)
        fresh: dict[tuple[Any, ...], ChunkRecord] = {}
        for r in records:
            if _ident(r) not in before:
                fresh.setdefault(_ident(r), r)
        if fresh:
            conn.execute(
                self._insert(conn, Chunk).on_conflict_do_nothing(),
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
        after = self._chunk_keys(conn, records) if fresh else before
        kept_records: list[ChunkRecord] = []
        seen_ids: list[int] = []
        for r in records:
            chunk_id, kept = after[_ident(r)]
            if kept != r.blob_key:
                s = r.shard
                conflicts.append(Conflict(r.prefix_hash, kept, r.blob_key))
                self._event(
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
                seen_ids.append(chunk_id)
            else:
                recorded += 1
        if seen_ids:
            if conn.dialect.name == "postgresql":
                # Lock before updating, in id order: publishes re-recording the same
                # chunks then queue instead of deadlocking (the UPDATE alone locks in
                # whatever order its plan visits the rows).
                conn.execute(
                    sa.select(Chunk.id)
                    .where(Chunk.id.in_(seen_ids))
                    .order_by(Chunk.id)
                    .with_for_update(key_share=True)
                )
            conn.execute(sa.update(Chunk).where(Chunk.id.in_(seen_ids)).values(last_seen_at=now))
        replicas_added = self._add_replicas(
            conn, [(r.blob_key, rc) for r in kept_records for rc in r.receipts], now
        )
        self._event(
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

    def _hold(self, conn: sa.Connection, hashes: set[bytes], what: str) -> list[Any]:
        """Lock the chunk rows of these prefix nodes and refuse if GC is purging any of them.

        On PostgreSQL the rows are share-locked (`FOR KEY SHARE`, in id order) until
        the transaction ends: that conflicts with GC's `FOR UPDATE` mark, so GC waits
        for this transaction (and then sees what it added), while publishes extending
        the same parent (a shared system prompt) do not wait for each other. SQLite's
        single writer is exclusive anyway.
        """
        if not hashes:
            return []
        rows = conn.execute(
            sa.select(Chunk.id, Chunk.prefix_hash, Chunk.state)
            .where(Chunk.prefix_hash.in_(sorted(hashes)))
            .order_by(Chunk.id)
            .with_for_update(read=True, key_share=True)
        ).all()
        purging = tuple(sorted({r.prefix_hash for r in rows if r.state == "purging"}))
        if purging:
            raise PurgeInProgressError(
                f"prefix {purging[0].hex()} {what} is being purged by GC; "
                "nothing was changed: retry once the GC run finishes",
                purging,
            )
        return list(rows)

    def _add_replicas(
        self, conn: sa.Connection, items: Sequence[tuple[str, Any]], now: datetime
    ) -> int:
        """Insert replica rows (each with its receipt); revive known-broken ones; return how many are new."""
        if not items:
            return 0
        stores = sorted({rc.location: rc.tier for _, rc in items if rc.tier != "resident"}.items())
        if stores:
            conn.execute(
                self._insert(conn, Store).on_conflict_do_nothing(index_elements=["name"]),
                [
                    {"name": n, "kind": n.split(":", 1)[0], "tier": t, "created_at": now}
                    for n, t in stores
                ],
            )
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for key, rc in items:
            rows[(key, rc.location)] = {
                "blob_key": key,
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
        existing = {
            (r.blob_key, r.location): r.state
            for r in conn.execute(
                sa.select(Replica.blob_key, Replica.location, Replica.state).where(
                    Replica.blob_key.in_(keys)
                )
            )
        }
        deleting = sorted(k for k, state in existing.items() if k in rows and state == "deleting")
        if deleting:
            key, loc = deleting[0]
            raise PurgeInProgressError(
                f"GC is deleting blob {key} at {loc}; nothing was changed: "
                "put it again and retry once the GC run finishes"
            )
        new = [v for k, v in sorted(rows.items()) if k not in existing]
        if new:
            conn.execute(
                self._insert(conn, Replica).on_conflict_do_nothing(
                    index_elements=["blob_key", "location"]
                ),
                new,
            )
        # A fresh receipt for a replica known to be broken means the bytes were put
        # again: it is durable once more. Healthy replicas are left untouched.
        for k, state in existing.items():
            if k in rows and state in ("missing", "corrupt"):
                values = {c: v for c, v in rows[k].items() if c not in ("blob_key", "location")}
                conn.execute(
                    sa.update(Replica)
                    .where(Replica.blob_key == k[0], Replica.location == k[1])
                    .values(**values)
                )
        return len(new)

    def _chunk_keys(
        self, conn: sa.Connection, records: Sequence[ChunkRecord]
    ) -> dict[tuple[Any, ...], tuple[int, str]]:
        """(fingerprint, prefix, shard) -> (chunk id, blob key) of the catalogued chunks among `records`."""
        rows = conn.execute(
            sa.select(
                Chunk.id,
                Chunk.fingerprint,
                Chunk.prefix_hash,
                Chunk.layer_lo,
                Chunk.layer_hi,
                Chunk.head_lo,
                Chunk.head_hi,
                Chunk.blob_key,
            ).where(
                Chunk.prefix_hash.in_(sorted({r.prefix_hash for r in records})),
                Chunk.fingerprint.in_(sorted({r.fingerprint.hex for r in records})),
            )
        ).all()
        return {
            (r.fingerprint, r.prefix_hash, r.layer_lo, r.layer_hi, r.head_lo, r.head_hi): (
                r.id,
                r.blob_key,
            )
            for r in rows
        }

    def _prefix_rows(self, conn: sa.Connection, hashes: set[bytes]) -> dict[bytes, Any]:
        if not hashes:
            return {}
        rows = conn.execute(
            sa.select(PrefixNode.prefix_hash, PrefixNode.token_start, PrefixNode.token_count).where(
                PrefixNode.prefix_hash.in_(list(hashes))
            )
        ).all()
        return {r.prefix_hash: r for r in rows}

    def _quarantined(self, conn: sa.Connection, hashes: list[bytes]) -> set[bytes]:
        rows = conn.execute(
            sa.select(PrefixNode.prefix_hash).where(
                PrefixNode.prefix_hash.in_(hashes), PrefixNode.quarantined.is_(True)
            )
        ).scalars()
        return set(rows)

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

        Returns False when there is no such replica (nothing changes then).
        """
        if state not in ("durable", "ready", "corrupt", "missing", "deleting"):
            raise CatalogInputError(f"unknown replica state {state!r}")

        def run() -> bool:
            with self._write() as conn:
                res = conn.execute(
                    sa.update(Replica)
                    .where(
                        Replica.blob_key == blob_key,
                        Replica.location == location,
                        # GC owns a replica it is deleting; a reader that found it gone is not news.
                        Replica.state != "deleting" if state != "deleting" else sa.true(),
                    )
                    .values(state=state)
                )
                if res.rowcount != 1:
                    return False
                self._event(
                    conn,
                    f"replica.{state}",
                    namespace,
                    blob_key,
                    actor,
                    {"location": location, "reason": reason},
                )
                return True

        return self._retrying(run)

    def touch_verified(
        self, location: str, blob_keys: Sequence[str], *, namespace: str | None = None
    ) -> int:
        """Record that these replicas' bytes were just read back and verified (fsck --read-data)."""
        if not blob_keys:
            return 0

        def run() -> int:
            with self._write() as conn:
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

        return self._retrying(run)

    def replicas_at(self, location: str, *, namespace: str | None = None) -> list[str]:
        """Blob keys with a replica at `location` (a store name, or `worker:<id>`)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(Replica.blob_key)
                .where(Replica.location == location, _in_namespace(namespace))
                .order_by(Replica.blob_key)
            )
            return list(rows.scalars())

    def holds_blob(self, namespace: str, blob_key: str) -> bool:
        """Whether a chunk of `namespace` has this blob key (the service's tenancy check)."""
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(sa.literal(1))
                .select_from(Chunk)
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .join(Namespace, Namespace.id == PrefixNode.namespace_id)
                .where(Chunk.blob_key == blob_key, Namespace.name == namespace)
                .limit(1)
            ).first()
        return found is not None

    def ping(self) -> None:
        """One round trip to the database (health checks); raises if it cannot be reached."""
        with self.engine.connect() as conn:
            conn.execute(sa.select(sa.literal(1)))

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
            with self._write() as conn:
                res = conn.execute(
                    sa.delete(Replica).where(
                        Replica.location == location,
                        Replica.blob_key.in_(sorted(blob_keys)),
                        _in_namespace(namespace),
                    )
                )
                self._event(
                    conn,
                    "replica.remove",
                    namespace,
                    location,
                    actor,
                    {"replicas": res.rowcount, "reason": reason},
                )
                return int(res.rowcount)

        return self._retrying(run)

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Counts and bytes for a namespace (or all): chunks, prefixes, refs, replicas by state."""
        with self.engine.connect() as conn:
            ns_filter: Any = sa.true()
            if namespace is not None:
                ns = self._namespace(conn, namespace)
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
                ns_filter = PrefixNode.namespace_id == ns[0]
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
            by_state = conn.execute(
                sa.select(Replica.state, sa.func.count())
                .where(
                    Replica.blob_key.in_(
                        sa.select(Chunk.blob_key)
                        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                        .where(ns_filter)
                    )
                )
                .group_by(Replica.state)
            ).all()
        return {
            "namespace": namespace,
            "chunks": int(chunks[0]),
            "stored_bytes": int(chunks[1]),
            "kv_bytes": int(chunks[2]),
            "prefixes": int(prefixes),
            "refs": int(refs),
            "replicas": {state: int(n) for state, n in by_state},
        }

    def record_replica(
        self, blob_key: str, receipt: Any, *, namespace: str | None = None, actor: str | None = None
    ) -> bool:
        """Add a replica (with its receipt) of a catalogued blob, e.g. after a write-behind upload."""

        def run() -> bool:
            with self._write() as conn:
                states = (
                    conn.execute(
                        sa.select(Chunk.state)
                        .where(Chunk.blob_key == blob_key)
                        .order_by(Chunk.id)
                        .with_for_update()
                    )
                    .scalars()
                    .all()
                )
                if not states:
                    raise NotFoundError(f"no catalogued chunk has blob key {blob_key}")
                if "ready" not in states:
                    raise PurgeInProgressError(
                        f"the chunk with blob key {blob_key} is being purged by GC"
                    )
                added = self._add_replicas(conn, [(blob_key, receipt)], utcnow())
                self._event(
                    conn,
                    "replica",
                    namespace,
                    blob_key,
                    actor,
                    {"location": receipt.location, "tier": receipt.tier},
                )
                return bool(added)

        return self._retrying(run)

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
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(Chunk.prefix_hash, Chunk.blob_key).where(
                    Chunk.state == "ready",  # one GC is purging must be put again
                    Chunk.fingerprint == fp,
                    Chunk.prefix_hash.in_(list(prefix_hashes)),
                    Chunk.layer_lo == shard.layer_lo,
                    Chunk.layer_hi == shard.layer_hi,
                    Chunk.head_lo == shard.head_lo,
                    Chunk.head_hi == shard.head_hi,
                )
            ).all()
        return {r.prefix_hash: r.blob_key for r in rows}

    # -- lookup --------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        shard: Shard | None = None,
        max_tokens: int | None = None,
    ) -> Match:
        """The longest restorable prefix of `tokens` (at most len - 1) and the chunks covering it.

        Two round trips at most, whatever the prompt length: every full chunk
        of the prompt at once, then the best partial sibling where the chain
        ends (namespaces and fingerprints are cached: they never change).
        Pass tokens as a uint32 numpy array to skip converting a list.
        """
        fp_hex = fingerprint_hex(fingerprint)
        tok = token_array(tokens)  # validates, with clear errors
        root = chain_root(namespace)  # validates the namespace
        n = int(tok.size)
        limit = n - 1
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise CatalogInputError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
            limit = min(limit, max_tokens)
        miss = Match(namespace, fp_hex, shard, n)
        if limit <= 0:
            return miss
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                return miss
            cs = ns[1]
            if shard is None:
                fp = self._fingerprint(conn, fp_hex)
                if fp is None:
                    return miss
                shard = Shard.full(fp.layout)
            # Full chunks that can serve at least one position below the limit.
            n_full = min(n // cs, -(-limit // cs))
            full = prefix_hashes(namespace, tok, cs, max_chunks=n_full) if n_full else []
            found = self._chunks_for(conn, fp_hex, shard, full)
            chunks: list[ChunkMatch] = []
            matched = 0
            parent = root
            for i, h in enumerate(full):
                row = found.get(h)
                if row is None:
                    break
                used = min(cs, limit - i * cs)
                chunks.append(_chunk_match(row, used))
                matched = i * cs + used
                parent = h
                if used < cs:
                    break
            if matched < limit and matched % cs == 0:
                q_be = tok[matched : matched + cs].astype(">u4").tobytes()
                partial = self._best_sibling(conn, fp_hex, shard, parent, q_be)
                if partial is not None:
                    used = min(partial[1], limit - matched)
                    chunks.append(_chunk_match(partial[0], used))
                    matched += used
        if chunks:
            self._note_access([c.prefix_hash for c in chunks], fp_hex, shard)
        return Match(namespace, fp_hex, shard, n, matched, tuple(chunks))

    def _fingerprint(self, conn: sa.Connection, hex_: str) -> Fingerprint | None:
        found = self._fp_cache.get(hex_)
        if found is None:
            desc = conn.execute(
                sa.select(FingerprintRow.descriptor).where(FingerprintRow.hex == hex_)
            ).scalar()
            if desc is None:
                return None
            found = self._fp_cache[hex_] = Fingerprint.from_descriptor(desc)
        return found

    def _chunks_for(
        self, conn: sa.Connection, fp_hex: str, shard: Shard, hashes: list[bytes]
    ) -> dict[bytes, _ChunkRow]:
        if not hashes:
            return {}
        # The hot query of a lookup, as plain driver SQL: with hundreds of
        # hashes, building and expanding a SQLAlchemy IN costs more than the
        # query itself. PostgreSQL takes the hashes as one bytea[] parameter.
        where = " AND ".join(
            [
                "c.fingerprint = {p}",
                "c.layer_lo = {p}",
                "c.layer_hi = {p}",
                "c.head_lo = {p}",
                "c.head_hi = {p}",
                "c.state = 'ready'",
                "p.quarantined = {false}",
                "r.state IN ('durable', 'ready')",
            ]
        )
        params: tuple[Any, ...]
        ident = (fp_hex, shard.layer_lo, shard.layer_hi, shard.head_lo, shard.head_hi)
        if conn.dialect.name == "sqlite":
            marks = ",".join("?" * len(hashes))
            sql = _HOT_SQL.format(hashes=f"IN ({marks})", where=where.format(p="?", false="0"))
            params = (*hashes, *ident)
        else:
            sql = _HOT_SQL.format(hashes="= ANY(%s)", where=where.format(p="%s", false="false"))
            params = (hashes, *ident)
        return _group(conn.exec_driver_sql(sql, params).all())

    def _best_sibling(
        self, conn: sa.Connection, fp_hex: str, shard: Shard, parent: bytes, q_be: bytes
    ) -> tuple[_ChunkRow, int] | None:
        rows = conn.execute(
            _sibling_statement(),
            {
                "fp": fp_hex,
                "layer_lo": shard.layer_lo,
                "layer_hi": shard.layer_hi,
                "head_lo": shard.head_lo,
                "head_hi": shard.head_hi,
                "parent": parent,
                "q_head": q_be[: 4 * HEAD_TOKENS],
                "q_be": q_be,
            },
        ).all()
        tokens_of = {r.prefix_hash: r.tokens_be for r in rows}
        best: tuple[_ChunkRow, int] | None = None
        for h, row in sorted(_group(rows).items()):
            shared = _common_prefix(q_be, tokens_of[h])
            if shared > (best[1] if best else 0):
                best = (row, shared)
        return best

    # -- access statistics (batched off the hot path) -------------------------

    def _note_access(self, prefixes: list[bytes], fp_hex: str, shard: Shard) -> None:
        # Lookups never write: they append here and a background thread folds
        # and flushes every `access_flush_s` (close() flushes the rest).
        with self._access_lock:
            self._access.append((fp_hex, shard, prefixes, utcnow()))
            if self._flusher is None and not self._closing.is_set():
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="kvc-access-flush", daemon=True
                )
                self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._closing.wait(self._access_flush_s):
            self.flush_access()

    def flush_access(self) -> None:
        """Write batched access counts and times (called periodically by lookups, and on close)."""
        with self._access_lock:
            noted, self._access = self._access, []
        if not noted:
            return
        pending: dict[tuple[str, bytes, Shard], tuple[int, datetime]] = {}
        for fp_hex, shard, prefixes, at in noted:
            for p in prefixes:
                n, _ = pending.get((fp_hex, p, shard), (0, at))
                pending[(fp_hex, p, shard)] = (n + 1, at)

        def run() -> None:
            with self._write() as conn:
                for (fp_hex, prefix, shard), (count, at) in sorted(
                    pending.items(), key=lambda kv: kv[0][1]
                ):
                    conn.execute(
                        sa.update(Chunk)
                        .where(
                            Chunk.fingerprint == fp_hex,
                            Chunk.prefix_hash == prefix,
                            Chunk.layer_lo == shard.layer_lo,
                            Chunk.layer_hi == shard.layer_hi,
                            Chunk.head_lo == shard.head_lo,
                            Chunk.head_hi == shard.head_hi,
                        )
                        .values(access_count=Chunk.access_count + count, last_access_at=at)
                    )

        try:
            self._retrying(run)
        except (OperationalError, DBAPIError) as exc:  # statistics must never fail a lookup
            log.warning("could not record access statistics: %s", exc.__class__.__name__)

    # -- demand ----------------------------------------------------------------

    def declare_demand(
        self,
        worker: str,
        namespace: str,
        prefix_hash: bytes,
        *,
        priority: float = 1.0,
        ttl_s: float = 3600,
    ) -> None:
        """A worker expects to need this prefix until now + ttl (a GC root while live)."""
        from datetime import timedelta

        def run() -> None:
            with self._write() as conn:
                ns = self._namespace(conn, namespace)
                if ns is None:
                    raise NotFoundError(f"no namespace {namespace!r}")
                expires = utcnow() + timedelta(seconds=ttl_s)
                stmt = self._insert(conn, Demand).values(
                    worker=worker,
                    prefix_hash=prefix_hash,
                    namespace_id=ns[0],
                    priority=priority,
                    expires_at=expires,
                )
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["worker", "prefix_hash"],
                        set_={"priority": priority, "expires_at": expires},
                    )
                )

        self._retrying(run)

    def demand(self, namespace: str, prefix_hashes: Sequence[bytes]) -> dict[bytes, float]:
        """The live demand (priority summed over workers) of each of these prefixes that has any."""
        if not prefix_hashes:
            return {}
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(Demand.prefix_hash, sa.func.sum(Demand.priority))
                .join(Namespace, Namespace.id == Demand.namespace_id)
                .where(
                    Namespace.name == namespace,
                    Demand.prefix_hash.in_(sorted(set(prefix_hashes))),
                    Demand.expires_at > utcnow(),
                )
                .group_by(Demand.prefix_hash)
            )
            return {bytes(h): float(p) for h, p in rows}

    # -- pins ------------------------------------------------------------------

    def pin(
        self,
        namespace: str,
        name: str,
        prefix_hash: bytes,
        *,
        ttl_s: float | None = None,
        reason: str | None = None,
        actor: str | None = None,
    ) -> PinInfo:
        """Keep `prefix_hash` and its lineage from GC, for `ttl_s` seconds or until unpinned.

        Setting an existing pin moves it (and resets its expiry). The prefix must be
        catalogued in `namespace` and not being purged.
        """
        _check_pin_name(name)
        _check_prefix_hash(prefix_hash)
        if ttl_s is not None and not (0 < ttl_s < 1e10):
            raise CatalogInputError("a pin's ttl must be a positive number of seconds")
        if reason is not None and len(reason) > 1024:
            raise CatalogInputError("a pin's reason is at most 1024 characters")

        def run() -> PinInfo:
            with self._write() as conn:
                ns_id, _head = self._ref_head(conn, namespace, prefix_hash)
                self._hold(conn, {prefix_hash}, "that the pin would name")
                now = utcnow()
                expires = None if ttl_s is None else now + timedelta(seconds=ttl_s)
                values = {
                    "prefix_hash": prefix_hash,
                    "reason": reason,
                    "created_by": actor,
                    "created_at": now,
                    "expires_at": expires,
                }
                conn.execute(
                    self._insert(conn, Pin)
                    .values(namespace_id=ns_id, name=name, **values)
                    .on_conflict_do_update(index_elements=["namespace_id", "name"], set_=values)
                )
                self._event(
                    conn,
                    "pin.set",
                    namespace,
                    name,
                    actor,
                    {
                        "prefix": prefix_hash.hex(),
                        "expires_at": None if expires is None else expires.isoformat(),
                        "reason": reason,
                    },
                )
                return PinInfo(namespace, name, prefix_hash, reason, actor, now, expires, True)

        return self._retrying(run)

    def unpin(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        """Remove a pin (NotFoundError when there is none by that name)."""

        self._delete_named(Pin, "pin", "pin.remove", namespace, name, actor)

    def list_pins(self, namespace: str, *, include_expired: bool = True) -> list[PinInfo]:
        """The namespace's pins by name; `live` tells which still protect their prefix."""
        now = utcnow()
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                return []
            rows = conn.execute(
                sa.select(Pin).where(Pin.namespace_id == ns[0]).order_by(Pin.name)
            ).all()
        out = [
            PinInfo(
                namespace,
                r.name,
                r.prefix_hash,
                r.reason,
                r.created_by,
                r.created_at,
                r.expires_at,
                r.expires_at is None or r.expires_at > now,
            )
            for r in rows
        ]
        return out if include_expired else [p for p in out if p.live]

    # -- refs ------------------------------------------------------------------

    def create_ref(
        self,
        namespace: str,
        name: str,
        fingerprint: Fingerprint | str,
        head_hash: bytes,
        *,
        pending_token: int | None = None,
        forked_from: str | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        """Create a named continuation at `head_hash` (which must be catalogued in `namespace`)."""
        fp_hex = fingerprint_hex(fingerprint)
        _check_ref_name(name)

        def run() -> RefInfo:
            with self._write() as conn:
                ns_id, head = self._ref_head(conn, namespace, head_hash)
                self._hold(conn, {head_hash}, "that the ref would name")
                if (
                    conn.execute(
                        sa.select(FingerprintRow.hex).where(FingerprintRow.hex == fp_hex)
                    ).first()
                    is None
                ):
                    raise NotFoundError(f"fingerprint {fp_hex} is not catalogued")
                now = utcnow()
                try:
                    with conn.begin_nested():
                        conn.execute(
                            sa.insert(Ref).values(
                                namespace_id=ns_id,
                                name=name,
                                fingerprint=fp_hex,
                                head_hash=head_hash,
                                processed=head.token_start + head.token_count,
                                pending_token=pending_token,
                                forked_from=forked_from,
                                created_at=now,
                                updated_at=now,
                            )
                        )
                except IntegrityError as exc:
                    raise RefConflictError(
                        f"ref {name!r} already exists in namespace {namespace!r}"
                    ) from exc
                self._event(
                    conn,
                    "ref.create",
                    namespace,
                    name,
                    actor,
                    {"head": head_hash.hex(), "forked_from": forked_from},
                )
                return self._get_ref(conn, namespace, ns_id, name)

        return self._retrying(run)

    def _ref_head(self, conn: sa.Connection, namespace: str, head_hash: bytes) -> tuple[int, Any]:
        ns = self._namespace(conn, namespace)
        if ns is None:
            raise NotFoundError(f"no namespace {namespace!r}")
        head = conn.execute(
            sa.select(PrefixNode.token_start, PrefixNode.token_count).where(
                PrefixNode.prefix_hash == head_hash, PrefixNode.namespace_id == ns[0]
            )
        ).first()
        if head is None:
            raise NotFoundError(
                f"prefix {head_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return ns[0], head

    def _get_ref(self, conn: sa.Connection, namespace: str, ns_id: int, name: str) -> RefInfo:
        row = conn.execute(
            sa.select(Ref).where(Ref.namespace_id == ns_id, Ref.name == name)
        ).first()
        if row is None:
            raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
        return RefInfo(
            namespace,
            row.name,
            row.fingerprint,
            row.head_hash,
            row.processed,
            row.pending_token,
            row.forked_from,
            row.created_at,
            row.updated_at,
        )

    def get_ref(self, namespace: str, name: str) -> RefInfo:
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
            return self._get_ref(conn, namespace, ns[0], name)

    def list_refs(self, namespace: str) -> list[RefInfo]:
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                return []
            rows = conn.execute(
                sa.select(Ref).where(Ref.namespace_id == ns[0]).order_by(Ref.name)
            ).all()
            return [
                RefInfo(
                    namespace,
                    r.name,
                    r.fingerprint,
                    r.head_hash,
                    r.processed,
                    r.pending_token,
                    r.forked_from,
                    r.created_at,
                    r.updated_at,
                )
                for r in rows
            ]

    def update_ref(
        self,
        namespace: str,
        name: str,
        *,
        expected_head: bytes,
        new_head: bytes,
        pending_token: int | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        """Move a ref from `expected_head` to `new_head`; a concurrent mover wins, this raises RefConflictError."""

        def run() -> RefInfo:
            with self._write() as conn:
                ns_id, head = self._ref_head(conn, namespace, new_head)
                self._hold(conn, {new_head}, "that the ref would name")
                res = conn.execute(
                    sa.update(Ref)
                    .where(
                        Ref.namespace_id == ns_id, Ref.name == name, Ref.head_hash == expected_head
                    )
                    .values(
                        head_hash=new_head,
                        processed=head.token_start + head.token_count,
                        pending_token=pending_token,
                        updated_at=utcnow(),
                    )
                )
                if res.rowcount != 1:
                    current = conn.execute(
                        sa.select(Ref.head_hash).where(Ref.namespace_id == ns_id, Ref.name == name)
                    ).scalar()
                    if current is None:
                        raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
                    raise RefConflictError(
                        f"ref {name!r} moved: expected head {expected_head.hex()[:16]}, found {current.hex()[:16]}"
                    )
                self._event(
                    conn,
                    "ref.update",
                    namespace,
                    name,
                    actor,
                    {"from": expected_head.hex(), "to": new_head.hex()},
                )
                return self._get_ref(conn, namespace, ns_id, name)

        return self._retrying(run)

    def fork_ref(
        self, namespace: str, source: str, name: str, *, actor: str | None = None
    ) -> RefInfo:
        """A new ref at the same head as `source`, remembering where it was forked from."""
        src = self.get_ref(namespace, source)
        return self.create_ref(
            namespace,
            name,
            src.fingerprint,
            src.head_hash,
            pending_token=src.pending_token,
            forked_from=source,
            actor=actor,
        )

    def delete_ref(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        self._delete_named(Ref, "ref", "ref.delete", namespace, name, actor)

    def _delete_named(
        self, table: Any, what: str, event: str, namespace: str, name: str, actor: str | None
    ) -> None:
        """Delete the row `name` of a (namespace_id, name) table, with an event; else NotFound."""

        def run() -> None:
            with self._write() as conn:
                ns = self._namespace(conn, namespace)
                res = (
                    None
                    if ns is None
                    else conn.execute(
                        sa.delete(table).where(table.namespace_id == ns[0], table.name == name)
                    )
                )
                if res is None or res.rowcount != 1:
                    raise NotFoundError(f"no {what} {name!r} in namespace {namespace!r}")
                self._event(conn, event, namespace, name, actor, {})

        self._retrying(run)

    # -- lineage and quarantine ------------------------------------------------

    def get_prefix(self, namespace: str, prefix_hash: bytes) -> PrefixInfo:
        _check_prefix_hash(prefix_hash)
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            row = (
                None
                if ns is None
                else conn.execute(
                    sa.select(PrefixNode).where(
                        PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0]
                    )
                ).first()
            )
        if row is None:
            raise NotFoundError(
                f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return _prefix_info(row)

    def lineage(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """The chain from the root to `prefix_hash`, root first (one recursive query)."""
        _check_prefix_hash(prefix_hash)
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no namespace {namespace!r}")
            up = (
                sa.select(PrefixNode.prefix_hash, PrefixNode.parent_hash)
                .where(PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0])
                .cte("up", recursive=True)
            )
            up = up.union_all(
                sa.select(PrefixNode.prefix_hash, PrefixNode.parent_hash).join(
                    up, PrefixNode.prefix_hash == up.c.parent_hash
                )
            )
            rows = conn.execute(
                sa.select(PrefixNode)
                .join(up, PrefixNode.prefix_hash == up.c.prefix_hash)
                .order_by(PrefixNode.token_start)
            ).all()
        if not rows:
            raise NotFoundError(
                f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return [_prefix_info(r) for r in rows]

    def _descendants_cte(self, ns_id: int, prefix_hash: bytes) -> Any:
        down = (
            sa.select(PrefixNode.prefix_hash)
            .where(PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns_id)
            .cte("down", recursive=True)
        )
        return down.union_all(
            sa.select(PrefixNode.prefix_hash).join(
                down, PrefixNode.parent_hash == down.c.prefix_hash
            )
        )

    def descendants(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """Every node below `prefix_hash` (not itself), in token order."""
        _check_prefix_hash(prefix_hash)
        with self.engine.connect() as conn:
            ns = self._namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no namespace {namespace!r}")
            down = self._descendants_cte(ns[0], prefix_hash)
            rows = conn.execute(
                sa.select(PrefixNode)
                .join(down, PrefixNode.prefix_hash == down.c.prefix_hash)
                .where(PrefixNode.prefix_hash != prefix_hash)
                .order_by(PrefixNode.token_start, PrefixNode.prefix_hash)
            ).all()
        return [_prefix_info(r) for r in rows]

    def quarantine(
        self, namespace: str, prefix_hash: bytes, reason: str, *, actor: str | None = None
    ) -> list[InvalidationDirective]:
        """Make a node and all its descendants unrestorable at once; return one directive per replica."""
        _check_prefix_hash(prefix_hash)
        if not reason or not reason.strip():
            raise CatalogInputError("a quarantine needs a reason")

        def run() -> list[InvalidationDirective]:
            with self._write() as conn:
                ns = self._namespace(conn, namespace)
                if (
                    ns is None
                    or conn.execute(
                        sa.select(PrefixNode.prefix_hash).where(
                            PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0]
                        )
                    ).first()
                    is None
                ):
                    raise NotFoundError(
                        f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
                    )
                down = self._descendants_cte(ns[0], prefix_hash)
                affected = sa.select(down.c.prefix_hash)
                conn.execute(
                    sa.update(PrefixNode)
                    .where(PrefixNode.prefix_hash.in_(affected))
                    .values(quarantined=True, quarantine_reason=reason)
                )
                down2 = self._descendants_cte(ns[0], prefix_hash)
                rows = conn.execute(
                    sa.select(
                        Replica.location,
                        Replica.blob_key,
                        Replica.tier,
                        Replica.worker,
                        Chunk.prefix_hash,
                    )
                    .join(Chunk, Chunk.blob_key == Replica.blob_key)
                    .where(Chunk.prefix_hash.in_(sa.select(down2.c.prefix_hash)))
                    .order_by(Chunk.prefix_hash, Replica.location)
                ).all()
                directives = [
                    InvalidationDirective(r.location, r.blob_key, r.tier, r.worker, r.prefix_hash)
                    for r in rows
                ]
                self._event(
                    conn,
                    "quarantine",
                    namespace,
                    prefix_hash.hex(),
                    actor,
                    {"reason": reason, "replicas": len(directives)},
                )
                for d in directives:
                    self._event(
                        conn,
                        "invalidate",
                        namespace,
                        d.blob_key,
                        actor,
                        {
                            "location": d.location,
                            "tier": d.tier,
                            "worker": d.worker,
                            "prefix": d.prefix_hash.hex(),
                            "reason": reason,
                        },
                    )
                return directives

        return self._retrying(run)

    # -- history ---------------------------------------------------------------

    def _event(
        self,
        conn: sa.Connection,
        kind: str,
        namespace: str | None,
        subject: str | None,
        actor: str | None,
        details: dict[str, Any],
    ) -> None:
        conn.execute(
            sa.insert(Event).values(
                at=utcnow(),
                kind=kind,
                namespace=namespace,
                subject=subject,
                actor=actor,
                details=details,
            )
        )

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
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        return [
            EventInfo(r.seq, r.at, r.kind, r.namespace, r.subject, r.actor, r.details) for r in rows
        ]


def _ident(r: ChunkRecord) -> tuple[Any, ...]:
    s = r.shard
    return (r.fingerprint.hex, r.prefix_hash, s.layer_lo, s.layer_hi, s.head_lo, s.head_hi)


def _in_namespace(namespace: str | None) -> Any:
    """A clause on `Replica` keeping only blobs of `namespace`'s chunks (everything for None)."""
    if namespace is None:
        return sa.true()
    return Replica.blob_key.in_(
        sa.select(Chunk.blob_key)
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .join(Namespace, Namespace.id == PrefixNode.namespace_id)
        .where(Namespace.name == namespace)
    )


def _check_prefix_hash(prefix_hash: Any) -> bytes:
    if not isinstance(prefix_hash, bytes) or len(prefix_hash) != 32:
        raise IdentityError(f"prefix hash must be 32 bytes, got {prefix_hash!r:.80}")
    return prefix_hash


@functools.cache
def _sibling_statement() -> Any:
    """The best-sibling probe of a lookup, built once with bind parameters.

    The sibling sharing the longest prefix with q is q's neighbour in token order.
    The index orders siblings by their first HEAD_TOKENS ids only: two probes find
    the neighbours by that head, and two more order just the siblings whose head
    equals q's by their full token ids (the rare case of siblings agreeing on their
    first HEAD_TOKENS tokens). All in one statement, so one round trip. Built once
    (not per lookup) so SQLAlchemy's compiled cache and psycopg's prepared
    statements apply: building it cost more than running it.
    """
    fp = sa.bindparam("fp", type_=sa.String())
    layer_lo, layer_hi, head_lo, head_hi = (
        sa.bindparam(name, type_=sa.Integer())
        for name in ("layer_lo", "layer_hi", "head_lo", "head_hi")
    )
    q_head = sa.bindparam("q_head", type_=Hash)
    q_be = sa.bindparam("q_be", type_=sa.LargeBinary())
    ident = (
        Chunk.fingerprint == fp,
        Chunk.layer_lo == layer_lo,
        Chunk.layer_hi == layer_hi,
        Chunk.head_lo == head_lo,
        Chunk.head_hi == head_hi,
        Chunk.state == "ready",
    )
    usable = (
        sa.select(sa.literal(1))
        .select_from(Chunk)
        .join(Replica, Replica.blob_key == Chunk.blob_key)
        .where(
            Chunk.prefix_hash == PrefixNode.prefix_hash,
            *ident,
            Replica.state.in_(USABLE_STATES),
        )
        .exists()
    )
    base = sa.select(PrefixNode.prefix_hash).where(
        PrefixNode.parent_hash == sa.bindparam("parent", type_=Hash),
        PrefixNode.quarantined.is_(False),
        usable,
    )
    head, full = PrefixNode.tokens_head, PrefixNode.tokens_be
    same = base.where(head == q_head)
    probes = [
        base.where(head <= q_head).order_by(head.desc()).limit(1),
        base.where(head > q_head).order_by(head.asc()).limit(1),
        same.where(full <= q_be).order_by(full.desc()).limit(1),
        same.where(full > q_be).order_by(full.asc()).limit(1),
    ]
    # At most four candidates, computed once: materialized, so that no plan (say one
    # made on a young table's stale statistics) re-runs the probes per chunk row.
    candidates = (
        sa.union_all(*(sa.select(p.subquery()) for p in probes))
        .cte("sibling_candidates")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    return (
        sa.select(
            Chunk.prefix_hash,
            PrefixNode.parent_hash,
            Chunk.blob_key,
            PrefixNode.token_start,
            PrefixNode.token_count,
            Chunk.codec,
            Chunk.stored_bytes,
            Chunk.kv_bytes,
            Replica.location,
            Replica.tier,
            Replica.state,
            Replica.size,
            Replica.worker,
            PrefixNode.tokens_be,
        )
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .join(Replica, Replica.blob_key == Chunk.blob_key)
        .where(
            *ident,
            PrefixNode.quarantined.is_(False),
            Replica.state.in_(USABLE_STATES),
            Chunk.prefix_hash.in_(sa.select(candidates.c.prefix_hash)),
        )
    )


def _check_pin_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 255 or not name.isprintable():
        raise CatalogInputError(f"invalid pin name {name!r:.80}: 1-255 printable characters")


def _check_ref_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or any(c in name for c in "\x00\n\r")
    ):
        raise CatalogInputError(f"invalid ref name {name!r:.80}: 1-255 printable characters")


def _prefix_info(row: Any) -> PrefixInfo:
    return PrefixInfo(
        row.prefix_hash,
        row.parent_hash,
        row.token_start,
        be_to_tokens(row.tokens_be),
        row.depth,
        row.quarantined,
        row.quarantine_reason,
    )


# A chunk row of a lookup and its usable replicas, best tier first.
_ChunkRow = tuple[Any, tuple[ReplicaInfo, ...]]


def _chunk_match(row: _ChunkRow, used: int) -> ChunkMatch:
    r, replicas = row
    return ChunkMatch(r[0], r[1], r[2], r[3], r[4], used, r[5], r[6], r[7], replicas)


def _group(rows: Sequence[Any]) -> dict[bytes, _ChunkRow]:
    """Fold chunk x replica rows into one entry per chunk, replicas best tier first."""
    out: dict[bytes, _ChunkRow] = {}
    for r in rows:
        h = r[0]
        rep = ReplicaInfo(r[8], r[9], r[10], r[11], r[12])
        prev = out.get(h)
        if prev is None:
            out[h] = (r, (rep,))
        else:
            reps = sorted((*prev[1], rep), key=lambda x: (_TIER_RANK.get(x.tier, 99), x.location))
            out[h] = (prev[0], tuple(reps))
    return out


# Columns in the order of _sibling_statement and _HOT_SQL (the rows _group folds).
_HOT_SQL = (
    "SELECT c.prefix_hash, p.parent_hash, c.blob_key, p.token_start, p.token_count, c.codec,"
    " c.stored_bytes, c.kv_bytes, r.location, r.tier, r.state, r.size, r.worker"
    " FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash"
    " JOIN replicas r ON r.blob_key = c.blob_key"
    " WHERE c.prefix_hash {hashes} AND {where}"
)
