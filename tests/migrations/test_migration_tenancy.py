"""Migration 0005 carries a catalog of the previous schema (0004) over to namespace-scoped
replicas, demand and fingerprint registrations, and removes chains grafted onto another
namespace's nodes; on SQLite and PostgreSQL, then back down and up again."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from catalog import Catalog, database
from catalog.identity import chain_hash, chain_root
from catalog.schema import (
    HEAD_TOKENS,
    Chunk,
    FingerprintRow,
    Namespace,
    NamespaceFingerprint,
    PrefixNode,
    Ref,
    Replica,
    tokens_to_be,
)
from tests.catalog_helpers import FP, fake_key

NOW = datetime(2026, 12, 1, tzinfo=UTC)
STORE = "file:///shared"
# The two tables 0005 re-keys, as they were at 0004.
OLD_REPLICAS = sa.table(
    "replicas",
    *(
        sa.column(c)
        for c in ("blob_key", "location", "tier", "state", "size", "checksum", "worker")
    ),
    sa.column("stored_at", Replica.stored_at.type),
)
OLD_DEMAND = sa.table(
    "demand",
    *(sa.column(c) for c in ("worker", "prefix_hash", "namespace_id", "priority")),
    sa.column("expires_at", Replica.stored_at.type),
)


def _node(ns_id: int, parent: bytes, start: int, tokens: list[int]) -> dict[str, Any]:
    return {
        "prefix_hash": chain_hash(parent, tokens),
        "namespace_id": ns_id,
        "parent_hash": parent,
        "token_start": start,
        "token_count": len(tokens),
        "depth": start // 4,
        "quarantined": False,
        "quarantine_reason": None,
        "created_at": NOW,
        "tokens_head": tokens_to_be(tokens[:HEAD_TOKENS]),
        "tokens_be": tokens_to_be(tokens),
    }


def _chunk(node: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "fingerprint": FP.hex,
        "prefix_hash": node["prefix_hash"],
        "layer_lo": 0,
        "layer_hi": FP.layout.num_layers,
        "head_lo": 0,
        "head_hi": FP.layout.num_kv_heads,
        "blob_key": key,
        "codec": "raw",
        "stored_bytes": 100,
        "kv_bytes": 100,
        "state": "ready",
        "created_at": NOW,
        "last_seen_at": NOW,
        "last_access_at": None,
        "access_count": 0,
    }


def _replica(key: str) -> dict[str, Any]:
    return {
        "blob_key": key,
        "location": STORE,
        "tier": "local",
        "state": "durable",
        "size": 100,
        "checksum": "blake3:x",
        "worker": None,
        "stored_at": NOW,
    }


def test_0005_scopes_replicas_and_removes_grafts(catalog_url: str) -> None:
    engine = database.create_engine(catalog_url)
    database.upgrade(engine, "0004")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(Namespace),
            [
                {"name": "alice", "chunk_size": 4, "created_at": NOW},
                {"name": "bob", "chunk_size": 4, "created_at": NOW},
            ],
        )
        ids = dict(conn.execute(sa.select(Namespace.name, Namespace.id)).all())
        conn.execute(
            sa.insert(FingerprintRow),
            [{"hex": FP.hex, "descriptor": dict(FP.descriptor), "created_at": NOW}],
        )
        bob1 = _node(ids["bob"], chain_root("bob"), 0, [1, 2, 3, 4])
        bob2 = _node(ids["bob"], bob1["prefix_hash"], 4, [5, 6, 7, 8])
        # Alice's graft onto bob's first node, a node of hers below it, and a chunk of bob's
        # published later under the graft (bob's checkpoint took the graft as known).
        graft = _node(ids["alice"], bob1["prefix_hash"], 4, [9, 9, 9, 9])
        below = _node(ids["alice"], graft["prefix_hash"], 8, [8, 8])
        bob_under = _node(ids["bob"], graft["prefix_hash"], 8, [7, 7])
        own = _node(ids["alice"], chain_root("alice"), 0, [4, 3, 2, 1])
        nodes = [bob1, bob2, graft, below, bob_under, own]
        conn.execute(sa.insert(PrefixNode), nodes)
        keys = {id(n): fake_key(n["prefix_hash"]) for n in nodes}
        # Alice's own chunk names bob's first blob key: the old row is shared by both.
        keys[id(own)] = keys[id(bob1)]
        conn.execute(sa.insert(Chunk), [_chunk(n, keys[id(n)]) for n in nodes])
        unowned = fake_key("nobody")
        conn.execute(
            sa.insert(OLD_REPLICAS),
            [_replica(k) for k in sorted(set(keys.values()) | {unowned})],
        )
        conn.execute(
            sa.insert(Ref),
            [
                {
                    "namespace_id": ids["alice"],
                    "name": "on-graft",
                    "fingerprint": FP.hex,
                    "head_hash": below["prefix_hash"],
                    "processed": 10,
                    "pending_token": 1,
                    "forked_from": None,
                    "created_at": NOW,
                    "updated_at": NOW,
                },
                {
                    "namespace_id": ids["bob"],
                    "name": "main",
                    "fingerprint": FP.hex,
                    "head_hash": bob2["prefix_hash"],
                    "processed": 8,
                    "pending_token": 1,
                    "forked_from": None,
                    "created_at": NOW,
                    "updated_at": NOW,
                },
            ],
        )
        conn.execute(
            sa.insert(OLD_DEMAND),
            [
                {
                    "worker": "w1",
                    "prefix_hash": bob2["prefix_hash"],
                    "namespace_id": ids["bob"],
                    "priority": 1.0,
                    "expires_at": NOW,
                }
            ],
        )

    database.upgrade(engine)
    with engine.connect() as conn:
        replicas = sorted(
            (r.namespace_id, r.blob_key)
            for r in conn.execute(sa.select(Replica.namespace_id, Replica.blob_key))
        )
        prefixes = set(conn.execute(sa.select(PrefixNode.prefix_hash)).scalars())
        refs = sorted(conn.execute(sa.select(Ref.name)).scalars())
        used = sorted(
            conn.execute(
                sa.select(NamespaceFingerprint.namespace_id, NamespaceFingerprint.fingerprint)
            ).all()
        )
        events = conn.execute(sa.text("SELECT kind, namespace, subject FROM events")).all()
    # Every chunk's namespace holds its own row of its blob (bob's first key: both of them);
    # the graft's subtree in alice's namespace and its rows are gone, bob's own rows stay,
    # and the row no chunk named is dropped (its bytes are orphans for the sweep).
    expected = sorted(
        [(ids["bob"], keys[id(n)]) for n in (bob1, bob2, bob_under)]
        + [(ids["alice"], keys[id(own)])]
    )
    assert replicas == expected
    assert prefixes == {n["prefix_hash"] for n in (bob1, bob2, bob_under, own)}
    assert refs == ["main"]
    assert used == sorted([(ids["alice"], FP.hex), (ids["bob"], FP.hex)])
    assert ("tenancy.graft_removed", "alice", graft["prefix_hash"].hex()) in [
        tuple(e) for e in events
    ]
    assert "replica.unowned_dropped" in [e[0] for e in events]
    engine.dispose()

    # The upgraded catalog serves each tenant its own, and bob publishes under his chain.
    cat = Catalog.open(catalog_url)
    try:
        assert cat.lookup("bob", FP, [1, 2, 3, 4, 5, 6, 7, 8, 0]).matched_tokens == 8
        assert cat.replicas_at(STORE, namespace="alice") == [keys[id(own)]]
        assert cat.get_fingerprint(FP.hex, namespace="alice") is not None
        assert cat.demand("bob", [bob2["prefix_hash"]]) == {}  # expired at NOW
    finally:
        cat.close()

    engine = database.create_engine(catalog_url)
    database.downgrade(engine, "0004")
    with engine.connect() as conn:
        back = sorted(conn.execute(sa.text("SELECT blob_key, location FROM replicas")).all())
    assert back == sorted({(k, STORE) for _, k in expected})
    database.upgrade(engine)
    assert database.current_revision(engine) == database.head_revision()
    engine.dispose()
