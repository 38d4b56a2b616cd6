"""Catalog lookup latency and publish rate, against the query a plan's rows cost, on the same database.

Usage (repository root, project venv with the `test` extra, which brings the
embedded PostgreSQL):

    python bench/bench_catalog.py [--sizes 10000,100000,1000000] [--backends sqlite,postgres]
                                  [--reps 30] [--cache DIR] [--no-cache]

For each backend and size, a catalog of that many chunks (chains of 512 chunks
of 256 tokens) is built, then for prompts of 1k to 128k tokens (a full match
of a stored chain plus one pending token, tokens as a uint32 array) the lookup
and its floor run interleaved (floor, lookup, floor, lookup, ...) so that
machine noise hits both alike; the table prints both medians and their ratio.

The floor ("fetch N plan rows by key") is what a careful engineer would write
to get the same plan rows, given the prefix hashes: one hand-written query
fetching the same N chunk rows by their key (fingerprint, prefix hash, shard:
the chunks' unique index) with the columns a plan returns (blob key, codec,
stored and KV bytes) joined to their replicas (location, tier, state, size,
worker), in one round trip, fetched as plain driver rows through the same
engine. "fetch by prefix hash only" is the same query without the
fingerprint and shard (right only because this catalog holds one fingerprint
and one shard); it is printed too, as the stricter floor. It does not hash the prompt, check the fingerprint, shard and
states, exclude quarantined nodes or build result objects: that is the
lookup's own work. It does not read the prefix nodes either (a full chunk's
parent and start are known from the prompt, as the lookup knows them).

Every size of a backend is open at once and measured together: each rep runs
floor by key, floor by hash and lookup for every size in turn, so the
1M / 10k lookup ratio printed at the end also comes from interleaved reps.

Building the catalog: the probe chain and three more go through
`record_chunks` (the publish path, timed as "publish (chunks/s)"); the rest
are synthetic chains (real chain hashes, random token ids) written as the
same prefix, chunk and replica rows `record_chunks` writes, in batches of 32
chains: plain INSERTs on SQLite, COPY on PostgreSQL (then VACUUM ANALYZE).
SQLite catalogs are kept in --cache (default: the system temp directory,
about 2.5 GB for 1M chunks) keyed by size and schema revision, so a second
run starts at once; PostgreSQL is rebuilt each run, one server per size. On
the shared 2-core build machine (2026-12-04, under load from other jobs) the
SQLite 1M fill took 13 minutes once (1.3-4.9k chunks/s); with the SQLite
catalogs cached, a full run (both backends, 10k, 100k, 1M, --reps 30) took
4-6 minutes, most of it the PostgreSQL 1M fill (COPY, 3.5-5 minutes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog import AttentionLayout, Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.database import head_revision
from catalog.identity import prefix_hashes
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from catalog.schema import HEAD_TOKENS, Chunk, PrefixNode, Replica

CS = 256
CHAIN_CHUNKS = 512  # 128k tokens
PROMPTS = (1024, 8192, 32768, 131072)
PUBLISHED_CHAINS = 4  # through record_chunks; the rest are bulk-inserted
LAYOUT = AttentionLayout(28, 4, 128, "float16")
FP = Fingerprint.create(weights="bench", architecture="llama", config={}, attention_layout=LAYOUT)
SHARD = Shard.full(LAYOUT)
LOCATION = "file:///bench"
DATA_VERSION = 2  # bump when the synthetic rows change


def chain(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, CHAIN_CHUNKS * CS, dtype=np.int64)


def _blob_key(h: bytes) -> str:
    return blake3.blake3(h + b"blob").hexdigest()


def records(tokens: np.ndarray) -> list[ChunkRecord]:
    now = datetime.now(UTC)
    out = []
    parent = chain_root("bench")
    for i in range(0, len(tokens), CS):
        piece = tokens[i : i + CS]
        h = chain_hash(parent, piece)
        key = _blob_key(h)
        rc = ReplicaReceipt(LOCATION, "local", 1000, "blake3:" + key, now)
        out.append(ChunkRecord("bench", FP, h, parent, i, piece.tolist(), SHARD, key, "raw", 1000, 14_680_064, [rc]))
        parent = h
    return out


def bulk_rows(seed: int, ns_id: int, now: datetime) -> tuple[list[dict[str, Any]], ...]:
    """The prefix, chunk and replica rows `record_chunks` would write for chain `seed`."""
    tokens = chain(seed).astype(np.uint32)
    be = tokens.astype(">u4").tobytes()
    hashes = prefix_hashes("bench", tokens, CS)
    prefixes, chunks, replicas = [], [], []
    parent = chain_root("bench")
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


def build(cat: Catalog, size: int) -> float:
    """Fill an empty catalog to `size` chunks; the publish rate of the published part."""
    cat.ensure_namespace("bench", CS)
    chains = -(-size // CHAIN_CHUNKS)
    published = min(PUBLISHED_CHAINS, chains)
    t0 = time.perf_counter()
    n = 0
    for seed in range(published):
        recs = records(chain(seed))[: size - n]
        cat.record_chunks(recs)
        n += len(recs)
    rate = n / (time.perf_counter() - t0)
    with cat.engine.connect() as conn:
        ns_id = conn.execute(sa.text("SELECT id FROM namespaces WHERE name = 'bench'")).scalar_one()
    now = datetime.now(UTC)
    batch = 32
    t0 = time.perf_counter()
    for first in range(published, chains, batch):
        rows: tuple[list[dict[str, Any]], ...] = ([], [], [])
        for seed in range(first, min(first + batch, chains)):
            for acc, part in zip(rows, bulk_rows(seed, ns_id, now), strict=True):
                acc.extend(part)
        keep = size - n
        with cat.engine.execution_options(kvc_write=True).begin() as conn:
            for table, part in zip((PrefixNode, Chunk, Replica), rows, strict=True):
                _insert(conn, table, part[:keep])
        n += min(keep, len(rows[0]))
        print(f"  fill {n}/{size} ({n / (time.perf_counter() - t0):.0f} chunks/s)", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    with cat.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
        assert conn.execute(sa.text("SELECT count(*) FROM chunks")).scalar_one() == size
    return rate


def _insert(conn: sa.Connection, table: Any, rows: list[dict[str, Any]]) -> None:
    """Plain INSERTs (SQLite) or COPY (PostgreSQL) of these rows, in the caller's transaction."""
    if conn.dialect.name != "postgresql" or not rows:
        conn.execute(sa.insert(table), rows)
        return
    cols = list(rows[0])
    cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    with cur.copy(f"COPY {table.__tablename__} ({', '.join(cols)}) FROM STDIN") as copy:
        for r in rows:
            copy.write_row([r[c] for c in cols])


def floor_sql(dialect: str, n: int, *, by_identity: bool = True) -> str:
    """The floor's statement for n chunks: by the chunks' unique key, or by prefix hash only."""
    p = "?" if dialect == "sqlite" else "%s"
    hashes = f"IN ({','.join('?' * n)})" if dialect == "sqlite" else "= ANY(%s)"
    sql = (
        "SELECT c.prefix_hash, c.blob_key, c.codec, c.stored_bytes, c.kv_bytes,"
        " r.location, r.tier, r.state, r.size, r.worker"
        f" FROM chunks c JOIN replicas r ON r.blob_key = c.blob_key WHERE c.prefix_hash {hashes}"
        # The tenant's own replica rows, as the lookup reads them (one namespace here).
        " AND r.namespace_id = (SELECT id FROM namespaces WHERE name = 'bench')"
    )
    if by_identity:
        sql += f" AND c.fingerprint = {p} AND c.layer_lo = {p} AND c.layer_hi = {p} AND c.head_lo = {p} AND c.head_hi = {p}"
    return sql


def floor_params(dialect: str, hashes: list[bytes], *, by_identity: bool = True) -> tuple[Any, ...]:
    ident = (FP.hex, SHARD.layer_lo, SHARD.layer_hi, SHARD.head_lo, SHARD.head_hi) if by_identity else ()
    return (*hashes, *ident) if dialect == "sqlite" else (hashes, *ident)


def fetch_plan_rows(cat: Catalog, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """The floor: one query for the plan's rows by key, fetched as plain driver rows."""
    with cat.engine.connect() as conn:
        result = conn.exec_driver_sql(sql, params)
        try:
            return list(result.cursor.fetchall())
        finally:
            result.close()


def interleaved(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Medians of fns run in turn (a, b, c, a, b, c, ...) after one warm-up each."""
    for fn in fns:
        fn()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, ts, strict=True):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def measure(backend: str, cats: dict[int, Catalog], reps: int) -> list[tuple[str, int, str, float]]:
    """Every size's floors and lookups, interleaved with each other (so the sizes compare too)."""
    rows: list[tuple[str, int, str, float]] = []
    sizes = list(cats)
    dialect = next(iter(cats.values())).engine.dialect.name
    probe = chain(0)
    q1 = np.append(probe[:1024], 7).astype(np.uint32)
    fns: list[Callable[[], object]] = []
    for size, cat in cats.items():
        ids = iter(np.random.default_rng(1).integers(1, size + 1, 10 * reps + 10).tolist())

        def point(cat: Catalog = cat, ids: Iterator[int] = ids) -> None:
            with cat.engine.connect() as conn:
                conn.execute(sa.text("SELECT blob_key FROM chunks WHERE id = :i"), {"i": next(ids)}).one()

        fns += [point, lambda cat=cat: cat.lookup("bench", FP, q1)]
    pts = interleaved(fns, reps)[::2]
    for size, pt in zip(sizes, pts, strict=True):
        rows.append((backend, size, "point query (ms)", pt * 1e3))
    for p in PROMPTS:
        q = np.append(probe[:p], 7).astype(np.uint32)
        fns = []
        n = 0
        for cat in cats.values():
            m = cat.lookup("bench", FP, q)
            assert m.matched_tokens == p, (m.matched_tokens, p)
            hs = [c.prefix_hash for c in m.chunks]
            n = len(hs)
            by_key = (floor_sql(dialect, n), floor_params(dialect, hs))
            by_hash = (floor_sql(dialect, n, by_identity=False), floor_params(dialect, hs, by_identity=False))
            for sql, params in (by_key, by_hash):
                assert len(fetch_plan_rows(cat, sql, params)) == n
            fns += [
                lambda cat=cat, by_key=by_key: fetch_plan_rows(cat, *by_key),
                lambda cat=cat, by_hash=by_hash: fetch_plan_rows(cat, *by_hash),
                lambda cat=cat, q=q: cat.lookup("bench", FP, q),
            ]
        meds = interleaved(fns, reps)
        k = f"{p // 1024}k"
        for i, (size, pt) in enumerate(zip(sizes, pts, strict=True)):
            fk, fh, lk = meds[3 * i : 3 * i + 3]
            rows.append((backend, size, f"lookup {k} tokens (ms)", lk * 1e3))
            rows.append((backend, size, f"  fetch {n} plan rows by key (ms)", fk * 1e3))
            rows.append((backend, size, f"  lookup {k} / fetch by key", lk / fk))
            rows.append((backend, size, f"  fetch {n} by prefix hash only (ms)", fh * 1e3))
            rows.append((backend, size, f"  lookup {k} / fetch by hash", lk / fh))
            rows.append((backend, size, f"  lookup {k} / point query", lk / pt))
    return rows


def run(
    backend: str,
    open_for: Callable[[int], AbstractContextManager[tuple[str, bool]]],
    sizes: list[int],
    reps: int,
) -> list[tuple[str, int, str, float]]:
    """Open (building where needed) a catalog of every size, then measure them together."""
    rows: list[tuple[str, int, str, float]] = []
    with ExitStack() as stack:
        cats: dict[int, Catalog] = {}
        for size in sizes:
            url, fresh = stack.enter_context(open_for(size))
            t0 = time.perf_counter()
            cat = Catalog.open(url, upgrade=True)
            stack.callback(cat.close)
            if fresh:
                rows.append((backend, size, "publish (chunks/s)", build(cat, size)))
            print(f"{backend} {_h(size)}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            cats[size] = cat
        t0 = time.perf_counter()
        rows += measure(backend, cats, reps)
        print(f"{backend}: measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvc-bench-catalog-cache"))
    ap.add_argument("--no-cache", action="store_true", help="build SQLite catalogs afresh and keep none")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    rows = []
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvc-bench-catalog-"))
    cache = Path(args.cache)
    try:
        for backend in backends:
            if backend == "sqlite":

                @contextmanager
                def sqlite_db(size: int) -> Iterator[tuple[str, bool]]:
                    name = f"catalog-{size}-r{head_revision()}-d{DATA_VERSION}.db"
                    if args.no_cache:
                        yield f"sqlite:///{work / name}", True
                        return
                    cache.mkdir(parents=True, exist_ok=True)
                    path = cache / name
                    if path.exists():
                        yield f"sqlite:///{path}", False
                        return
                    # Built under a temporary name, kept once complete and closed.
                    part = cache / (name + ".part")
                    part.unlink(missing_ok=True)
                    yield f"sqlite:///{part}", True
                    for suffix in ("-wal", "-shm"):
                        Path(str(part) + suffix).unlink(missing_ok=True)
                    part.rename(path)

                rows += run("sqlite", sqlite_db, sizes, args.reps)
            else:
                from tests.services import start_postgres

                @contextmanager
                def postgres_db(size: int) -> Iterator[tuple[str, bool]]:
                    with start_postgres() as pg:  # one server per size, like for like
                        yield pg.url, True

                rows += run("postgres", postgres_db, sizes, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nkvc catalog bench: chunk size {CS}, chains of {CHAIN_CHUNKS} chunks, floor and lookup interleaved,"
        f" median of {args.reps}; {time.perf_counter() - t_start:.0f} s\n"
    )
    metrics = list(dict.fromkeys(r[2] for r in rows))
    cols = [(b, s) for b in backends for s in sizes]
    print(f"{'metric':<36}" + "".join(f"{b[:6] + ' ' + _h(s):>14}" for b, s in cols))
    for m in metrics:
        vals = {(b, s): v for b, s, mm, v in rows if mm == m}
        print(f"{m:<36}" + "".join(f"{vals[c]:>14.2f}" if c in vals else f"{'-':>14}" for c in cols))
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        for b in backends:
            v = {(s, m): x for bb, s, m, x in rows if bb == b}
            lk = v[(hi, "lookup 128k tokens (ms)")] / v[(lo, "lookup 128k tokens (ms)")]
            fl = v[(hi, "  fetch 512 plan rows by key (ms)")] / v[(lo, "  fetch 512 plan rows by key (ms)")]
            print(f"{b}: lookup 128k {_h(hi)} / {_h(lo)} = {lk:.2f}x (floor {_h(hi)} / {_h(lo)} = {fl:.2f}x)")


def _h(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


if __name__ == "__main__":
    main()
