"""Residency without HTTP: resident replicas follow the page pool, demand, invalidations, forks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.errors import UnknownRouteError
from restore.pool import PagePool
from restore.residency import Residency, timer_interval

MODEL = ReferenceModel.small(seed=0)
CHUNK = 32
PROMPT = np.random.default_rng(3).integers(0, MODEL.vocab_size, 2 * CHUNK + 5).tolist()


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    yield c
    c.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = open_store(f"file://{tmp_path / 'blobs'}")
    yield s
    s.close()


def checkpointed(cat: Catalog, store: ChunkStore, pool: PagePool, tokens: list[int]) -> int:
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    with Checkpointer(cat, store, "ns", CHUNK) as cp:
        cp.checkpoint(pool, route, tokens, MODEL.fingerprint)
    return route


def residency(cat: Catalog, worker: str = "w") -> Residency:
    return Residency(cat, worker_id=worker, namespace="ns", chunk_size=CHUNK)


def test_held_chunks_are_advertised_and_withdrawn_with_their_route(
    cat: Catalog, store: ChunkStore
) -> None:
    res = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    res.use_pool(pool)
    route = checkpointed(cat, store, pool, PROMPT)
    held = res.whole_chunks(MODEL.fingerprint, PROMPT)
    assert [c.end for c in held] == [CHUNK, 2 * CHUNK, len(PROMPT)]
    res.hold(pool, route, held)
    assert res.sync() == {"advertised": 3, "withdrawn": 0}
    assert cat.replicas_at("worker:w") == sorted(c.blob_key for c in held)
    assert res.sync() == {"advertised": 0, "withdrawn": 0}  # idempotent
    assert res.resident_chunks == 3

    res.release(pool, route)
    assert res.sync() == {"advertised": 0, "withdrawn": 3}
    assert cat.replicas_at("worker:w") == [] and res.resident_chunks == 0
    with pytest.raises(UnknownRouteError):
        res.release(pool, route)


def test_a_new_residency_reconciles_what_a_previous_process_left(
    cat: Catalog, store: ChunkStore
) -> None:
    old = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    old.use_pool(pool)
    route = checkpointed(cat, store, pool, PROMPT)
    old.hold(pool, route, old.whole_chunks(MODEL.fingerprint, PROMPT))
    old.sync()
    other = residency(cat, "other")
    assert other.reconcile() == 0  # another worker's replicas are not its business
    assert residency(cat).reconcile() == 3
    assert cat.replicas_at("worker:w") == []


def test_a_route_released_or_replaced_meanwhile_is_not_held(
    cat: Catalog, store: ChunkStore
) -> None:
    res = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    res.use_pool(pool)
    route = checkpointed(cat, store, pool, PROMPT)
    held = res.whole_chunks(MODEL.fingerprint, PROMPT)
    pool.release(route)
    res.hold(pool, route, held)
    res.use_pool(PagePool(MODEL.layout, 16, num_pages=8))
    res.hold(pool, route, held)
    assert res.resident_chunks == 0 and res.sync()["advertised"] == 0


def test_the_resident_prefix_is_forked_with_what_it_covers(cat: Catalog, store: ChunkStore) -> None:
    res = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    res.use_pool(pool)
    route = checkpointed(cat, store, pool, PROMPT)
    res.hold(pool, route, res.whole_chunks(MODEL.fingerprint, PROMPT))
    assert res.sync()["advertised"] == 3
    longer = [*PROMPT, 1, 2]
    match = cat.lookup("ns", MODEL.fingerprint, longer)
    found = res.resident_prefix(match)
    assert found is not None and (found.route, found.tokens) == (route, len(PROMPT))
    fork = res.fork(pool, route, 2 * CHUNK)
    assert pool.length(fork) == 2 * CHUNK
    assert pool.read(fork)[0].tobytes() == pool.read(route, 0, 2 * CHUNK)[0].tobytes()
    res.release(pool, route)
    # The fork holds the two chunks its positions cover whole, not the tail.
    assert res.sync()["withdrawn"] == 1
    assert len(cat.replicas_at("worker:w")) == 2
    found = res.resident_prefix(match)
    assert found is not None and (found.route, found.tokens) == (fork, 2 * CHUNK)


def test_holding_declares_demand_and_sync_reads_it_into_the_pool(
    cat: Catalog, store: ChunkStore
) -> None:
    res = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    res.use_pool(pool)
    a = checkpointed(cat, store, pool, PROMPT)
    b = checkpointed(cat, store, pool, [t ^ 1 for t in PROMPT])
    held_a = res.whole_chunks(MODEL.fingerprint, PROMPT)
    res.hold(pool, a, held_a)
    res.hold(pool, b, res.whole_chunks(MODEL.fingerprint, [t ^ 1 for t in PROMPT]))
    head_a = held_a[-1].prefix_hash
    assert cat.demand("ns", [head_a]) == {head_a: 1.0}
    cat.declare_demand("elsewhere", "ns", head_a, priority=2.0)
    res.sync()
    # b is newer, but a is demanded three times over: b goes first.
    assert pool.evict(1) == [b]


def test_invalidations_drop_the_routes_holding_quarantined_chunks(
    cat: Catalog, store: ChunkStore
) -> None:
    res = residency(cat)
    pool = PagePool(MODEL.layout, 16, num_pages=32)
    res.use_pool(pool)
    route = checkpointed(cat, store, pool, PROMPT)
    res.hold(pool, route, res.whole_chunks(MODEL.fingerprint, PROMPT))
    res.sync()
    keep = pool.new_route()
    match = cat.lookup("ns", MODEL.fingerprint, PROMPT)
    cat.quarantine("ns", match.chunks[1].prefix_hash, "bad kernel")
    assert res.apply_invalidations() == 1
    assert pool.routes() == [keep]
    assert res.sync()["withdrawn"] == 3
    assert res.apply_invalidations() == 0
    stats = res.invalidation_stats()
    assert (stats["invalidation_checks"], stats["invalidated_routes"]) == (2, 1)
    assert stats["invalidation_timer"] is False


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "2"])
def test_a_bad_timer_interval_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="invalidation_interval"):
        timer_interval(bad)
