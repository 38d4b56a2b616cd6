"""The synthetic catalog of `bench_catalog.py` (and `profile_lookup.py`): its chains, the
rows `record_chunks` would write for them, and the bulk fill.

Chain `seed` belongs to namespace `seed % namespaces` (the probe namespace `bench`, then
`bench-01`...). Each namespace's first chain goes through `record_chunks` (the publish
path, which also registers the namespace's fingerprint); the rest are synthetic chains
(real chain hashes, random token ids) written as the same prefix, chunk and replica rows,
in batches of 32 chains: plain INSERTs on SQLite, COPY on PostgreSQL (then VACUUM
ANALYZE). Every tenth chain of a namespace was last used 30 days ago: GC's garbage.
"""

from __future__ import annotations

import sys
import tempfile
import time
import urllib.parse
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog import AttentionLayout, Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.identity import prefix_hashes
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from catalog.schema import HEAD_TOKENS, Chunk, PrefixNode, Replica

CS = 256
CHAIN_CHUNKS = 512  # 128k tokens
LAYOUT = AttentionLayout(28, 4, 128, "float16")
FP = Fingerprint.create(weights="bench", architecture="llama", config={}, attention_layout=LAYOUT)
SHARD = Shard.full(LAYOUT)
# The store every replica row names: an empty local directory (GC deletes nothing there).
STORE_DIR = Path(tempfile.gettempdir()) / "kvc-bench-catalog-store"
LOCATION = "file://" + urllib.parse.quote(str(STORE_DIR))  # LocalStore(STORE_DIR).name
DATA_VERSION = 3  # bump when the synthetic rows change
PROBE = "bench"  # the namespace the lookups probe (chain 0), one of --namespaces
GC_NAMESPACE = "bench-01"  # the namespace GC runs over
OLD_EVERY = 10  # every 10th chain of a namespace was last used 30 days ago: GC's garbage
OLD = timedelta(days=30)


def namespace_name(i: int) -> str:
    return PROBE if i == 0 else f"bench-{i:02d}"


def chain(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, CHAIN_CHUNKS * CS, dtype=np.int64)


def _blob_key(h: bytes) -> str:
    return blake3.blake3(h + b"blob").hexdigest()


def records(tokens: np.ndarray, namespace: str = PROBE) -> list[ChunkRecord]:
    now = datetime.now(UTC)
    out = []
    parent = chain_root(namespace)
    for i in range(0, len(tokens), CS):
        piece = tokens[i : i + CS]
        h = chain_hash(parent, piece)
        key = _blob_key(h)
        rc = ReplicaReceipt(LOCATION, "local", 1000, "blake3:" + key, now)
        out.append(
            ChunkRecord(
                namespace,
                FP,
                h,
                parent,
                i,
                piece.tolist(),
                SHARD,
                key,
                "raw",
                1000,
                14_680_064,
                [rc],
            )
        )
        parent = h
    return out


def bulk_rows(
    seed: int, namespace: str, ns_id: int, now: datetime
) -> tuple[list[dict[str, Any]], ...]:
    """The prefix, chunk and replica rows `record_chunks` would write for chain `seed`."""
    tokens = chain(seed).astype(np.uint32)
    be = tokens.astype(">u4").tobytes()
    hashes = prefix_hashes(namespace, tokens, CS)
    prefixes, chunks, replicas = [], [], []
    parent = chain_root(namespace)
    for i, h in enumerate(hashes):
        piece = be[4 * CS * i : 4 * CS * (i + 1)]
        prefixes.append(
            {
                "prefix_hash": h,
                "namespace_id": ns_id,
                "parent_hash": parent,
                "token_start": i * CS,
                "token_count": CS,
                "depth": i,
                "quarantined": False,
                "quarantine_reason": None,
                "created_at": now,
                "tokens_head": piece[: 4 * HEAD_TOKENS],
                "tokens_be": piece,
            }
        )
        key = _blob_key(h)
        chunks.append(
            {
                "fingerprint": FP.hex,
                "prefix_hash": h,
                "layer_lo": SHARD.layer_lo,
                "layer_hi": SHARD.layer_hi,
                "head_lo": SHARD.head_lo,
                "head_hi": SHARD.head_hi,
                "blob_key": key,
                "codec": "raw",
                "stored_bytes": 1000,
                "kv_bytes": 14_680_064,
                "state": "ready",
                "created_at": now,
                "last_seen_at": now,
                "last_access_at": None,
                "access_count": 0,
            }
        )
        replicas.append(
            {
                "blob_key": key,
                "namespace_id": ns_id,
                "location": LOCATION,
                "tier": "local",
                "state": "durable",
                "size": 1000,
                "etag": None,
                "version": None,
                "checksum": "blake3:" + key,
                "stored_at": now,
                "last_verified_at": now,
                "worker": None,
            }
        )
        parent = h
    return prefixes, chunks, replicas


def build(cat: Catalog, size: int, namespaces: int) -> float:
    """Fill an empty catalog to `size` chunks over `namespaces` namespaces (chain `seed` in
    namespace `seed % namespaces`); the publish rate of the published part: each
    namespace's first chain, through `record_chunks`, which also registers the namespace's
    fingerprint as a publish does."""
    names = [namespace_name(i) for i in range(namespaces)]
    for name in names:
        cat.ensure_namespace(name, CS)
    chains = -(-size // CHAIN_CHUNKS)
    published = min(namespaces, chains)
    t0 = time.perf_counter()
    n = 0
    for seed in range(published):
        recs = records(chain(seed), names[seed % namespaces])[: size - n]
        cat.record_chunks(recs)
        n += len(recs)
    rate = n / (time.perf_counter() - t0)
    with cat.engine.connect() as conn:
        ns_ids = {
            name: ns_id for name, ns_id in conn.execute(sa.text("SELECT name, id FROM namespaces"))
        }
    now = datetime.now(UTC)
    batch = 32
    t0 = time.perf_counter()
    for first in range(published, chains, batch):
        rows: tuple[list[dict[str, Any]], ...] = ([], [], [])
        for seed in range(first, min(first + batch, chains)):
            name = names[seed % namespaces]
            at = now - OLD if (seed // namespaces) % OLD_EVERY == OLD_EVERY - 1 else now
            for acc, part in zip(rows, bulk_rows(seed, name, ns_ids[name], at), strict=True):
                acc.extend(part)
        keep = size - n
        with cat.engine.execution_options(kvc_write=True).begin() as conn:
            if conn.dialect.name == "postgresql":  # the fill's commits need not wait for WAL
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            for table, part in zip((PrefixNode, Chunk, Replica), rows, strict=True):
                _insert(conn, table, part[:keep])
        n += min(keep, len(rows[0]))
        print(
            f"  fill {n}/{size} ({n / (time.perf_counter() - t0):.0f} chunks/s)",
            file=sys.stderr,
            end="\r",
        )
    print(file=sys.stderr)
    with cat.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
        assert conn.execute(sa.text("SELECT count(*) FROM chunks")).scalar_one() == size
    return rate


def _insert(conn: sa.Connection, table: Any, rows: list[dict[str, Any]]) -> None:
    """Plain INSERTs (SQLite) or COPY (PostgreSQL) of these rows, in the caller's transaction.

    The COPY is fed text made here, one write per table and batch: psycopg's `write_row`
    adapts every value on its own and held the fill to about 3k chunks/s."""
    if conn.dialect.name != "postgresql" or not rows:
        conn.execute(sa.insert(table), rows)
        return
    cols = list(rows[0])
    text = "".join("\t".join(map(_copy_text, r.values())) + "\n" for r in rows)
    cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    with cur.copy(f"COPY {table.__tablename__} ({', '.join(cols)}) FROM STDIN") as copy:
        copy.write(text.encode())


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(value: Any) -> str:
    """One value in COPY's text format."""
    if value is None:
        return "\\N"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, bytes):
        return "\\\\x" + value.hex()  # bytea hex, its backslash escaped for COPY
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value).translate(_COPY_ESCAPES)
