"""catalog.admin: the operator queries behind kvc show/stores/fsck/gc, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from catalog import admin
from catalog.catalog import Catalog
from tests.catalog_helpers import CS, FP, FP2, chain_records, publish, receipt

NS = "default"
A = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # chunks [0, 4), [4, 8) and a tail [8, 10)
LOCAL = "file:///store"
OBJECT = "s3://bucket/kv"


@pytest.fixture(params=["sqlite", "postgres"])
def cat(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    c = Catalog.open(url, upgrade=True)
    c.ensure_namespace(NS, CS)
    yield c
    c.close()


@pytest.fixture
def chain(cat: Catalog) -> list[bytes]:
    """A chain of three chunks with a local and an object replica each; a ref on its head."""
    recs = publish(cat, NS, A, receipts=[receipt(OBJECT, "object"), receipt(LOCAL, "local")])
    cat.create_ref(NS, "main", FP, recs[-1].prefix_hash)
    return [r.prefix_hash for r in recs]


def keys(cat: Catalog, prefix: bytes) -> list[str]:
    return [c.blob_key for c in admin.chunks_at(cat, prefix)]


def test_candidates_find_unique_and_ambiguous_prefixes(cat: Catalog, chain: list[bytes]) -> None:
    h = chain[1]
    assert admin.prefix_candidates(cat, NS, h.hex()[:8]) == [h]
    assert admin.prefix_candidates(cat, NS, h.hex()) == [h]
    assert admin.prefix_candidates(cat, "other", h.hex()[:8]) == []  # another namespace
    every = admin.prefix_candidates(cat, NS, "", limit=10)
    assert sorted(every) == sorted(chain)
    (key,) = keys(cat, h)
    assert admin.blob_candidates(cat, NS, key[:10]) == [key]
    assert admin.blob_candidates(cat, "other", key[:10]) == []
    assert len(admin.blob_candidates(cat, NS, "", limit=10)) == 3


def test_replicas_of_are_best_tier_first(cat: Catalog, chain: list[bytes]) -> None:
    (key,) = keys(cat, chain[0])
    found = admin.replicas_of(cat, [key, "ab" * 32])
    assert found["ab" * 32] == []
    local, obj = found[key]
    assert (local.location, local.tier, local.size) == (LOCAL, "local", 100)
    assert (obj.location, obj.tier, obj.size) == (OBJECT, "object", 100)
    assert local.state == "durable" and local.blob_key == key
    assert admin.replicas_of(cat, []) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        local.state = "missing"  # type: ignore[misc]


def test_show_queries(cat: Catalog, chain: list[bytes]) -> None:
    (c0,) = admin.chunks_at(cat, chain[0])
    assert c0.fingerprint == FP.hex and (c0.layer_lo, c0.layer_hi) == (0, 2)
    assert (c0.stored_bytes, c0.codec, c0.access_count) == (100, "raw", 0)
    assert admin.prefix_links(cat, chain[0]) == admin.PrefixLinks(children=1, refs=())
    assert admin.prefix_links(cat, chain[-1]) == admin.PrefixLinks(children=0, refs=("main",))
    (b,) = admin.chunks_of_blob(cat, c0.blob_key)
    assert (b.prefix_hash, b.token_start, b.token_end) == (chain[0], 0, 4)
    assert admin.chunks_of_blob(cat, "ab" * 32) == []
    assert admin.replica_states(cat, chain, FP.hex) == {"durable": 6}
    assert admin.replica_states(cat, chain, FP2.hex) == {}


def test_recent_events_newest_first(cat: Catalog, chain: list[bytes]) -> None:
    (key,) = keys(cat, chain[0])
    cat.mark_replica(key, LOCAL, "corrupt", reason="test")
    cat.mark_replica(key, LOCAL, "durable", reason="test")
    events = admin.recent_events(cat, [key, "main"], 10)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs, reverse=True)
    assert {e.subject for e in events} == {key, "main"}
    assert "ref.create" in [e.kind for e in events]
    assert len(admin.recent_events(cat, [key, "main"], 1)) == 1
    assert admin.recent_events(cat, [key], 0) == [] and admin.recent_events(cat, [], 5) == []


def test_store_and_fsck_queries(cat: Catalog, chain: list[bytes]) -> None:
    k0, k1, k2 = (keys(cat, h)[0] for h in chain)
    cat.mark_replica(k1, LOCAL, "missing", reason="test")
    assert {(s.name, s.kind, s.tier) for s in admin.known_stores(cat)} == {
        (LOCAL, "file", "local"),
        (OBJECT, "s3", "object"),
    }
    counts = {(c.location, c.tier, c.state): c.count for c in admin.replica_counts(cat)}
    assert counts == {
        (LOCAL, "local", "durable"): 2,
        (LOCAL, "local", "missing"): 1,
        (OBJECT, "object", "durable"): 3,
    }
    checks = admin.replicas_to_check(cat, [LOCAL])
    assert [(c.blob_key, c.state, c.size) for c in checks] == sorted(
        [(k0, "durable", 100), (k1, "missing", 100), (k2, "durable", 100)]
    )
    assert admin.replicas_elsewhere(cat, [LOCAL]) == {OBJECT: 3}
    assert admin.replicas_elsewhere(cat, []) == {LOCAL: 3, OBJECT: 3}
    assert admin.count_replicas_in_state(cat, [LOCAL], "missing") == 1
    assert admin.count_replicas_in_state(cat, [OBJECT], "missing") == 0
    assert admin.still_catalogued(cat, LOCAL, [k0, "ab" * 32]) == {k0}
    assert admin.still_catalogued(cat, "file:///elsewhere", [k0]) == set()
    assert admin.still_catalogued(cat, LOCAL, []) == set()


def test_database_errors_are_named_without_sqlalchemy(cat: Catalog) -> None:
    with pytest.raises(admin.DATABASE_ERRORS) as info, cat.engine.connect() as conn:
        conn.execute(sa.text("SELECT * FROM no_such_table"))
    line = admin.database_error_detail(info.value)
    assert line.split(":")[0] in {"OperationalError", "ProgrammingError"} and "\n" not in line


def test_other_chains_do_not_leak_into_a_prefix(cat: Catalog, chain: list[bytes]) -> None:
    cat.record_chunks(chain_records(NS, A[:4], fp=FP2))  # a second fingerprint at the root
    assert len(admin.chunks_at(cat, chain[0])) == 2
    assert admin.replica_states(cat, chain, FP.hex) == {"durable": 6}
