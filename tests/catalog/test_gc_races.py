"""GC racing publishes, ref moves and restores: whoever commits first is seen by the other.

The catalog orders a GC's mark and a publish that extends (or re-records) the same
chunks through row locks on PostgreSQL and the single writer on SQLite. These tests
put each interleaving in a fixed order through the GC's delete callback (which runs
between the mark and the drop) and, on PostgreSQL, with a transaction held open.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from catalog.errors import PurgeInProgressError
from catalog.gc import plan_gc
from catalog.publish import record_in
from catalog.purge import apply_gc, resume_gc
from catalog.schema import Chunk
from catalog.transactions import hold
from chunkstore import ChunkStore, open_store
from chunkstore.errors import BlobNotFoundError
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer
from tests.catalog_helpers import CS, FP, chain_records, kill_gc_after_marking, publish, receipt

NS = "default"
A = list(range(12))  # a1 a2 a3
MODEL = ReferenceModel.small(seed=0)


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    c = Catalog.open(catalog_url, upgrade=True)
    c.ensure_namespace(NS, CS)
    yield c
    c.close()


def later() -> datetime:
    return datetime.now(UTC).replace(year=datetime.now(UTC).year + 1)


def states(cat: Catalog) -> dict[str, list[str]]:
    with cat.engine.connect() as conn:
        chunks = sorted(conn.execute(sa.text("SELECT state FROM chunks")).scalars())
        replicas = sorted(conn.execute(sa.text("SELECT state FROM replicas")).scalars())
    return {"chunks": chunks, "replicas": replicas}


def test_publish_and_ref_move_after_the_mark_are_refused_and_change_nothing(
    cat: Catalog,
) -> None:
    first = publish(cat, NS, A[:8])  # a1 a2
    a3 = chain_records(NS, A)[2]
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
    assert {i.prefix_hash for i in plan.items} == {r.prefix_hash for r in first}
    seen: dict[str, Any] = {}

    def delete_blob(location: str, key: str) -> bool:
        if not seen:  # between the mark and the drop, once
            seen["during"] = states(cat)
            for name, call in {
                "extend": lambda: cat.record_chunks([a3]),
                "re-record": lambda: cat.record_chunks([first[1]]),
                "ref": lambda: cat.create_ref(NS, "chat", FP, first[1].prefix_hash),
                "replica": lambda: cat.record_replica(first[1].blob_key, receipt("file:///b")),
            }.items():
                with pytest.raises(PurgeInProgressError, match="purg") as info:
                    call()
                seen[name] = info.value
            seen["after"] = states(cat)
        return True

    result = apply_gc(cat, plan, delete_blob)
    assert seen["during"] == {"chunks": ["purging"] * 2, "replicas": ["deleting"] * 2}
    assert seen["after"] == seen["during"]  # the refused calls changed nothing
    assert seen["extend"].prefixes == (first[1].prefix_hash,)
    assert result.chunks_removed == 2 and result.skipped == 0
    assert states(cat) == {"chunks": [], "replicas": []}
    assert cat.list_refs(NS) == []
    # Once the run is over the same publish goes through (parents put again).
    assert cat.record_chunks(chain_records(NS, A)).recorded == 3
    assert len(cat.lookup(NS, FP, A).chunks) == 3


def test_a_publish_that_extends_a_planned_node_first_spares_it_and_its_ancestors(
    cat: Catalog,
) -> None:
    first = publish(cat, NS, A[:8])
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
    assert len(plan.items) == 2
    cat.record_chunks([chain_records(NS, A)[2]])  # a3 under a2, after planning
    deleted: list[str] = []
    result = apply_gc(cat, plan, lambda loc, key: deleted.append(key) is None)
    assert result.skipped == 2 and result.chunks_removed == 0 and deleted == []
    assert len(cat.lookup(NS, FP, A).chunks) == 3
    assert states(cat)["chunks"] == ["ready"] * 3
    assert first[0].prefix_hash in {c.prefix_hash for c in cat.lookup(NS, FP, A).chunks}


def test_a_chunk_re_recorded_since_planning_is_spared(cat: Catalog) -> None:
    first = publish(cat, NS, A[:8])
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
    # The re-record must stamp another last_seen_at than the plan holds: wait until the
    # clock it reads is past the planned one (a fixed sleep hopes a coarse clock moved).
    planned = [i.last_seen_at for i in plan.items]
    assert len(planned) == 2 and None not in planned
    deadline = time.monotonic() + 10
    while datetime.now(UTC) <= max(t for t in planned if t is not None):
        assert time.monotonic() < deadline, "the wall clock never passed the planned last_seen_at"
        time.sleep(0.001)
    again = chain_records(NS, A[:8], receipts=[receipt("file:///second")])
    assert cat.record_chunks(again).already_present == 2
    result = apply_gc(cat, plan, lambda loc, key: True)
    assert result.skipped == 2 and result.chunks_removed == 0
    assert [c.prefix_hash for c in cat.lookup(NS, FP, A[:8]).chunks] == [
        r.prefix_hash for r in first
    ]


def seen_at(cat: Catalog) -> dict[bytes, Any]:
    with cat.engine.connect() as conn:
        return {
            bytes(r.prefix_hash): r.last_seen_at
            for r in conn.execute(sa.select(Chunk.prefix_hash, Chunk.last_seen_at))
        }


def test_a_re_record_moves_last_seen_only_where_its_chains_end(cat: Catalog) -> None:
    first = publish(cat, NS, A[:8])  # a1 a2
    before = seen_at(cat)
    a1, a2 = (r.prefix_hash for r in first)
    cat.record_chunks(chain_records(NS, A))  # a1 a2 again, a3 new below them
    assert {h: seen_at(cat)[h] for h in (a1, a2)} == {h: before[h] for h in (a1, a2)}
    deadline = time.monotonic() + 10
    while datetime.now(UTC) <= max(before.values()):
        assert time.monotonic() < deadline, "the wall clock never moved"
        time.sleep(0.001)
    cat.record_chunks(first)  # a1 a2 again: a2 ends the batch
    after = seen_at(cat)
    assert after[a1] == before[a1] and after[a2] > before[a2]


def test_a_plan_spares_a_whole_chain_re_recorded_through_its_end(cat: Catalog) -> None:
    publish(cat, NS, A)  # a1 a2 a3
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
    assert len(plan.items) == 3
    deadline = time.monotonic() + 10
    while datetime.now(UTC) <= max(i.last_seen_at for i in plan.items if i.last_seen_at):
        assert time.monotonic() < deadline, "the wall clock never moved"
        time.sleep(0.001)
    # Only a2 moves (it ends the batch); a1 is spared as a2's parent, a3 is not asked for.
    assert cat.record_chunks(chain_records(NS, A[:8])).already_present == 2
    result = apply_gc(cat, plan, lambda loc, key: True)
    assert result.skipped == 2 and result.chunks_removed == 1
    assert len(cat.lookup(NS, FP, A).chunks) == 2


def test_publishes_extending_a_shared_prefix_do_not_wait_for_each_other(catalog_url: str) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer: two publish transactions cannot overlap")
    cat = Catalog.open(catalog_url, upgrade=True)
    try:
        cat.ensure_namespace(NS, CS)
        publish(cat, NS, A[:8])  # the shared system prompt
        ours = chain_records(NS, A)
        theirs = chain_records(NS, [*A[:8], 90, 91, 92, 93])
        with cat.db.write() as held:
            record_in(cat.db, held, ours, None)  # open, holding what it locked
            with cat.db.write() as conn:
                # Any wait for a row lock the open publish holds fails at once.
                conn.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
                assert record_in(cat.db, conn, theirs, None).recorded == 1
        assert len(cat.lookup(NS, FP, A).chunks) == 3
        assert len(cat.lookup(NS, FP, [*A[:8], 90, 91, 92, 93]).chunks) == 3
    finally:
        cat.close()


def test_gc_that_waited_sees_a_child_committed_by_the_lock_holder(catalog_url: str) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer: the mark cannot overlap a publish transaction")
    cat = Catalog.open(catalog_url, upgrade=True)
    try:
        cat.ensure_namespace(NS, CS)
        publish(cat, NS, A[:8])
        a3 = chain_records(NS, A)[2]
        plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
        done: dict[str, Any] = {}
        gc = threading.Thread(
            target=lambda: done.update(r=apply_gc(cat, plan, lambda loc, key: True))
        )
        with cat.db.write() as conn:
            # The publish's own transaction: hold a2, start the GC, insert a3 and commit.
            ns = cat.db.namespace(conn, NS)
            assert ns is not None
            hold(conn, [ns[0]], {a3.parent_hash}, "test")
            gc.start()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with cat.engine.connect() as probe:
                    if probe.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                        )
                    ).scalar_one():
                        break
                time.sleep(0.02)
            else:
                pytest.fail("the GC's mark never waited for the publish's hold")
            record_in(cat.db, conn, [a3], None)
        gc.join(30)
        assert not gc.is_alive()
        assert done["r"].skipped == 2 and done["r"].chunks_removed == 0
        assert len(cat.lookup(NS, FP, A).chunks) == 3
    finally:
        cat.close()


def test_resume_finishes_what_a_failed_delete_left(cat: Catalog) -> None:
    first = publish(cat, NS, A[:8])
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())

    def unreachable(location: str, key: str) -> bool:
        raise OSError("store unreachable")

    result = apply_gc(cat, plan, unreachable)
    assert len(result.blobs_kept) == 2 and result.chunks_removed == 2
    assert states(cat) == {"chunks": [], "replicas": ["deleting"] * 2}
    # The bytes are still named by a row, so a publish of those chunks must wait.
    with pytest.raises(PurgeInProgressError, match="deleting"):
        cat.record_chunks(first)
    deleted: list[tuple[str, str]] = []
    again = resume_gc(cat, lambda loc, key: deleted.append((loc, key)) is None)
    assert again.resumed == 2 and sorted(deleted) == sorted(
        ("file:///store", r.blob_key) for r in first
    )
    assert states(cat) == {"chunks": [], "replicas": []}
    assert cat.record_chunks(first).recorded == 2
    assert resume_gc(cat, lambda loc, key: True).resumed == 0  # nothing left, nothing done


def test_resume_finishes_chunks_a_crashed_run_left_purging(cat: Catalog) -> None:
    first = publish(cat, NS, A[:8])
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later())
    kill_gc_after_marking(cat, plan)
    assert states(cat) == {"chunks": ["purging"] * 2, "replicas": ["deleting"] * 2}
    result = resume_gc(cat, lambda loc, key: True)
    assert result.chunks_removed == 2 and len(result.blobs_deleted) == 2
    assert states(cat) == {"chunks": [], "replicas": []}
    assert cat.lookup(NS, FP, A).chunks == ()
    assert cat.record_chunks(first).recorded == 2


# -- the checkpointer waits and publishes again ---------------------------------------


def test_checkpointer_republishes_what_a_concurrent_gc_purged(cat: Catalog, tmp_path: Path) -> None:
    store: ChunkStore = open_store(f"file://{tmp_path / 'blobs'}")
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    route = pool.new_route()
    toks = np.random.default_rng(3).integers(0, MODEL.vocab_size, 96).tolist()
    MODEL.prefill(pool, route, toks)
    cat.ensure_namespace("m", 32)
    ck = Checkpointer(cat, store, "m", 32)
    assert ck.checkpoint(pool, route, toks[:64], MODEL.fingerprint).new_chunks == 2
    plan = plan_gc(cat, "m", max_age_s=0, max_bytes=None, now=later())
    out: dict[str, Any] = {}
    waited = threading.Event()

    class Waited(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for GC" in record.getMessage():
                waited.set()

    handler = Waited()
    logging.getLogger("restore.checkpoint").addHandler(handler)
    logging.getLogger("restore.checkpoint").setLevel(logging.INFO)

    def delete_blob(location: str, key: str) -> bool:
        if "t" not in out:
            # Between mark and drop, a worker checkpoints the longer prompt: it must
            # wait for this run, then put the purged chunks again.
            out["t"] = threading.Thread(
                target=lambda: out.update(r=ck.checkpoint(pool, route, toks, MODEL.fingerprint))
            )
            out["t"].start()
            assert waited.wait(10), "the checkpoint should wait for the GC run"
        with contextlib.suppress(BlobNotFoundError):
            store.delete(key)
        return True

    try:
        apply_gc(cat, plan, delete_blob)
        out["t"].join(30)
    finally:
        logging.getLogger("restore.checkpoint").removeHandler(handler)
    res = out["r"]
    assert res.purge_retries >= 1 and res.new_chunks == 3
    for key in cat.replicas_at(store.name):
        store.get(key)  # every catalogued replica's bytes exist
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [store], "m") as r:
        got = r.restore(dst, toks, MODEL.fingerprint)
    assert got.restored_tokens == 95  # all but the last token, whose logits are needed
    k, v = dst.read(got.route)
    k0, v0 = pool.read(route)
    assert np.array_equal(k, k0[:, :95]) and np.array_equal(v, v0[:, :95])
    ck.close()
