"""Where a long lookup's time goes: its parts timed interleaved, a cProfile, and the query plan.

Usage (repository root, project venv):

    python bench/profile_lookup.py [--size 10000] [--backend sqlite|postgres] [--tokens 131072] [--reps 50] [--namespaces 100]

Builds (or, for SQLite, reuses from bench_catalog's cache) a catalog of
`--size` chunks, then runs, interleaved, `--reps` times each:

- hash: the prompt's prefix hashes (blake3 over each chunk's token ids);
- hot query: the lookup's one statement for the full chunks, fetched as raw rows;
- floor: bench_catalog's floor (the same plan rows by the chunks' key, hand-written);
- lookup: `Catalog.lookup` end to end.

"rest" is lookup - hash - hot query: connection checkout, grouping rows and
building the plan's tuples. Then a cProfile of the lookups (top functions by
own time) and the database's plan for the hot statement (EXPLAIN QUERY PLAN
on SQLite, EXPLAIN (ANALYZE, BUFFERS) on PostgreSQL).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_catalog import fetch_plan_rows, floor_params, floor_sql
from catalog_data import CS, DATA_VERSION, FP, SHARD, build, chain
from scratch import scratch_dir

from catalog.catalog import Catalog
from catalog.database import head_revision
from catalog.identity import prefix_hashes
from catalog.lookup import _HOT_SQL_PG, _hot_sql_sqlite


def profile(cat: Catalog, tokens: int, reps: int) -> None:
    dialect = cat.engine.dialect.name
    q = np.append(chain(0)[:tokens], 7).astype(np.uint32)
    m = cat.lookup("bench", FP, q)
    hs = [c.prefix_hash for c in m.chunks]
    with cat.engine.connect() as conn:
        ns_id = conn.execute(sa.text("SELECT id FROM namespaces WHERE name = 'bench'")).scalar_one()
    ident = (FP.hex, SHARD.layer_lo, SHARD.layer_hi, SHARD.head_lo, SHARD.head_hi, ns_id)
    if dialect == "sqlite":
        hot, hot_params = _hot_sql_sqlite(len(hs)), (*hs, *ident)
    else:
        hot, hot_params = _HOT_SQL_PG, (hs, *ident)
    fl, fl_params = floor_sql(dialect, len(hs)), floor_params(dialect, hs)
    parts: dict[str, Callable[[], Any]] = {
        "hash": lambda: prefix_hashes("bench", q, CS, max_chunks=len(hs)),
        "hot query": lambda: fetch_plan_rows(cat, hot, hot_params),
        "floor": lambda: fetch_plan_rows(cat, fl, fl_params),
        "lookup": lambda: cat.lookup("bench", FP, q),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for fn in parts.values():
        fn()
    for _ in range(reps):
        for k, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med["rest"] = med["lookup"] - med["hash"] - med["hot query"]
    print(f"\n{dialect}, {len(hs)} chunks ({tokens} tokens), median of {reps}, interleaved:")
    for k, v in med.items():
        print(f"  {k:<10} {v:8.3f} ms  {v / med['floor']:5.2f}x floor")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        cat.lookup("bench", FP, q)
    prof.disable()
    print("\ncProfile of the lookups (own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    with cat.engine.connect() as conn:
        if dialect == "sqlite":
            plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + hot, hot_params).all()
            lines = [r[-1] for r in plan]
        else:
            plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + hot, hot_params).all()
            lines = [r[0][:160] for r in plan]  # the hash array would fill the screen
    print("hot statement plan:\n  " + "\n  ".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--backend", default="sqlite", choices=("sqlite", "postgres"))
    ap.add_argument("--tokens", type=int, default=131_072)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--namespaces", type=int, default=100, help="as bench_catalog's")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvc-bench-catalog-cache"))
    args = ap.parse_args()
    if args.backend == "sqlite":
        path = Path(args.cache) / f"catalog-{args.size}-n{args.namespaces}-r{head_revision()}-d{DATA_VERSION}.db"
        fresh = not path.exists()
        if fresh:
            path = scratch_dir("kvc-profile-") / "catalog.db"
        cat = Catalog.open(f"sqlite:///{path}", upgrade=True)
        if fresh:
            build(cat, args.size, args.namespaces)
        try:
            profile(cat, args.tokens, args.reps)
        finally:
            cat.close()
    else:
        from tests.services import start_postgres

        with start_postgres() as pg:
            cat = Catalog.open(pg.url, upgrade=True)
            try:
                build(cat, args.size, args.namespaces)
                profile(cat, args.tokens, args.reps)
            finally:
                cat.close()


if __name__ == "__main__":
    main()
