"""Many processes publishing overlapping chains at once: no error, no duplicate, every chain whole."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from pathlib import Path

import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from tests.catalog_helpers import CS, FP, chain_records

SYSTEM = list(range(500, 516))  # a shared 16-token system prompt: 4 chunks


def chain(i: int) -> list[int]:
    # 12 distinct continuations; workers pick overlapping ones on purpose.
    return [*SYSTEM, *[(i * 7 + k) % 50 for k in range(i % 3 + 6)], *range(i, i + 9)]


def _worker(url: str, seed: int, start: mp.synchronize.Barrier, rounds: int, out: mp.Queue[str]) -> None:  # type: ignore[name-defined]
    try:
        cat = Catalog.open(url)
        rng = random.Random(seed)
        # Every process has started and opened the catalog before any publishes: without
        # this, one could finish its rounds while another is still importing.
        start.wait(120)
        for _ in range(rounds):
            recs = chain_records("default", chain(rng.randrange(12)))
            cut = rng.randrange(1, len(recs) + 1)
            cat.record_chunks(recs[:cut])
            cat.record_chunks(recs[cut:])
        cat.close()
        out.put("ok")
    except BaseException:
        start.abort()  # the others stop waiting for this one
        out.put(traceback.format_exc())


def run_publishers(url: str, processes: int, rounds: int) -> None:
    ctx = mp.get_context("spawn")
    setup = Catalog.open(url, upgrade=True)
    setup.ensure_namespace("default", CS)
    setup.close()
    start = ctx.Barrier(processes)
    out: mp.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, s, start, rounds, out)) for s in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    assert results == ["ok"] * processes, "\n".join(r for r in results if r != "ok")

    cat = Catalog.open(url)
    expected_prefixes = {r.prefix_hash for i in range(12) for r in chain_records("default", chain(i))}
    with cat.engine.connect() as conn:
        prefixes = conn.execute(sa.text("SELECT count(*), count(DISTINCT prefix_hash) FROM prefixes")).one()
        chunks = conn.execute(sa.text("SELECT count(*) FROM chunks")).scalar_one()
        replicas = conn.execute(sa.text("SELECT count(*) FROM replicas")).scalar_one()
    assert prefixes[0] == prefixes[1]  # no duplicate rows
    assert prefixes[0] <= len(expected_prefixes) and chunks == prefixes[0] and replicas == chunks
    for i in range(12):
        toks = chain(i)
        recs = chain_records("default", toks)
        with cat.engine.connect() as conn:
            have = conn.execute(
                sa.text("SELECT count(*) FROM prefixes WHERE prefix_hash IN :hs").bindparams(
                    sa.bindparam("hs", expanding=True)
                ),
                {"hs": [r.prefix_hash for r in recs]},
            ).scalar_one()
        if have:  # a chain that was published at all is whole and restorable end to end
            assert have == len(recs)
            assert cat.lookup("default", FP, [*toks, 0]).matched_tokens == len(toks)
    cat.close()


@pytest.mark.slow
def test_eight_processes_on_postgres(postgres_url: str) -> None:
    run_publishers(postgres_url, processes=8, rounds=15)


@pytest.mark.slow
def test_two_processes_on_sqlite(tmp_path: Path) -> None:
    run_publishers(f"sqlite:///{tmp_path / 'c.db'}", processes=2, rounds=25)
