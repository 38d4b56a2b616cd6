"""Catalog-side GC: roots, retention by age and bytes, the subtree rule, quarantine, the lock.

Every test runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from catalog.gc import GcPlan, acquire_lock, lock_holder, plan_gc, release_lock
from catalog.purge import apply_gc
from catalog.schema import Chunk, Lock, Pin
from tests.catalog_helpers import CS, FP, chain_records, kill_gc_after_marking, publish, receipt

NS = "default"
NOW = datetime.now(UTC)
DAY = 86400.0
A = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # a1 a2 a3
B = [0, 1, 2, 3, 50, 51, 52, 53, 54, 55, 56, 57]  # a1 b2 b3


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    c = Catalog.open(catalog_url, upgrade=True)
    c.ensure_namespace(NS, CS)
    yield c
    c.close()


@pytest.fixture
def tree(cat: Catalog) -> dict[str, bytes]:
    """Two chains sharing their first chunk: a1 -> a2 -> a3 and a1 -> b2 -> b3 (100 bytes each)."""
    a = publish(cat, NS, A)
    b = publish(cat, NS, B)
    nodes = {"a1": a[0].prefix_hash, "a2": a[1].prefix_hash, "a3": a[2].prefix_hash}
    nodes |= {"b2": b[1].prefix_hash, "b3": b[2].prefix_hash}
    for name in nodes:
        use(cat, nodes, name, age_s=60, count=0)
    return nodes


def use(cat: Catalog, nodes: dict[str, bytes], name: str, *, age_s: float, count: int) -> None:
    # Through the schema's UTCDateTime (not raw SQL with a naive value): SQLite gets naive
    # UTC text, PostgreSQL an aware value for its timestamptz column. A naive value in raw
    # SQL would be read by PostgreSQL in the session's TimeZone, not as UTC.
    with cat.engine.begin() as conn:
        conn.execute(
            sa.update(Chunk)
            .where(Chunk.prefix_hash == nodes[name])
            .values(last_access_at=NOW - timedelta(seconds=age_s), access_count=count)
        )


def purged(plan: GcPlan, nodes: dict[str, bytes]) -> dict[str, str]:
    names = {h: n for n, h in nodes.items()}
    return {names[i.prefix_hash]: i.reason for i in plan.items}


def count(cat: Catalog, table: str) -> int:
    with cat.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_a_ref_protects_its_lineage(cat: Catalog, tree: dict[str, bytes]) -> None:
    cat.create_ref(NS, "chat", FP, tree["a3"])
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW)
    assert purged(plan, tree) == {"b2": "age", "b3": "age"}
    assert plan.roots == 1 and plan.bytes_before == 500 and plan.bytes_after == 300
    # Bytes retention cannot go below the roots either.
    assert set(purged(plan_gc(cat, NS, max_age_s=None, max_bytes=0, now=NOW), tree)) == {
        "b2",
        "b3",
    }


def test_age_purges_only_old_leaves(cat: Catalog, tree: dict[str, bytes]) -> None:
    use(cat, tree, "b3", age_s=2 * DAY, count=9)
    use(cat, tree, "a2", age_s=2 * DAY, count=0)  # old, but a3 below it is recent
    assert purged(plan_gc(cat, NS, max_age_s=DAY, max_bytes=None, now=NOW), tree) == {"b3": "age"}
    # Once the leaf goes, an old parent becomes a leaf and goes too.
    use(cat, tree, "b2", age_s=3 * DAY, count=0)
    got = purged(plan_gc(cat, NS, max_age_s=DAY, max_bytes=None, now=NOW), tree)
    assert got == {"b3": "age", "b2": "age"}
    assert purged(plan_gc(cat, NS, max_age_s=None, max_bytes=None, now=NOW), tree) == {}


def test_bytes_purge_least_valuable_leaves_first(cat: Catalog, tree: dict[str, bytes]) -> None:
    use(cat, tree, "a3", age_s=60, count=5)
    use(cat, tree, "b3", age_s=60, count=1)
    use(cat, tree, "b2", age_s=60, count=10)
    # a1 and a2 are never used but have descendants: they cannot go before them.
    plan = plan_gc(cat, NS, max_age_s=None, max_bytes=300, now=NOW)
    assert [purged(plan, tree)] == [{"b3": "bytes", "a3": "bytes"}]
    assert [i.prefix_hash for i in plan.items] == [tree["b3"], tree["a3"]]
    assert plan.bytes_after == 300
    plan = plan_gc(cat, NS, max_age_s=None, max_bytes=200, now=NOW)
    assert list(purged(plan, tree)) == ["b3", "a3", "a2"]  # a2 became a leaf, worth 0
    everything = purged(plan_gc(cat, NS, max_age_s=None, max_bytes=0, now=NOW), tree)
    assert list(everything)[-1] == "a1"  # the shared parent goes last, with its whole subtree
    # Ties on use count: the least recently used goes first.
    use(cat, tree, "a3", age_s=10 * DAY, count=1)
    assert list(purged(plan_gc(cat, NS, max_age_s=None, max_bytes=400, now=NOW), tree)) == ["a3"]


def test_quarantined_subtree_is_purged_unless_a_root_needs_it(
    cat: Catalog, tree: dict[str, bytes]
) -> None:
    cat.quarantine(NS, tree["b2"], "bad build")
    plan = plan_gc(cat, NS, max_age_s=None, max_bytes=None, now=NOW)
    assert purged(plan, tree) == {"b2": "quarantined", "b3": "quarantined"}
    cat.create_ref(NS, "bad", FP, tree["b3"])
    plan = plan_gc(cat, NS, max_age_s=None, max_bytes=None, now=NOW)
    assert purged(plan, tree) == {}
    assert set(plan.kept_quarantined) == {tree["b2"], tree["b3"]}
    assert plan.to_json()["kept_quarantined"]


def test_demand_protects_until_it_expires(cat: Catalog, tree: dict[str, bytes]) -> None:
    cat.declare_demand("w1", NS, tree["b3"], ttl_s=600)
    now = datetime.now(UTC)
    assert set(purged(plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=now), tree)) == {"a2", "a3"}
    later = now + timedelta(seconds=1200)
    assert set(purged(plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later), tree)) == set(tree)


def test_a_pin_protects_its_lineage_until_it_expires_or_is_removed(
    cat: Catalog, tree: dict[str, bytes]
) -> None:
    pin = cat.pin(NS, "launch", tree["b2"], ttl_s=600, reason="keep b", actor="ops")
    assert pin.live and pin.expires_at is not None and pin.created_by == "ops"
    now = datetime.now(UTC)
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=now)
    assert set(purged(plan, tree)) == {"a2", "a3", "b3"} and plan.roots == 1
    # Bytes retention cannot go below a pin either.
    assert set(purged(plan_gc(cat, NS, max_age_s=None, max_bytes=0, now=now), tree)) == {
        "a2",
        "a3",
        "b3",
    }
    # Expired, it protects nothing (and is listed as such).
    later = now + timedelta(seconds=1200)
    assert set(purged(plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later), tree)) == set(tree)
    # Setting it again moves it and restarts its expiry; without a ttl it never expires.
    moved = cat.pin(NS, "launch", tree["a3"])
    assert moved.expires_at is None and moved.prefix_hash == tree["a3"]
    assert [(p.name, p.prefix_hash, p.live) for p in cat.list_pins(NS)] == [
        ("launch", tree["a3"], True)
    ]
    assert set(purged(plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later), tree)) == {
        "b2",
        "b3",
    }
    cat.unpin(NS, "launch")
    assert cat.list_pins(NS) == []
    assert set(purged(plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=later), tree)) == set(tree)
    kinds = [e.kind for e in cat.events(namespace=NS) if e.kind.startswith("pin.")]
    assert kinds == ["pin.set", "pin.set", "pin.remove"]


def test_an_expired_pin_goes_with_the_prefix_gc_purges(cat: Catalog, tree: dict[str, bytes]) -> None:
    cat.pin(NS, "short", tree["b3"], ttl_s=1)
    cat.pin(NS, "other", tree["a3"], ttl_s=1)
    assert count(cat, "pins") == 2
    with cat.engine.begin() as conn:  # the pins' expiry passes
        conn.execute(sa.update(Pin).values(expires_at=datetime.now(UTC) - timedelta(seconds=2)))
    assert not any(p.live for p in cat.list_pins(NS))
    assert cat.list_pins(NS, include_expired=False) == []
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=datetime.now(UTC))
    assert set(purged(plan, tree)) == set(tree)
    apply_gc(cat, plan, lambda loc, key: True)
    assert count(cat, "pins") == 0 and count(cat, "prefixes") == 0


def test_bad_pins_are_refused_and_change_nothing(cat: Catalog, tree: dict[str, bytes]) -> None:
    from catalog.errors import CatalogError, NotFoundError

    cat.pin(NS, "keep", tree["a1"])
    for name in ("", "x" * 256, "tab\there"):
        with pytest.raises(CatalogError, match="invalid pin name"):
            cat.pin(NS, name, tree["a2"])
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(CatalogError, match="ttl"):
            cat.pin(NS, "keep", tree["a2"], ttl_s=ttl)
    with pytest.raises(CatalogError, match="reason"):
        cat.pin(NS, "keep", tree["a2"], reason="r" * 1025)
    with pytest.raises(CatalogError):
        cat.pin(NS, "keep", b"short")
    with pytest.raises(NotFoundError):  # not catalogued in this namespace
        cat.pin(NS, "keep", bytes(32))
    with pytest.raises(NotFoundError):
        cat.pin("no-such-namespace", "keep", tree["a2"])
    with pytest.raises(NotFoundError):
        cat.unpin(NS, "no-such-pin")
    assert [(p.name, p.prefix_hash) for p in cat.list_pins(NS)] == [("keep", tree["a1"])]


def test_a_pin_on_a_prefix_gc_is_purging_is_refused(cat: Catalog, tree: dict[str, bytes]) -> None:
    from catalog.errors import PurgeInProgressError

    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW)
    kill_gc_after_marking(cat, plan)
    with pytest.raises(PurgeInProgressError):
        cat.pin(NS, "late", tree["a3"])
    assert cat.list_pins(NS) == []


def test_lock_one_holder_at_a_time_and_a_stale_one_expires(cat: Catalog) -> None:
    assert acquire_lock(cat, "gc", "one", 600)
    assert not acquire_lock(cat, "gc", "two", 600)
    assert acquire_lock(cat, "gc", "one", 600)  # the holder renews
    assert not release_lock(cat, "gc", "two")
    holder = lock_holder(cat, "gc")
    assert holder is not None and holder[0] == "one"
    with cat.engine.begin() as conn:  # "one" crashed long ago
        conn.execute(sa.update(Lock).values(expires_at=datetime(2000, 1, 1, tzinfo=UTC)))
    assert acquire_lock(cat, "gc", "two", 600)
    assert not acquire_lock(cat, "gc", "one", 600)
    assert [e.details["previous"] for e in cat.events(kind="lock.takeover")] == ["one"]
    assert release_lock(cat, "gc", "two") and lock_holder(cat, "gc") is None
    assert acquire_lock(cat, "gc", "three", 600)


def test_planning_changes_nothing(cat: Catalog, tree: dict[str, bytes]) -> None:
    before = {t: count(cat, t) for t in ("chunks", "prefixes", "replicas", "events")}
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=0, now=NOW)
    assert len(plan.items) == 5
    assert {t: count(cat, t) for t in before} == before


def test_apply_deletes_blobs_and_rows_with_events(cat: Catalog, tree: dict[str, bytes]) -> None:
    cat.create_ref(NS, "chat", FP, tree["a3"])
    # b3 has a second replica on a worker this caller cannot reach.
    b3 = chain_records(NS, B)[2]
    cat.record_replica(b3.blob_key, receipt(location="worker:w1", tier="resident"))
    blobs = {("file:///store", r.blob_key) for r in chain_records(NS, A) + chain_records(NS, B)}
    calls: list[tuple[str, str]] = []

    def delete_blob(location: str, key: str) -> bool:
        calls.append((location, key))
        if location.startswith("worker:"):
            return False
        blobs.discard((location, key))
        return True

    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW)
    result = apply_gc(cat, plan, delete_blob)
    b2 = chain_records(NS, B)[1]
    assert result.chunks_removed == 2 and result.prefixes_removed == 2
    assert sorted(result.blobs_deleted) == sorted(
        [("file:///store", b2.blob_key), ("file:///store", b3.blob_key)]
    )
    assert result.blobs_kept == [("worker:w1", b3.blob_key, "location not reachable")]
    assert ("file:///store", b2.blob_key) not in blobs and len(blobs) == 3
    assert count(cat, "chunks") == 3 and count(cat, "prefixes") == 3
    with cat.engine.connect() as conn:
        left = conn.execute(
            sa.text("SELECT location, state FROM replicas WHERE blob_key = :k"), {"k": b3.blob_key}
        ).all()
    assert [tuple(r) for r in left] == [("worker:w1", "deleting")]
    kinds = [e.kind for e in cat.events(namespace=NS)]
    assert kinds.count("chunk.purge") == 2 and kinds.count("replica.deleting") == 2
    assert kinds.count("replica.delete") == 2 and kinds[-1] == "gc"
    # Nothing left to do: a second plan is empty.
    assert plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW).items == []


def test_apply_keeps_a_blob_a_kept_chunk_still_names(cat: Catalog, tree: dict[str, bytes]) -> None:
    # Another fingerprint's chunk at a1 (kept: a ref on a3) names b3's blob.
    b3 = chain_records(NS, B)[2]
    a1 = chain_records(NS, A)[0]
    other = dataclasses.replace(
        a1, shard=dataclasses.replace(a1.shard, head_hi=1), blob_key=b3.blob_key
    )
    cat.record_chunks([other])
    cat.create_ref(NS, "chat", FP, tree["a3"])
    calls: list[tuple[str, str]] = []
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW)
    result = apply_gc(cat, plan, lambda loc, key: calls.append((loc, key)) is None)
    assert result.shared_blobs == [b3.blob_key]
    assert [k for _, k in calls] == [chain_records(NS, B)[1].blob_key]
    with cat.engine.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state FROM replicas WHERE blob_key = :k"), {"k": b3.blob_key}
        ).scalar_one()
    assert state == "durable" and count(cat, "chunks") == 4


def test_apply_skips_what_became_a_root_since_planning(
    cat: Catalog, tree: dict[str, bytes]
) -> None:
    plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=NOW)
    cat.create_ref(NS, "late", FP, tree["b3"])
    result = apply_gc(cat, plan, lambda loc, key: True)
    assert result.skipped == 3  # b3, b2, a1 are now a lineage
    assert count(cat, "chunks") == 3


@pytest.fixture
def cli_home(catalog_url: str, tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    """A home populated as tests.kvc.test_cli_commands._populate does (100 tokens checkpointed
    as ref `chat`: 4 chunks), with its catalog on either database: its catalog URL and the
    CLI's environment. SQLite is the embedded default (the home's catalog.db, found through
    KVC_HOME alone); PostgreSQL is given as KVC_CATALOG_URL, with KVC_STORES naming the
    home's blob directory so the store is the same."""
    import numpy as np

    from chunkstore import open_store
    from restore.checkpoint import Checkpointer
    from restore.pool import PagePool
    from tests.kvc.test_cli_commands import CHUNK, MODEL

    path = tmp_path / "home"
    path.mkdir()
    store_url = f"file://{path / 'blobs'}"
    if catalog_url.startswith("sqlite"):
        catalog_url = f"sqlite:///{path / 'catalog.db'}"  # the home's own, not the fixture's
        env = {"KVC_HOME": str(path)}
    else:
        env = {"KVC_HOME": str(path), "KVC_CATALOG_URL": catalog_url, "KVC_STORES": store_url}
    tokens = np.random.default_rng(1).integers(0, MODEL.vocab_size, 100).tolist()
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    with (
        Catalog.open(catalog_url, upgrade=True) as cat,
        Checkpointer(cat, open_store(store_url), chunk_size=CHUNK) as cp,
    ):
        cp.checkpoint(pool, route, tokens, MODEL.fingerprint, name="chat", pending=3)
    return path, catalog_url, env


def test_cli_gc_dry_run_lock_and_retention(cli_home: tuple[Path, str, dict[str, str]]) -> None:
    from tests.kvc.test_cli_commands import Home, kvc, one_line_error

    path, url, env = cli_home
    with Catalog.open(url) as cat:
        cat.delete_ref(NS, "chat")
        before = count(cat, "chunks")
        with cat.engine.connect() as conn:
            keys = list(conn.execute(sa.select(Chunk.blob_key)).scalars())
    blob_path = Home(path, []).blob_path
    assert all(blob_path(k).exists() for k in keys)
    dry = json.loads(kvc("gc", "--dry-run", "--max-age", "0", "--json", env=env).stdout)
    assert len(dry["retention"]["items"]) == before == 4
    assert {"prefix", "blob_key"} <= set(dry["retention"]["items"][0])
    # People read each chunk's two hashes with their names.
    human = kvc("gc", "--dry-run", "--max-age", "0", env=env).stdout.splitlines()
    purges = [line for line in human if line.startswith("would purge chunk")]
    item = dry["retention"]["items"][0]
    assert len(purges) == 4 and all(" prefix " in p and " blob " in p for p in purges)
    assert any(f"prefix {item['prefix'][:16]} blob {item['blob_key'][:16]}" in p for p in purges)
    with Catalog.open(url) as cat:
        assert count(cat, "chunks") == before
        assert acquire_lock(cat, "gc", "someone else", 600)
    one_line_error(kvc("gc", "--max-age", "0", env=env), 1)
    with Catalog.open(url) as cat:
        release_lock(cat, "gc", "someone else")
    out = kvc("gc", "--max-age", "0", "--json", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["retention"]["result"]["chunks_removed"] == 4
    assert len(doc["retention"]["result"]["blobs_deleted"]) == 4
    assert not any(blob_path(k).exists() for k in keys)
    with Catalog.open(url) as cat:
        assert count(cat, "chunks") == 0 and count(cat, "replicas") == 0
        assert lock_holder(cat, "gc") is None


def test_cli_pins_keep_a_prefix_through_gc(cli_home: tuple[Path, str, dict[str, str]]) -> None:
    from tests.kvc.test_cli_commands import kvc, one_line_error

    _path, url, env = cli_home
    with Catalog.open(url) as cat:
        head = cat.get_ref(NS, "chat").head_hash
        second = cat.lineage(NS, head)[1].prefix_hash
        cat.delete_ref(NS, "chat")
    out = kvc("pins", "set", "keep", second.hex()[:12], "--reason", "demo", "--json", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prefix"] == second.hex() and doc["expires_at"] is None and doc["live"]
    listed = kvc("pins", "list", env=env)
    assert listed.returncode == 0 and listed.stdout.startswith("keep ")
    assert "never expires" in listed.stdout and "demo" in listed.stdout
    gc = json.loads(kvc("gc", "--max-age", "0", "--json", env=env).stdout)
    assert gc["retention"]["result"]["chunks_removed"] == 2  # the two below the pin
    with Catalog.open(url) as cat:
        assert count(cat, "chunks") == 2
    one_line_error(kvc("pins", "set", "bad", "00" * 32, env=env), 1)  # not catalogued
    bad_ttl = kvc("pins", "set", "keep", second.hex(), "--ttl", "0", env=env)
    assert bad_ttl.returncode == 2 and "'--ttl'" in bad_ttl.stderr
    one_line_error(kvc("pins", "rm", "nope", env=env), 1)
    assert kvc("pins", "rm", "keep", env=env).returncode == 0
    assert json.loads(kvc("pins", "list", "--json", env=env).stdout)["pins"] == []
    gc = json.loads(kvc("gc", "--max-age", "0", "--json", env=env).stdout)
    assert gc["retention"]["result"]["chunks_removed"] == 2
