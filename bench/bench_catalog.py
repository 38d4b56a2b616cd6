"""Catalog lookup latency and publish rate, against the query a plan's rows cost, on the same database.

Usage (repository root, project venv with the `test` extra, which brings the
embedded PostgreSQL):

    python bench/bench_catalog.py [--sizes 10000,100000,1000000] [--backends sqlite,postgres]
                                  [--reps 30] [--namespaces 100] [--no-ops] [--cache DIR] [--no-cache]

PostgreSQL's data directories and the SQLite catalogs go under the system temp
directory: set TMPDIR to a disk with room (about 3 KB a chunk, both backends).

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

Building the catalog (`bench/catalog_data.py`): chain `seed` belongs to namespace `seed % --namespaces`
(the probe namespace `bench`, then `bench-01`...), each created as the catalog
creates namespaces. Each namespace's first chain goes through `record_chunks`
(the publish path, which also registers the namespace's fingerprint; timed as
"publish while building"); the rest are synthetic chains (real chain hashes,
random token ids) written as the same prefix, chunk and replica rows (each
namespace its own replica rows) `record_chunks` writes, in batches of 32
chains: plain INSERTs on SQLite, COPY on PostgreSQL (then VACUUM ANALYZE).
Every tenth chain of a namespace was last used 30 days ago: GC's garbage.

Then, unless --no-ops, for each size in turn (`operations`): the catalog's size
on disk per chunk (PostgreSQL: `pg_database_size`, `pg_total_relation_size` of
the three large tables, `pg_indexes_size`; SQLite: the file, and `dbstat` per
table), `kvc stats` for one namespace and for all (`Catalog.stats`, what the
command runs), four admin-SQL reports of docs/admin-sql.md, a real GC run over
`bench-01` (`maintenance.collect.run_gc`, max age 7 days, its store an empty
local directory: the mark is `plan_gc`, the run adds the resume, the purge and
the sweep), and the publish rate of 1 and 8 writer threads calling
`record_chunks` (64 chunks a call), the 8 each into its own namespace and all
into one. These change the catalog, so a SQLite catalog is cached only with
--no-ops.
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
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog_data import (
    CHAIN_CHUNKS,
    CS,
    DATA_VERSION,
    FP,
    GC_NAMESPACE,
    LOCATION,
    PROBE,
    SHARD,
    STORE_DIR,
    build,
    chain,
    namespace_name,
    records,
)

from catalog.catalog import Catalog
from catalog.database import head_revision
from catalog.gc import plan_gc
from catalog.models import ChunkRecord
from catalog.schema import Chunk, PrefixNode, Replica
from chunkstore.local import LocalStore
from maintenance.collect import run_gc

PROMPTS = (1024, 8192, 32768, 131072)
WRITERS = 8
WRITER_CHUNKS = 1024  # published by each writer, in requests of REQUEST_CHUNKS
REQUEST_CHUNKS = 64  # 16k tokens


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
    ident = (
        (FP.hex, SHARD.layer_lo, SHARD.layer_hi, SHARD.head_lo, SHARD.head_hi)
        if by_identity
        else ()
    )
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
                conn.execute(
                    sa.text("SELECT blob_key FROM chunks WHERE id = :i"), {"i": next(ids)}
                ).one()

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
            by_hash = (
                floor_sql(dialect, n, by_identity=False),
                floor_params(dialect, hs, by_identity=False),
            )
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


# The admin-SQL reports of docs/admin-sql.md an operator runs (3, 4, 10) and a page of one
# namespace's chunks: each reads what it reports on, the whole catalog for the first three.
ADMIN_QUERIES = {
    "usage per namespace": "SELECT namespace, fingerprint, chunks, tokens, kv_bytes, stored_bytes"
    " FROM v_namespace_usage ORDER BY stored_bytes DESC",
    "replicas unverified 7 days": "SELECT count(*) FROM v_replica_health"
    " WHERE last_verified_at IS NULL OR seconds_since_verified > 7 * 86400",
    "chunks without a usable replica": "SELECT count(*) FROM v_chunks v WHERE NOT EXISTS ("
    " SELECT 1 FROM replicas r JOIN namespaces n ON n.id = r.namespace_id"
    " WHERE r.blob_key = v.blob_key AND n.name = v.namespace AND r.state IN ('durable', 'ready'))",
    f"100 chunks of {GC_NAMESPACE}": "SELECT chunk_id, prefix, token_start, blob_key, replicas"
    f" FROM v_chunks WHERE namespace = '{GC_NAMESPACE}' LIMIT 100",
}


def timed(fn: Callable[[], object], reps: int = 3) -> float:
    """Median seconds of `reps` runs of fn (no warm-up: the first run is a cold operator's)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def disk_rows(cat: Catalog, size: int) -> list[tuple[str, float]]:
    """The catalog's size on disk, per chunk (whole database, and its large tables and indexes)."""
    with cat.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            total = conn.exec_driver_sql("SELECT pg_database_size(current_database())").scalar_one()
            parts = {
                t: conn.exec_driver_sql(f"SELECT pg_total_relation_size('{t}')").scalar_one()
                for t in ("prefixes", "chunks", "replicas")
            }
            indexes = conn.exec_driver_sql(
                "SELECT sum(pg_indexes_size(c.oid)) FROM pg_class c"
                " WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace"
            ).scalar_one()
        else:
            db = conn.exec_driver_sql("PRAGMA database_list").all()[0][2]
            total = os.path.getsize(db)
            try:
                by_name = dict(
                    conn.exec_driver_sql("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").all()
                )
            except sa.exc.OperationalError:  # built without the dbstat table: the file only
                by_name = {}
            owner = {
                str(ix.name): t.name
                for t in (PrefixNode.__table__, Chunk.__table__, Replica.__table__)
                for ix in t.indexes
            }
            parts = {}
            for name, n in by_name.items():
                table = owner.get(name, name.removeprefix("sqlite_autoindex_").rsplit("_", 1)[0])
                if table in ("prefixes", "chunks", "replicas"):
                    parts[table] = parts.get(table, 0) + n
            indexes = (
                sum(
                    n
                    for name, n in by_name.items()
                    if name in owner or name.startswith("sqlite_autoindex")
                )
                or None
            )
    rows = [
        ("disk, whole catalog (GB)", float(total) / 1e9),
        ("disk per chunk (bytes)", float(total) / size),
    ]
    rows += [(f"  {t} per chunk (bytes)", float(n) / size) for t, n in parts.items()]
    if indexes:
        rows.append(("  indexes, all tables (GB)", float(indexes) / 1e9))
    return rows


def publish_rate(cat: Catalog, jobs: Sequence[list[ChunkRecord]]) -> float:
    """Chunks/s of `len(jobs)` threads each publishing its records through `record_chunks`,
    REQUEST_CHUNKS per call, all started together."""
    start = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []

    def writer(recs: list[ChunkRecord]) -> None:
        start.wait()
        try:
            for i in range(0, len(recs), REQUEST_CHUNKS):
                cat.record_chunks(recs[i : i + REQUEST_CHUNKS])
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(recs,)) for recs in jobs]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(len(r) for r in jobs) / elapsed


def writer_jobs(first_seed: int, namespaces: Sequence[str]) -> list[list[ChunkRecord]]:
    """WRITER_CHUNKS new chunks for each of these namespaces' writers (fresh chains)."""
    per = -(-WRITER_CHUNKS // CHAIN_CHUNKS)
    return [
        [r for k in range(per) for r in records(chain(first_seed + per * w + k), ns)][
            :WRITER_CHUNKS
        ]
        for w, ns in enumerate(namespaces)
    ]


def operations(cat: Catalog, size: int, namespaces: int) -> list[tuple[str, float]]:
    """What besides lookups grows with the catalog: disk, `kvc stats`, the admin views, a GC
    run over one namespace, and publishing with 8 writers (last: it adds chunks)."""
    rows = disk_rows(cat, size)
    rows.append((f"kvc stats, namespace {PROBE} (ms)", timed(lambda: cat.stats(PROBE)) * 1e3))
    rows.append(("kvc stats, all namespaces (ms)", timed(lambda: cat.stats(None)) * 1e3))
    for name, sql in ADMIN_QUERIES.items():

        def query(sql: str = sql) -> None:
            with cat.engine.connect() as conn:
                conn.exec_driver_sql(sql).all()

        rows.append((f"view: {name} (ms)", timed(query, reps=1) * 1e3))
    STORE_DIR.mkdir(parents=True, exist_ok=True)
    store = LocalStore(STORE_DIR)
    assert store.name == LOCATION, (store.name, LOCATION)
    week = 7 * 86400.0
    now = datetime.now(UTC)
    plan = plan_gc(cat, GC_NAMESPACE, max_age_s=week, max_bytes=None, now=now)
    rows.append((f"gc: chunks in {GC_NAMESPACE}", plan.bytes_before / 1000))  # 1000 bytes a chunk
    rows.append(("gc: chunks to purge (unused 30 days)", float(len(plan.items))))
    rows.append(
        (
            "gc mark: plan (ms)",
            timed(lambda: plan_gc(cat, GC_NAMESPACE, max_age_s=week, max_bytes=None, now=now))
            * 1e3,
        )
    )
    t0 = time.perf_counter()
    report = run_gc(cat, [store], GC_NAMESPACE, max_age_s=week, now=now, actor="bench")
    rows.append(("gc run: resume, mark, purge, sweep (ms)", (time.perf_counter() - t0) * 1e3))
    removed = report.retention.result.chunks_removed if report.retention.result else 0
    assert removed == len(plan.items), (removed, len(plan.items))
    rows.append(
        (
            "gc run again, nothing to purge (ms)",
            timed(
                lambda: run_gc(cat, [store], GC_NAMESPACE, max_age_s=week, now=now, actor="bench"),
                reps=1,
            )
            * 1e3,
        )
    )
    store.close()
    seed = 1_000_000_000
    rows.append(
        ("publish, 1 writer (chunks/s)", publish_rate(cat, writer_jobs(seed, [namespace_name(1)])))
    )
    seed += 100
    own = (
        [namespace_name(2 + w) for w in range(min(WRITERS, namespaces - 2))]
        if namespaces > 2
        else []
    )
    if len(own) == WRITERS:
        rows.append(
            (
                f"publish, {WRITERS} writers, own namespaces (chunks/s)",
                publish_rate(cat, writer_jobs(seed, own)),
            )
        )
    seed += 100
    rows.append(
        (
            f"publish, {WRITERS} writers, one namespace (chunks/s)",
            publish_rate(cat, writer_jobs(seed, [PROBE] * WRITERS)),
        )
    )
    return rows


def run(
    backend: str,
    open_for: Callable[[int], AbstractContextManager[tuple[str, bool]]],
    sizes: list[int],
    reps: int,
    namespaces: int,
    ops: bool,
) -> list[tuple[str, int, str, float]]:
    """Open (building where needed) a catalog of every size, measure their lookups together,
    then (`ops`) each one's other operations in turn."""
    rows: list[tuple[str, int, str, float]] = []
    with ExitStack() as stack:
        cats: dict[int, Catalog] = {}
        for size in sizes:
            url, fresh = stack.enter_context(open_for(size))
            t0 = time.perf_counter()
            cat = Catalog.open(url, upgrade=True)
            stack.callback(cat.close)
            if fresh:
                rows.append(
                    (
                        backend,
                        size,
                        "publish while building (chunks/s)",
                        build(cat, size, namespaces),
                    )
                )
            print(
                f"{backend} {_h(size)}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr
            )
            cats[size] = cat
        t0 = time.perf_counter()
        rows += measure(backend, cats, reps)
        print(f"{backend}: lookups measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for size, cat in cats.items() if ops else ():
            t0 = time.perf_counter()
            rows += [(backend, size, m, v) for m, v in operations(cat, size, namespaces)]
            print(
                f"{backend} {_h(size)}: operations measured in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvc-bench-catalog-cache"))
    ap.add_argument(
        "--no-cache", action="store_true", help="build SQLite catalogs afresh and keep none"
    )
    ap.add_argument(
        "--namespaces", type=int, default=100, help="namespaces the chunks are spread over"
    )
    ap.add_argument(
        "--no-ops",
        action="store_true",
        help="lookups only (without it, stats, views, GC and 8 writers change each catalog, so none is cached)",
    )
    args = ap.parse_args()
    if args.namespaces < 2:
        ap.error(f"--namespaces must be at least 2 (the probe's and GC's), got {args.namespaces}")
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
                    name = (
                        f"catalog-{size}-n{args.namespaces}-r{head_revision()}-d{DATA_VERSION}.db"
                    )
                    if args.no_cache or not args.no_ops:
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

                rows += run("sqlite", sqlite_db, sizes, args.reps, args.namespaces, not args.no_ops)
            else:
                from tests.services import start_postgres

                @contextmanager
                def postgres_db(size: int) -> Iterator[tuple[str, bool]]:
                    with start_postgres() as pg:  # one server per size, like for like
                        yield pg.url, True

                rows += run(
                    "postgres", postgres_db, sizes, args.reps, args.namespaces, not args.no_ops
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(STORE_DIR, ignore_errors=True)
    print(
        f"\nkvc catalog bench: chunk size {CS}, chains of {CHAIN_CHUNKS} chunks over {args.namespaces} namespaces,"
        " floor and lookup interleaved,"
        f" median of {args.reps}; {time.perf_counter() - t_start:.0f} s\n"
    )
    metrics = list(dict.fromkeys(r[2] for r in rows))
    cols = [(b, s) for b in backends for s in sizes]
    print(f"{'metric':<52}" + "".join(f"{b[:6] + ' ' + _h(s):>14}" for b, s in cols))
    for m in metrics:
        vals = {(b, s): v for b, s, mm, v in rows if mm == m}
        print(
            f"{m:<52}" + "".join(f"{vals[c]:>14.2f}" if c in vals else f"{'-':>14}" for c in cols)
        )
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        for b in backends:
            v = {(s, m): x for bb, s, m, x in rows if bb == b}
            lk = v[(hi, "lookup 128k tokens (ms)")] / v[(lo, "lookup 128k tokens (ms)")]
            fl = (
                v[(hi, "  fetch 512 plan rows by key (ms)")]
                / v[(lo, "  fetch 512 plan rows by key (ms)")]
            )
            print(
                f"{b}: lookup 128k {_h(hi)} / {_h(lo)} = {lk:.2f}x (floor {_h(hi)} / {_h(lo)} = {fl:.2f}x)"
            )


def _h(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


if __name__ == "__main__":
    main()
