"""Catalog conformance: one suite, run on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from catalog import chain_hash, chain_root, prefix_hashes
from catalog.catalog import Catalog
from catalog.errors import (
    CatalogError,
    CatalogInputError,
    NotFoundError,
    PublishError,
    RefConflictError,
    SchemaVersionError,
)
from catalog.models import Shard
from tests.catalog_helpers import CS, FP, FP2, chain_records, publish, receipt


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    c = Catalog.open(catalog_url, upgrade=True)
    c.ensure_namespace("default", CS)
    c.ensure_namespace("other", CS)
    yield c
    c.close()


def count(cat: Catalog, table: str) -> int:
    with cat.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


TOKENS = list(range(100, 114))  # 14 tokens: chunks of 4, 4, 4 and a tail of 2


# -- publish ---------------------------------------------------------------


def test_publish_records_everything_in_one_go(cat: Catalog) -> None:
    recs = chain_records("default", TOKENS)
    res = cat.record_chunks(recs)
    assert (res.recorded, res.already_present, res.replicas_added) == (4, 0, 4)
    assert count(cat, "prefixes") == 4 and count(cat, "chunks") == 4 and count(cat, "replicas") == 4
    assert [e.kind for e in cat.events()] == ["publish"]


def test_publish_is_idempotent(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS)
    with cat.engine.connect() as conn:
        seen1 = conn.execute(sa.text("SELECT max(last_seen_at) FROM chunks")).scalar_one()
    res = cat.record_chunks(recs)
    assert (res.recorded, res.already_present, res.replicas_added) == (0, 4, 0)
    assert count(cat, "prefixes") == 4 and count(cat, "chunks") == 4 and count(cat, "replicas") == 4
    with cat.engine.connect() as conn:
        seen2 = conn.execute(sa.text("SELECT max(last_seen_at) FROM chunks")).scalar_one()
    assert str(seen2) > str(seen1)


def test_orphan_chunk_is_refused_and_nothing_recorded(cat: Catalog) -> None:
    recs = chain_records("default", TOKENS, start_chunk=1)
    with pytest.raises(PublishError, match="not catalogued"):
        cat.record_chunks(recs)
    assert count(cat, "prefixes") == 0 and count(cat, "chunks") == 0 and count(cat, "events") == 0


def test_child_after_parent_in_a_later_batch(cat: Catalog) -> None:
    recs = chain_records("default", TOKENS)
    cat.record_chunks(recs[:2])
    assert cat.record_chunks(recs[2:]).recorded == 2


def test_same_chunk_with_other_bytes_keeps_the_first(cat: Catalog) -> None:
    first = publish(cat, "default", TOKENS[:4])
    second = chain_records("default", TOKENS[:4], salt="nondeterministic build")
    res = cat.record_chunks(second)
    assert len(res.conflicts) == 1
    assert res.conflicts[0].kept_key == first[0].blob_key
    assert res.conflicts[0].rejected_key == second[0].blob_key
    assert count(cat, "chunks") == 1 and count(cat, "replicas") == 1
    ev = cat.events(kind="conflict")
    assert len(ev) == 1 and ev[0].details["kept"] == first[0].blob_key
    assert ev[0].details["rejected"] == second[0].blob_key


def test_replica_only_with_a_receipt(cat: Catalog) -> None:
    recs = chain_records("default", TOKENS[:4], receipts=[])
    with pytest.raises(PublishError, match="receipt"):
        cat.record_chunks(recs)
    with pytest.raises(PublishError, match="bytes"):
        cat.record_chunks(chain_records("default", TOKENS[:4], receipts=[receipt(size=99)]))
    assert count(cat, "chunks") == 0


def test_inconsistent_records_are_refused(cat: Catalog) -> None:
    from dataclasses import replace

    rec = chain_records("default", TOKENS[:4])[0]
    with pytest.raises(PublishError, match="commit"):
        cat.record_chunks([replace(rec, tokens=[1, 2, 3, 4])])
    with pytest.raises(PublishError, match="chain root"):
        cat.record_chunks(
            [replace(rec, parent_hash=bytes(32), prefix_hash=chain_hash(bytes(32), rec.tokens))]
        )
    with pytest.raises(CatalogError, match="exceeds"):
        cat.record_chunks([replace(rec, shard=Shard(0, 9, 0, 2))])
    big = chain_records("default", list(range(8)), chunk_size=8)
    with pytest.raises(PublishError, match="chunk size"):
        cat.record_chunks(big)
    assert count(cat, "chunks") == 0


def test_broken_replica_revived_by_a_new_receipt(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS[:4])
    with cat.engine.begin() as conn:
        conn.execute(sa.text("UPDATE replicas SET state = 'missing'"))
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 0
    cat.record_chunks(recs)
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 4


# -- lookup ----------------------------------------------------------------


def test_lookup_full_chain_leaves_a_pending_token(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    m = cat.lookup("default", FP, TOKENS)
    assert m.matched_tokens == 13
    assert [(c.token_start, c.tokens_used) for c in m.chunks] == [(0, 4), (4, 4), (8, 4), (12, 1)]
    longer = cat.lookup("default", FP.hex, [*TOKENS, 7, 8])
    assert longer.matched_tokens == 14 and longer.hit
    assert [c.tokens_used for c in longer.chunks] == [4, 4, 4, 2]


def test_lookup_divergence_inside_a_chunk(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    query = [*TOKENS[:6], 999, 998, 997]
    m = cat.lookup("default", FP, query)
    assert m.matched_tokens == 6
    assert [(c.token_start, c.tokens_used) for c in m.chunks] == [(0, 4), (4, 2)]


def test_lookup_picks_the_sibling_sharing_most_tokens(cat: Catalog) -> None:
    base = TOKENS[:4]
    for tail in ([1, 2, 3, 4], [1, 2, 9, 9], [1, 5, 5, 5], [7, 7, 7, 7], [1, 2, 3]):
        publish(cat, "default", base + tail)
    m = cat.lookup("default", FP, [*base, 1, 2, 3, 8, 0, 0])
    assert m.matched_tokens == 7
    assert m.chunks[-1].tokens_used == 3
    got = m.chunks[-1].prefix_hash
    assert got in {
        chain_hash(m.chunks[0].prefix_hash, [1, 2, 3, 4]),
        chain_hash(m.chunks[0].prefix_hash, [1, 2, 3]),
    }
    m2 = cat.lookup("default", FP, [*base, 1, 2, 9, 0])
    assert m2.matched_tokens == 7 and m2.chunks[-1].prefix_hash == chain_hash(
        m.chunks[0].prefix_hash, [1, 2, 9, 9]
    )


def test_lookup_uses_a_stored_tail(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)  # tail [112, 113]
    m = cat.lookup("default", FP, [*TOKENS, 5, 6, 7])
    assert m.matched_tokens == 14 and m.chunks[-1].token_count == 2


def test_lookup_stops_at_unusable_or_quarantined_nodes(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS)
    with cat.engine.begin() as conn:
        conn.execute(
            sa.update(sa.table("replicas", sa.column("state"), sa.column("blob_key")))
            .where(sa.column("blob_key") == recs[2].blob_key)
            .values(state="corrupt")
        )
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 8
    cat.quarantine("default", recs[1].prefix_hash, "bad kernel")
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 4


def test_lookup_plan_places_each_chunk_as_the_catalog_does(cat: Catalog) -> None:
    # The walk does not read the prefix nodes: each chunk's parent, start and
    # length in the plan must still be exactly what the catalog stores.
    publish(cat, "default", TOKENS)
    m = cat.lookup("default", FP, [*TOKENS[:13], 999])
    assert m.matched_tokens == 13
    stored = cat.lineage("default", m.chunks[-1].prefix_hash)
    assert [(c.prefix_hash, c.parent_hash, c.token_start, c.token_count) for c in m.chunks] == [
        (p.prefix_hash, p.parent_hash, p.token_start, len(p.tokens)) for p in stored
    ]
    assert m.chunks[0].parent_hash == chain_root("default")


def test_lookup_is_per_fingerprint_shard_and_namespace(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    assert cat.lookup("default", FP2, TOKENS).matched_tokens == 0
    assert cat.lookup("other", FP, TOKENS).matched_tokens == 0
    assert cat.lookup("nowhere", FP, TOKENS).matched_tokens == 0
    assert cat.lookup("default", FP, TOKENS, shard=Shard(0, 1, 0, 2)).matched_tokens == 0
    publish(cat, "default", TOKENS, shard=Shard(0, 1, 0, 2))
    assert cat.lookup("default", FP, TOKENS, shard=Shard(0, 1, 0, 2)).matched_tokens == 13


def test_lookup_max_tokens_and_bad_input(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    m = cat.lookup("default", FP, TOKENS, max_tokens=6)
    assert m.matched_tokens == 6 and [c.tokens_used for c in m.chunks] == [4, 2]
    assert cat.lookup("default", FP, TOKENS[:1]).matched_tokens == 0
    with pytest.raises(CatalogError, match="empty"):
        cat.lookup("default", FP, [])
    with pytest.raises(CatalogError, match="malformed fingerprint"):
        cat.lookup("default", "nothex", TOKENS)
    with pytest.raises(CatalogError, match="range"):
        cat.lookup("default", FP, [1, -5, 3])


def test_replicas_best_tier_first_and_unusable_hidden(cat: Catalog) -> None:
    recs = chain_records(
        "default",
        TOKENS[:4],
        receipts=[
            receipt("s3://b/p", "object"),
            receipt("file:///l", "local"),
            receipt("worker:w1", "resident", worker="w1"),
            receipt("s3://b2/p", "object"),
        ],
    )
    cat.record_chunks(recs)
    with cat.engine.begin() as conn:
        conn.execute(sa.text("UPDATE replicas SET state = 'corrupt' WHERE location = 's3://b2/p'"))
    m = cat.lookup("default", FP, [*TOKENS[:4], 0])
    assert [r.location for r in m.chunks[0].replicas] == ["worker:w1", "file:///l", "s3://b/p"]


def _count_statements(cat: Catalog, fn: object) -> int:
    n = 0

    def before(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        nonlocal n
        if statement.strip().upper() not in ("BEGIN", "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"):
            n += 1

    sa.event.listen(cat.engine, "before_cursor_execute", before)
    try:
        fn()  # type: ignore[operator]
    finally:
        sa.event.remove(cat.engine, "before_cursor_execute", before)
    return n


def test_lookup_round_trips_are_constant(cat: Catalog) -> None:
    long = list(range(1000, 1000 + 40 * CS + 3))
    publish(cat, "default", long)
    cat.lookup("default", FP, long)  # warm the namespace and fingerprint caches
    short_n = _count_statements(cat, lambda: cat.lookup("default", FP, long[:10]))
    long_n = _count_statements(cat, lambda: cat.lookup("default", FP, long))
    div_n = _count_statements(cat, lambda: cat.lookup("default", FP, [*long[:130], 5, 5, 5]))
    assert cat.lookup("default", FP, long).matched_tokens == len(long) - 1
    assert long_n <= 2 and short_n <= 2 and div_n <= 2


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def test_a_young_catalog_reaches_sibling_chunks_by_prefix_hash(catalog_url: str) -> None:
    """Without statistics (a new or fast-growing catalog), PostgreSQL once planned the
    sibling probe as scans of every chunk of the fingerprint per sibling."""
    if not catalog_url.startswith("postgresql"):
        pytest.skip("SQLite's planner uses the identity index without statistics")
    cat = Catalog.open(catalog_url, upgrade=True)
    try:
        cat.ensure_namespace("default", CS)
        base = TOKENS[:4]
        recs = chain_records("default", base)
        for i in range(200):
            recs += chain_records("default", [*base, 5, i, 7, 7], start_chunk=1)
        cat.record_chunks(recs)
        with cat.engine.connect() as conn:
            assert (
                conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stats WHERE tablename = 'chunks'"
                ).scalar_one()
                == 0
            ), "the test needs a catalog without statistics"
        plans: list[Any] = []

        @sa.event.listens_for(cat.engine, "before_cursor_execute", retval=True)
        def explain(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> Any:
            if "sibling_candidates" in statement:
                cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params)
                plans.append(cursor.fetchone()[0][0]["Plan"])
            return statement, params

        m = cat.lookup("default", FP, [*base, 5, 100, 7, 0, 0])
        sa.event.remove(cat.engine, "before_cursor_execute", explain)
        assert m.matched_tokens == 7 and len(plans) == 1
        scans = [n for n in _plan_nodes(plans[0]) if n.get("Relation Name") == "chunks"]
        assert scans
        for n in scans:
            assert "prefix_hash" in n.get("Index Cond", ""), n
            assert n.get("Actual Rows", 0) <= 4, n  # at most four candidates
    finally:
        cat.close()


def test_the_sibling_probe_searches_one_parents_children_not_the_namespace(
    catalog_url: str,
) -> None:
    """A lookup ending inside a chunk probes the children of the last matched node. An index
    by (namespace, head) once drew both planners (SQLite always; PostgreSQL without
    statistics) into walking the namespace's every node in head order instead: the probe
    grew with the namespace (0.03 ms at 4 nodes, 0.5 ms at 2,400)."""
    cat = Catalog.open(catalog_url, upgrade=True)
    try:
        cat.ensure_namespace("default", CS)
        base = TOKENS[:4]
        recs = chain_records("default", [*base, 5, 6, 7, 8])
        # Many nodes of the namespace under other parents, their heads on both sides of q's.
        for i in range(300):
            recs += chain_records("default", [i, 1, 2, 3, 5, 6, 7, i % 9])
        cat.record_chunks(recs)
        plans: list[list[str]] = []

        @sa.event.listens_for(cat.engine, "before_cursor_execute", retval=True)
        def explain(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> Any:
            if "sibling_candidates" not in statement:
                return statement, params
            if catalog_url.startswith("postgresql"):
                cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
                nodes = _plan_nodes(cursor.fetchone()[0][0]["Plan"])
                plans.append(
                    [
                        f"{n['Node Type']} {n.get('Index Cond', '')}"
                        for n in nodes
                        if n.get("Relation Name") == "prefixes" and n.get("Alias") == "p"
                    ]
                )
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + statement, params)
                plans.append([str(r[-1]) for r in cursor.fetchall() if " p " in f" {r[-1]} "])
            return statement, params

        m = cat.lookup("default", FP, [*base, 5, 6, 9, 9, 9])
        sa.event.remove(cat.engine, "before_cursor_execute", explain)
        assert m.matched_tokens == 6 and len(plans) == 1
        probes = plans[0]
        assert probes, "the probes read no prefixes?"
        for probe in probes:
            assert "parent_hash" in probe, probes
    finally:
        cat.close()


# What reads every row of these tables grows with the whole catalog (issue 29: at ten
# million chunks, seconds per GC run or `kvc stats`), not with what it asks for.
_LARGE_TABLES = ("chunks", "replicas", "prefixes")
# Partial indexes holding only the rows an interrupted GC left: reading one whole is cheap.
_PARTIAL_INDEXES = ("ix_chunks_purging", "ix_replicas_deleting")


def _whole_table_reads(cat: Catalog, action: Any, *, replicas_by_key: bool = False) -> list[str]:
    """The scans of `action`'s statements that read a large table whole (none means every
    read of one goes through an index condition or a partial index); `replicas_by_key`:
    also every read of replicas whose condition does not start from a blob key."""
    found: list[str] = []
    postgres = cat.engine.dialect.name == "postgresql"
    # SQLite names a table by its alias in a plan: know replicas' reads by their index too.
    replica_indexes = {ix["name"] for ix in sa.inspect(cat.engine).get_indexes("replicas")}
    replica_indexes.add("sqlite_autoindex_replicas_1")

    @sa.event.listens_for(cat.engine, "before_cursor_execute", retval=True)
    def explain(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> Any:
        if not statement.lstrip().upper().startswith("SELECT"):
            return statement, params
        if postgres:
            # Only an index that cannot serve the query leaves a sequential scan then.
            cursor.execute("SET enable_seqscan = off")
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            plan = cursor.fetchone()[0][0]["Plan"]
            cursor.execute("RESET enable_seqscan")
            for n in _plan_nodes(plan):
                if n.get("Relation Name") not in _LARGE_TABLES:
                    continue
                partial = n.get("Index Name") in _PARTIAL_INDEXES
                cond = str(n.get("Index Cond", n.get("Recheck Cond", "")))
                unkeyed = (
                    replicas_by_key and n["Relation Name"] == "replicas" and "blob_key" not in cond
                )
                if n["Node Type"] == "Seq Scan" or unkeyed or not (partial or cond):
                    found.append(f"{n['Node Type']} on {n['Relation Name']}: {statement}")
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + statement, params)
            for row in cursor.fetchall():
                words = str(row[-1]).split()
                partial = any(ix in words for ix in _PARTIAL_INDEXES)
                replicas = words[1] == "replicas" or bool(set(words) & replica_indexes)
                unkeyed = replicas_by_key and replicas and "(blob_key=" not in str(row[-1])
                if (words[:1] == ["SCAN"] and words[1] in _LARGE_TABLES and not partial) or (
                    unkeyed and words[:1] in (["SCAN"], ["SEARCH"])
                ):
                    found.append(f"{row[-1]}: {statement}")
        return statement, params

    try:
        action()
    finally:
        sa.event.remove(cat.engine, "before_cursor_execute", explain)
    return found


def test_gc_checks_and_lookups_read_no_whole_table(cat: Catalog) -> None:
    """GC's resume of an interrupted run and its count of missing replicas read only what
    they ask for (revision 0007's indexes), and a lookup reads its replicas by blob key
    (an index by namespace once drew SQLite's lookup into reading a namespace's every
    replica per chunk), whatever the size of the catalog."""
    from catalog.admin import count_replicas_in_state
    from catalog.purge import resume_gc

    publish(cat, "default", TOKENS)
    publish(cat, "other", TOKENS)
    assert (
        _whole_table_reads(
            cat, lambda: count_replicas_in_state(cat, [receipt().location], "missing")
        )
        == []
    )
    assert _whole_table_reads(cat, lambda: resume_gc(cat, lambda loc, key: True)) == []
    lookup = lambda: cat.lookup("default", FP, TOKENS)  # noqa: E731
    assert _whole_table_reads(cat, lookup, replicas_by_key=True) == []
    # The check itself sees a whole-table read: every namespace's stats read them all.
    assert _whole_table_reads(cat, lambda: cat.stats(None))


def test_one_namespaces_stats_count_its_replicas_without_reading_the_table(cat: Catalog) -> None:
    """`kvc stats NAMESPACE` counts the namespace's replicas from its own chunks and the
    `deleting` ones an interrupted GC left, never by reading every replica (issue 29: a
    whole-table count per namespace took seconds at millions of chunks), and gets the
    same numbers as counting them by namespace."""
    recs = publish(cat, "default", TOKENS)
    publish(cat, "other", TOKENS)
    publish(cat, "other", [9, *TOKENS])
    cat.mark_replica(recs[0].blob_key, receipt().location, "corrupt", reason="test", namespace="default")
    # What an interrupted GC leaves: a replica `deleting` whose chunk row is already gone.
    cat.mark_replica(recs[-1].blob_key, receipt().location, "deleting", reason="gc", namespace="default")
    with cat.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM chunks WHERE blob_key = :k"), {"k": recs[-1].blob_key})
    for namespace in ("default", "other"):
        with cat.engine.connect() as conn:
            expected = dict(
                conn.execute(
                    sa.text(
                        "SELECT r.state, count(*) FROM replicas r"
                        " JOIN namespaces n ON n.id = r.namespace_id"
                        " WHERE n.name = :ns GROUP BY r.state"
                    ),
                    {"ns": namespace},
                ).all()
            )
        assert cat.stats(namespace)["replicas"] == expected
    assert cat.stats("default")["replicas"] == {
        "durable": len(recs) - 2,
        "corrupt": 1,
        "deleting": 1,
    }
    assert _whole_table_reads(cat, lambda: cat.stats("default")) == []


@pytest.mark.slow
def test_ten_thousand_siblings(cat: Catalog) -> None:
    base = TOKENS[:4]
    recs = chain_records("default", base)
    for i in range(10_000):
        recs += chain_records("default", [*base, 5, i // 100, i % 100, 7], start_chunk=1)
    for i in range(0, len(recs), 2000):
        cat.record_chunks(recs[i : i + 2000])
    assert count(cat, "chunks") == 10_001
    n = _count_statements(cat, lambda: cat.lookup("default", FP, [*base, 5, 42, 17, 9, 0]))
    m = cat.lookup("default", FP, [*base, 5, 42, 17, 9, 0])
    assert m.matched_tokens == 7 and n <= 2
    exact = cat.lookup("default", FP, [*base, 5, 42, 17, 7, 0])
    assert exact.matched_tokens == 8


def test_access_is_batched_then_recorded(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    for _ in range(3):
        cat.lookup("default", FP, TOKENS)
    cat.flush_access()
    with cat.engine.connect() as conn:
        counts = (
            conn.execute(sa.text("SELECT access_count FROM chunks ORDER BY access_count"))
            .scalars()
            .all()
        )
        last = conn.execute(
            sa.text("SELECT count(*) FROM chunks WHERE last_access_at IS NOT NULL")
        ).scalar_one()
    assert counts == [3, 3, 3, 3] and last == 4


# -- refs, lineage, quarantine ---------------------------------------------


def test_refs_like_branches(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS)
    heads = [r.prefix_hash for r in recs]
    ref = cat.create_ref("default", "main", FP, heads[1], pending_token=42)
    assert (ref.processed, ref.pending_token, ref.head_hash) == (8, 42, heads[1])
    assert cat.get_ref("default", "main") == ref
    with pytest.raises(RefConflictError, match="exists"):
        cat.create_ref("default", "main", FP, heads[0])
    moved = cat.update_ref(
        "default", "main", expected_head=heads[1], new_head=heads[3], pending_token=7
    )
    assert moved.processed == 14 and moved.pending_token == 7
    with pytest.raises(RefConflictError, match="moved"):
        cat.update_ref("default", "main", expected_head=heads[1], new_head=heads[2])
    fork = cat.fork_ref("default", "main", "experiment")
    assert fork.forked_from == "main" and fork.head_hash == heads[3]
    assert [r.name for r in cat.list_refs("default")] == ["experiment", "main"]
    assert cat.list_refs("other") == []
    cat.delete_ref("default", "experiment")
    with pytest.raises(NotFoundError):
        cat.get_ref("default", "experiment")
    with pytest.raises(NotFoundError):
        cat.delete_ref("default", "experiment")
    with pytest.raises(NotFoundError):
        cat.get_ref("other", "main")  # another namespace sees nothing
    with pytest.raises(NotFoundError, match="not catalogued"):
        cat.create_ref("other", "x", FP, heads[0])
    kinds = [e.kind for e in cat.events(namespace="default")]
    assert kinds.count("ref.create") == 2 and "ref.update" in kinds and "ref.delete" in kinds


def test_concurrent_compare_and_swap_has_one_winner(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS)
    heads = [r.prefix_hash for r in recs]
    cat.create_ref("default", "main", FP, heads[0])
    results: list[str] = []
    barrier = threading.Barrier(4)

    def mover(target: bytes) -> None:
        barrier.wait()
        try:
            cat.update_ref("default", "main", expected_head=heads[0], new_head=target)
            results.append("won")
        except RefConflictError:
            results.append("lost")

    threads = [threading.Thread(target=mover, args=(heads[i],)) for i in (1, 2, 3, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost", "lost", "lost", "won"]


def test_lineage_and_descendants(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS)
    publish(cat, "default", [*TOKENS[:8], 1, 2, 3, 4])
    lin = cat.lineage("default", recs[3].prefix_hash)
    assert [p.prefix_hash for p in lin] == [r.prefix_hash for r in recs]
    assert lin[0].parent_hash == chain_root("default") and lin[-1].tokens == (112, 113)
    desc = cat.descendants("default", recs[1].prefix_hash)
    assert len(desc) == 3 and recs[1].prefix_hash not in {d.prefix_hash for d in desc}
    with pytest.raises(NotFoundError):
        cat.lineage("other", recs[3].prefix_hash)


def test_quarantine_subtree_with_directives(cat: Catalog) -> None:
    recs = chain_records(
        "default",
        TOKENS,
        receipts=[receipt("file:///l", "local"), receipt("worker:w9", "resident", worker="w9")],
    )
    cat.record_chunks(recs)
    dirs = cat.quarantine("default", recs[2].prefix_hash, "numerics drift", actor="ops")
    assert {(d.blob_key, d.location) for d in dirs} == {
        (r.blob_key, loc) for r in recs[2:] for loc in ("file:///l", "worker:w9")
    }
    assert any(d.worker == "w9" and d.tier == "resident" for d in dirs)
    assert len(cat.events(kind="invalidate")) == 4
    q = cat.events(kind="quarantine")[0]
    assert q.actor == "ops" and q.details["reason"] == "numerics drift"
    assert cat.get_prefix("default", recs[3].prefix_hash).quarantined
    assert not cat.get_prefix("default", recs[1].prefix_hash).quarantined
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 8
    with pytest.raises(PublishError, match="quarantined"):
        cat.record_chunks(recs)
    with pytest.raises(NotFoundError):
        cat.quarantine("other", recs[0].prefix_hash, "x")


def test_namespaces_share_nothing(cat: Catalog) -> None:
    a = publish(cat, "default", TOKENS)
    b = publish(cat, "other", TOKENS)
    assert {r.prefix_hash for r in a}.isdisjoint({r.prefix_hash for r in b})
    assert prefix_hashes("default", TOKENS, CS) == [r.prefix_hash for r in a]


def test_demand_upserts(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS[:4])
    cat.declare_demand("w1", "default", recs[0].prefix_hash, priority=2.0, ttl_s=60)
    cat.declare_demand("w1", "default", recs[0].prefix_hash, priority=3.0, ttl_s=60)
    assert count(cat, "demand") == 1
    with pytest.raises(NotFoundError):
        cat.declare_demand("w1", "nowhere", recs[0].prefix_hash)


# -- schema ----------------------------------------------------------------


def test_older_missing_or_newer_schema_is_refused(catalog_url: str) -> None:
    from catalog import database

    with pytest.raises(SchemaVersionError, match="kvc db upgrade"):
        Catalog.open(catalog_url)
    c = Catalog.open(catalog_url, upgrade=True)
    older = sorted(database.known_revisions() - {database.head_revision()})[-1]
    database.downgrade(c.engine, older)
    c.close()
    with pytest.raises(SchemaVersionError, match=rf"{older}, this kvc needs .*kvc db upgrade"):
        Catalog.open(catalog_url)
    c = Catalog.open(catalog_url, upgrade=True)
    with c.engine.begin() as conn:  # a revision only a newer kvc knows
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    c.close()
    with pytest.raises(SchemaVersionError, match=r"9999, which this kvc does not know.*newer kvc"):
        Catalog.open(catalog_url)


def test_upgrade_from_empty_and_downgrade_to_empty(catalog_url: str) -> None:
    from catalog import database

    engine = database.create_engine(catalog_url)
    database.upgrade(engine)
    insp = sa.inspect(engine)
    tables = set(insp.get_table_names())
    assert {
        "namespaces",
        "fingerprints",
        "prefixes",
        "chunks",
        "stores",
        "replicas",
        "refs",
        "demand",
        "events",
    } <= tables
    assert {"v_chunks", "v_replica_health", "v_namespace_usage", "v_continuation_heads"} <= set(
        insp.get_view_names()
    )
    database.downgrade(engine, "base")
    insp = sa.inspect(engine)
    assert set(insp.get_table_names()) <= {"alembic_version"}
    assert insp.get_view_names() == []
    database.upgrade(engine)
    assert database.current_revision(engine) == database.head_revision()
    engine.dispose()


def test_models_and_migrations_agree(catalog_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from catalog import database
    from catalog.schema import Base

    engine = database.create_engine(catalog_url)
    database.upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    assert diff == []


def test_bad_urls(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="unsupported catalog URL"):
        Catalog.open("mysql://u:secret@h/db")
    with pytest.raises(CatalogError, match="malformed"):
        Catalog.open("not a url")
    with pytest.raises(CatalogError, match="does not exist"):
        Catalog.open(f"sqlite:///{tmp_path}/missing/dir/c.db")
    try:
        Catalog.open("mysql://u:secret@h/db")
    except CatalogError as exc:
        assert "secret" not in str(exc)


def test_every_sqlite_connection_has_the_catalog_pragmas(tmp_path: Path) -> None:
    """WAL, full fsync, foreign keys and a page cache that holds a long prompt's lookup."""
    from catalog.database import SQLITE_CACHE_KIB

    c = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    try:
        with c.engine.connect() as a, c.engine.connect() as b:  # two pooled connections
            for conn in (a, b):
                got = {
                    p: conn.exec_driver_sql(f"PRAGMA {p}").scalar_one()
                    for p in ("journal_mode", "synchronous", "foreign_keys", "cache_size")
                }
                assert got == {
                    "journal_mode": "wal",
                    "synchronous": 2,
                    "foreign_keys": 1,
                    "cache_size": -SQLITE_CACHE_KIB,
                }
        assert SQLITE_CACHE_KIB >= 8 * 1024  # a 128k-token lookup of a 1M-chunk catalog reads ~8 MB
    finally:
        c.close()


def test_fingerprints_are_stored_with_their_descriptor(cat: Catalog) -> None:
    assert cat.get_fingerprint(FP) is None
    publish(cat, "default", TOKENS[:4])
    got = cat.get_fingerprint(FP.hex)
    assert got == FP and got is not None and got.descriptor == FP.descriptor
    with cat.engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT descriptor FROM fingerprints")).scalar_one()
    stored = stored if isinstance(stored, dict) else json.loads(stored)
    assert stored["weights"] == "sha256:test" and stored["attention_layout"]["head_dim"] == 4


def test_mark_replica_hides_it_from_lookup_and_records_why(cat: Catalog) -> None:
    recs = publish(cat, "default", TOKENS[:4])
    key = recs[0].blob_key
    assert cat.mark_replica(key, "file:///store", "corrupt", reason="digest mismatch", actor="w1")
    assert cat.lookup("default", FP, TOKENS).matched_tokens == 0
    ev = cat.events(kind="replica.corrupt")
    assert len(ev) == 1 and ev[0].details == {
        "location": "file:///store",
        "reason": "digest mismatch",
    }
    assert not cat.mark_replica(key, "file:///elsewhere", "missing", reason="x")
    with pytest.raises(CatalogError, match="unknown replica state"):
        cat.mark_replica(key, "file:///store", "gone", reason="x")


def test_siblings_agreeing_beyond_the_indexed_head(cat: Catalog) -> None:
    # Chunks of 64 tokens: siblings share their first 40 tokens (more than the
    # 32 the sibling index holds); the one sharing the most still wins.
    cat.ensure_namespace("wide", 64)
    base = list(range(64))
    common = list(range(1000, 1040))
    for tail in (50, 51, 52, 53):
        publish(cat, "wide", [*base, *common, *[tail] * 24], chunk_size=64)
    publish(cat, "wide", [*base, *common[:39], 7, *[0] * 24], chunk_size=64)
    query = [*base, *common, 52, 52, 52, 9, 9, 9]
    m = cat.lookup("wide", FP, query)
    assert m.matched_tokens == 64 + 43
    n = _count_statements(cat, lambda: cat.lookup("wide", FP, query))
    assert n <= 2


def test_stats_and_placements(cat: Catalog) -> None:
    recs = chain_records(
        "default",
        TOKENS,
        receipts=[receipt("file:///l", "local"), receipt("worker:w1", "resident", worker="w1")],
    )
    cat.record_chunks(recs)
    publish(cat, "other", TOKENS[:4])
    st = cat.stats("default")
    assert (st["chunks"], st["prefixes"], st["stored_bytes"]) == (4, 4, 400)
    assert st["replicas"] == {"durable": 8}
    assert cat.stats()["chunks"] == 5 and cat.stats("nowhere")["chunks"] == 0
    held = cat.replicas_at("worker:w1")
    assert held == sorted(r.blob_key for r in recs)
    assert cat.remove_replicas("worker:w1", held[:2], reason="evicted") == 2
    assert len(cat.replicas_at("worker:w1")) == 2
    assert cat.events(kind="replica.remove")[0].details == {"replicas": 2, "reason": "evicted"}


def test_a_refused_publish_leaves_no_cached_fingerprint_or_namespace(cat: Catalog) -> None:
    # A batch with a new fingerprint for a new namespace, refused: the namespace is
    # created with the default chunk size, which the records do not fit. The
    # rolled-back rows must not linger in the catalog's caches either.
    bad = chain_records("fresh", list(range(8)), fp=FP2)
    with pytest.raises(PublishError, match="does not fit"):
        cat.record_chunks(bad)
    assert cat.get_fingerprint(FP2.hex) is None
    assert count(cat, "fingerprints") == 0 and count(cat, "namespaces") == 2
    # Created for real, then published: both work (each once failed on a foreign key).
    cat.ensure_namespace("fresh", CS)
    assert cat.record_chunks(bad).recorded == 2
    assert cat.get_fingerprint(FP2.hex) == FP2
    assert len(cat.lookup("fresh", FP2, list(range(9))).chunks) == 2


def test_a_long_prompt_in_small_chunks_stays_under_sqlites_variable_limit(tmp_path: Path) -> None:
    import sqlite3

    from catalog.base import MIN_CHUNK_SIZE

    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)

    # SQLite's own default (many builds, this interpreter's may allow more): 32766 variables.
    @sa.event.listens_for(cat.db.engine, "connect")
    def default_limit(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32766)

    cat.db.engine.dispose()
    try:
        cs = MIN_CHUNK_SIZE
        cat.ensure_namespace("small", cs)
        prompt = [(i * 7919) % 50000 for i in range(300_000)]  # 75,000 chunks: 75,000 hashes
        stored = publish(cat, "small", prompt[: 3 * cs], chunk_size=cs)
        match = cat.lookup("small", FP, prompt)
        assert match.matched_tokens == 3 * cs
        assert [c.prefix_hash for c in match.chunks] == [r.prefix_hash for r in stored]
        hashes = prefix_hashes("small", prompt, cs)
        found = cat.known_blob_keys("small", FP, hashes, Shard.full(FP.layout))
        assert found == {r.prefix_hash: r.blob_key for r in stored}
        assert cat.demand("small", hashes) == {}
    finally:
        cat.close()


@pytest.mark.parametrize("chunk_size", [0, 1, 3, 65537, True])
def test_a_chunk_size_out_of_bounds_is_refused_naming_the_bounds(
    cat: Catalog, chunk_size: int
) -> None:
    with pytest.raises(CatalogInputError, match=r"chunk_size must be an int in 4\.\.65536"):
        cat.ensure_namespace("odd", chunk_size)
    assert cat.namespace_chunk_size("odd") is None
