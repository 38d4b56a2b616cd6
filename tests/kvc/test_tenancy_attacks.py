"""The tenancy suite: alice holds one token of `kvc serve` and attacks bob, whose worker writes
to the same store, through every route that takes a hash, a blob key or a location.

Prefix hashes are computable from a namespace's name and a guessed prompt (the identity spec
is public), so alice is given bob's prompt and hashes outright: nothing may rest on them
being secret. After each attack the test asserts on what bob sees (lookup, restore bit for
bit, lineage, refs, GC) and on what alice's answers carried. Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

from catalog import Catalog
from catalog.identity import MAX_DESCRIPTOR_BYTES, chain_hash, chain_root, prefix_hashes
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from catalog.schema import FingerprintRow, Replica
from catalog.wire import ChunkRecordModel
from chunkstore import ChunkStore, open_store
from kvc.service import create_app, hash_token
from maintenance.collect import run_gc
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

ALICE, BOB = "alice", "bob"
TOKEN_ALICE = "alice-token-5f1c0a9e3b7d4c2e8a6b0d1f"
TOKEN_BOB = "bob-token-0c7e2a9d4b1f6e3a8c5d2b7f"
CS = 32
MODEL = ReferenceModel.small(seed=0)
FP = MODEL.fingerprint
SHARD = Shard.full(FP.layout)
API = "/v1/namespaces"


@dataclass
class World:
    cat: Catalog
    store: ChunkStore
    alice: TestClient
    bob_tokens: list[int]
    bob_hashes: list[bytes]
    bob_keys: list[str]
    bob_k: np.ndarray[Any, Any]
    bob_v: np.ndarray[Any, Any]

    def post(self, route: str, body: dict[str, Any]) -> Any:
        return self.alice.post(f"{API}/{ALICE}/{route}", json=body)

    def get(self, route: str, **params: Any) -> Any:
        return self.alice.get(f"{API}/{ALICE}/{route}", params=params)

    def bob_restores_exactly(self) -> None:
        """Bob's next restore serves all of his prefix, bit for bit, from verified bytes."""
        pool = PagePool(MODEL.layout, page_size=16, num_pages=32)
        with Restorer(self.cat, [self.store], namespace=BOB) as r:
            res = r.restore(pool, [*self.bob_tokens, 1], FP)
        assert res.report.failures == [] and res.restored_tokens == len(self.bob_tokens)
        assert res.route is not None
        k, v = pool.read(res.route)
        assert k.tobytes() == self.bob_k.tobytes() and v.tobytes() == self.bob_v.tobytes()

    def bob_replicas(self) -> list[tuple[str, str, str]]:
        with self.cat.engine.connect() as conn:
            bob_id = conn.execute(
                sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": BOB}
            ).scalar_one()
            rows = conn.execute(
                sa.select(Replica.blob_key, Replica.location, Replica.state)
                .where(Replica.namespace_id == bob_id)
                .order_by(Replica.blob_key)
            ).all()
        return [(r.blob_key, r.location, r.state) for r in rows]


@pytest.fixture
def world(catalog_url: str, tmp_path: Path) -> Iterator[World]:
    cat = Catalog.open(catalog_url, upgrade=True)
    store = open_store(f"file://{tmp_path / 'shared-blobs'}")
    cat.ensure_namespace(ALICE, CS)
    cat.ensure_namespace(BOB, CS)
    # Bob's worker checkpoints a 100-token prompt (three full chunks and a tail).
    tokens = np.random.default_rng(11).integers(0, MODEL.vocab_size, 100).tolist()
    pool = PagePool(MODEL.layout, page_size=16, num_pages=32)
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    k, v = pool.read(route)
    with Checkpointer(cat, store, namespace=BOB, chunk_size=CS) as cp:
        cp.checkpoint(pool, route, tokens, FP, name="bob-secret-ref")
    hashes = [p.prefix_hash for p in cat.lineage(BOB, cat.get_ref(BOB, "bob-secret-ref").head_hash)]
    assert hashes[:3] == prefix_hashes(BOB, tokens, CS)[:3]
    keys = cat.known_blob_keys(BOB, FP, hashes, SHARD)
    assert len(keys) == 4
    app = create_app(
        cat, {ALICE: hash_token(TOKEN_ALICE), BOB: hash_token(TOKEN_BOB)}, max_prompt_tokens=4096
    )
    with TestClient(
        app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {TOKEN_ALICE}"}
    ) as alice:
        yield World(cat, store, alice, tokens, hashes, [keys[h] for h in hashes], k, v)
    store.close()
    cat.close()


def _receipt(store: ChunkStore, size: int) -> ReplicaReceipt:
    return ReplicaReceipt(store.name, "local", size, "blake3:x", datetime.now(UTC))


def _body(records: list[ChunkRecord]) -> dict[str, Any]:
    return {
        "fingerprints": {FP.hex: dict(FP.descriptor)},
        "records": [ChunkRecordModel.of(r).model_dump(mode="json") for r in records],
    }


def _alice_record(
    w: World, prefix: bytes, parent: bytes, start: int, tokens: list[int], key: str, size: int
) -> ChunkRecord:
    """A publish record of alice's with a receipt at the shared store."""
    return ChunkRecord(
        ALICE, FP, prefix, parent, start, tokens, SHARD, key, "raw", size, size,
        [_receipt(w.store, size)],
    )  # fmt: skip


def _alice_chain(w: World, tokens: list[int], blob_key: str, size: int) -> list[ChunkRecord]:
    """A chain of alice's own (from alice's root) whose chunk names `blob_key`."""
    root = chain_root(ALICE)
    return [_alice_record(w, chain_hash(root, tokens), root, 0, tokens, blob_key, size)]


def _nothing_of_bob(w: World, *responses: Any) -> None:
    for r in responses:
        for secret in [*w.bob_keys, "bob-secret-ref", BOB]:
            assert secret not in r.text, (r.request.url, secret)


# -- 1. no oracle ------------------------------------------------------------------------


def test_known_is_no_membership_oracle(world: World) -> None:
    w = world
    shard = {"layer_lo": 0, "layer_hi": SHARD.layer_hi, "head_lo": 0, "head_hi": SHARD.head_hi}
    theirs = w.post(
        "known",
        {"fingerprint": FP.hex, "prefix_hashes": [h.hex() for h in w.bob_hashes], "shard": shard},
    )
    nobody = w.post(
        "known", {"fingerprint": FP.hex, "prefix_hashes": ["42" * 32] * 4, "shard": shard}
    )
    assert theirs.status_code == nobody.status_code == 200
    assert theirs.json() == nobody.json() == {"blob_keys": {}}
    lookup = w.post("lookup", {"fingerprint": FP.hex, "tokens": [*w.bob_tokens, 1]})
    demand = w.post("demand/query", {"prefix_hashes": [h.hex() for h in w.bob_hashes]})
    assert lookup.status_code == 204 and demand.json() == {"demand": {}}
    _nothing_of_bob(w, theirs, lookup, demand)


def test_another_tenants_fingerprint_is_not_found(world: World) -> None:
    w = world
    theirs = w.get(f"fingerprints/{FP.hex}")
    nobody = w.get(f"fingerprints/{'ab' * 32}")
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json() == nobody.json()
    # Registered by alice herself, it is hers to read.
    assert w.post("fingerprints", {"descriptor": dict(FP.descriptor)}).status_code == 200
    assert w.get(f"fingerprints/{FP.hex}").json()["fingerprint"] == FP.hex


# -- 2. no graft -------------------------------------------------------------------------


def test_a_chunk_extending_another_tenants_node_is_refused_and_bob_restores_exactly(
    world: World,
) -> None:
    w = world
    # Alice's poison for bob's second chunk: its exact hash (bob's node as parent, bob's
    # tokens), stored bytes of her choosing under a key of her own.
    parent, target = w.bob_hashes[0], w.bob_hashes[1]
    toks = w.bob_tokens[CS : 2 * CS]
    assert chain_hash(parent, toks) == target
    key = "ee" * 32  # the catalog refuses the facts; what bytes she stored does not matter
    graft = _alice_record(w, target, parent, CS, toks, key, 4096)
    r = w.post("chunks", _body([graft]))
    assert r.status_code == 422 and "not catalogued" in r.json()["detail"]
    # The same with bob's root: a chain of alice's own must start at alice's root.
    first = _alice_record(w, w.bob_hashes[0], chain_root(BOB), 0, w.bob_tokens[:CS], key, 4096)
    assert w.post("chunks", _body([first])).status_code == 422
    _nothing_of_bob(w, r)
    # Bob's catalog is as it was, and his next checkpoint and restore are his own bytes.
    m = w.cat.lookup(BOB, FP, [*w.bob_tokens, 1])
    assert [c.blob_key for c in m.chunks] == w.bob_keys
    w.bob_restores_exactly()
    assert w.cat.stats(ALICE)["chunks"] == 0


def test_lineage_and_descendants_never_cross_namespaces(world: World) -> None:
    w = world
    for h in (w.bob_hashes[0], w.bob_hashes[2]):
        for route in (f"prefixes/{h.hex()}", f"prefixes/{h.hex()}/lineage"):
            theirs, nobody = w.get(route), w.get(route.replace(h.hex(), "42" * 32))
            assert theirs.status_code == nobody.status_code == 404, route
            assert theirs.json() == nobody.json()
        desc = w.get(f"prefixes/{h.hex()}/descendants")
        assert desc.status_code == 200 and desc.json() == {"prefixes": []}
    # Alice's own chain, whose parent she names as bob's node, never lands to be walked.
    graft = _alice_record(
        w, chain_hash(w.bob_hashes[2], [7, 7]), w.bob_hashes[2], 3 * CS, [7, 7], "dd" * 32, 10
    )
    assert w.post("chunks", _body([graft])).status_code == 422
    assert [p.prefix_hash for p in w.cat.descendants(BOB, w.bob_hashes[2])] == [w.bob_hashes[3]]
    assert [p.prefix_hash for p in w.cat.lineage(BOB, w.bob_hashes[-1])] == w.bob_hashes
    quarantine = w.post("quarantine", {"prefix_hash": w.bob_hashes[0].hex(), "reason": "x"})
    assert quarantine.status_code == 404
    w.bob_restores_exactly()


# -- 3. no cross-tenant change or deletion -------------------------------------------


def test_naming_bobs_blob_never_touches_bobs_replicas_or_bytes(world: World) -> None:
    w = world
    bob_key = w.bob_keys[0]
    size = w.store.stat(bob_key).size
    before = w.bob_replicas()
    # Alice names bob's blob key in a chunk of her own chain: it lands in her namespace only.
    mine = _alice_chain(w, [1, 2, 3, 4], bob_key, size)
    published = w.post("chunks", _body(mine))
    assert published.status_code == 200 and published.json()["recorded"] == 1
    at = w.get("replicas", location=w.store.name)
    assert at.json() == {"blob_keys": [bob_key]}  # her own claim, nothing of bob's others
    # Every write alice can make about that key changes her row, never bob's.
    assert (
        w.post(
            "replicas/mark",
            {"blob_key": bob_key, "location": w.store.name, "state": "deleting", "reason": "x"},
        ).status_code
        == 422
    )  # only GC sets `deleting`
    marked = w.post(
        "replicas/mark",
        {"blob_key": bob_key, "location": w.store.name, "state": "corrupt", "reason": "x"},
    )
    assert marked.json() == {"changed": True}
    assert w.bob_replicas() == before
    removed = w.post(
        "replicas/remove",
        {"blob_keys": [*w.bob_keys], "location": w.store.name, "reason": "x"},
    )
    assert removed.json() == {"count": 1}  # her one row; bob's four untouched
    assert w.bob_replicas() == before
    # Her chunk now has no replica; GC of her namespace purges it (quarantined first), and
    # the sweep of orphans with no grace period runs over the shared store.
    assert w.post("quarantine", {"prefix_hash": mine[0].prefix_hash.hex(), "reason": "x"})
    report = run_gc(w.cat, [w.store], ALICE, grace_s=0)
    assert report.sweep.deleted == []
    assert all(w.store.exists(k) for k in w.bob_keys)
    assert w.bob_replicas() == before
    w.bob_restores_exactly()
    # Bob re-publishes (his next checkpoint of the same prompt) and is never blocked.
    pool = PagePool(MODEL.layout, page_size=16, num_pages=32)
    route = pool.new_route()
    MODEL.prefill(pool, route, w.bob_tokens)
    with Checkpointer(w.cat, w.store, namespace=BOB, chunk_size=CS) as cp:
        cp.checkpoint(pool, route, w.bob_tokens, FP)
    w.bob_restores_exactly()


def test_gc_keeps_bytes_another_namespace_holds(world: World) -> None:
    """Alice's GC deletes her replica of a blob bob also holds without deleting its bytes."""
    w = world
    bob_key = w.bob_keys[1]
    size = w.store.stat(bob_key).size
    mine = _alice_chain(w, [9, 9, 9], bob_key, size)
    assert w.post("chunks", _body(mine)).status_code == 200
    w.post("quarantine", {"prefix_hash": mine[0].prefix_hash.hex(), "reason": "x"})
    report = run_gc(w.cat, [w.store], ALICE, grace_s=0)
    assert report.retention.result is not None and report.retention.result.chunks_removed == 1
    assert report.retention.result.blobs_deleted == []
    assert w.store.exists(bob_key)
    assert w.cat.replicas_at(w.store.name, namespace=ALICE) == []
    assert bob_key in w.cat.replicas_at(w.store.name, namespace=BOB)
    w.bob_restores_exactly()


def test_demand_of_one_tenant_never_takes_anothers_place(world: World) -> None:
    w = world
    h = w.bob_hashes[-1]
    declared = w.alice.post(
        f"{API}/{ALICE}/demand",
        json={"worker": "w1", "prefix_hash": h.hex(), "priority": 0.5, "ttl_s": 3600},
    )
    assert declared.status_code == 204
    w.cat.declare_demand("w1", BOB, h, priority=2.0, ttl_s=3600)
    assert w.cat.demand(BOB, [h]) == {h: 2.0}
    # Bob's demanded prefix is a GC root for bob (alice's declaration is not his).
    w.cat.delete_ref(BOB, "bob-secret-ref")
    report = run_gc(w.cat, [w.store], BOB, grace_s=0, max_bytes=0)
    assert report.retention.result is None or report.retention.result.chunks_removed == 0
    w.bob_restores_exactly()


def test_history_and_stats_carry_nothing_of_bob(world: World) -> None:
    w = world
    events = w.get("events")
    stats = w.get("stats")
    refs = w.get("refs")
    assert events.status_code == stats.status_code == refs.status_code == 200
    assert events.json() == {"events": []}
    assert stats.json()["chunks"] == 0 and stats.json()["replicas"] == {}
    assert refs.json() == {"refs": []}
    _nothing_of_bob(w, events, stats, refs)


# -- 4. limits on what one tenant may store ------------------------------------------------


def test_an_oversized_descriptor_is_refused_and_stores_nothing(world: World) -> None:
    w = world
    big = dict(FP.descriptor)
    big["config"] = {"padding": "x" * (MAX_DESCRIPTOR_BYTES + 1)}
    with w.cat.engine.connect() as conn:
        before = conn.execute(sa.select(sa.func.count()).select_from(FingerprintRow)).scalar()
    r = w.post("fingerprints", {"descriptor": big})
    assert r.status_code == 422 and str(MAX_DESCRIPTOR_BYTES) in r.text
    with w.cat.engine.connect() as conn:
        after = conn.execute(sa.select(sa.func.count()).select_from(FingerprintRow)).scalar()
    assert after == before


def test_refs_pins_and_replica_writes_cannot_name_bobs_nodes_or_blobs(world: World) -> None:
    """Every other route that takes a hash or a blob key: refs (create, move), pins, a
    replica receipt and a verification stamp, each aimed at bob's nodes and keys."""
    w = world
    head, key = w.bob_hashes[-1], w.bob_keys[-1]
    with w.cat.engine.connect() as conn:
        stamps_before = sorted(
            conn.execute(sa.select(Replica.blob_key, Replica.last_verified_at)).all()
        )
    ref = w.alice.put(
        f"{API}/{ALICE}/refs/mine", json={"fingerprint": FP.hex, "head_hash": head.hex()}
    )
    pin = w.alice.put(f"{API}/{ALICE}/pins/keep", json={"prefix_hash": head.hex()})
    record = w.post(
        "replicas",
        {
            "blob_key": key,
            "receipt": {
                "location": "file:///elsewhere",
                "tier": "local",
                "size": 1,
                "checksum": "blake3:x",
                "stored_at": datetime.now(UTC).isoformat(),
            },
        },
    )
    nobody = w.alice.put(
        f"{API}/{ALICE}/refs/mine", json={"fingerprint": FP.hex, "head_hash": "42" * 32}
    )
    assert ref.status_code == pin.status_code == record.status_code == nobody.status_code == 404
    assert ref.json() == pin.json() == record.json() == nobody.json()
    verified = w.post("replicas/verified", {"location": w.store.name, "blob_keys": w.bob_keys})
    assert verified.json() == {"count": 0}
    with w.cat.engine.connect() as conn:
        stamps_after = sorted(
            conn.execute(sa.select(Replica.blob_key, Replica.last_verified_at)).all()
        )
    assert stamps_after == stamps_before
    assert w.cat.replicas_at("file:///elsewhere") == []
    assert w.cat.list_refs(ALICE) == [] and w.cat.list_pins(ALICE) == []
    assert [r.name for r in w.cat.list_refs(BOB)] == ["bob-secret-ref"]
    _nothing_of_bob(w, ref, pin, record, verified)
    w.bob_restores_exactly()
