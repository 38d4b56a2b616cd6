"""One behaviour suite for every catalog implementation (`catalog.base.CatalogAPI`).

Parametrised over the SQL catalog on SQLite and on PostgreSQL, and over
`RemoteCatalog` talking to a real `kvc serve` (uvicorn on loopback) in front of
each. Every test uses only the seam's methods, so every implementation must
behave alike, including which error class a mistake raises.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from catalog import (
    CatalogAPI,
    CatalogConflictError,
    CatalogInputError,
    CatalogUnavailableError,
    IdentityError,
    MissingParentError,
    NotFoundError,
    OutcomeUnknownError,
    PublishError,
    PurgeInProgressError,
    RefConflictError,
    chain_root,
)
from catalog.catalog import Catalog
from catalog.remote import RemoteCatalog
from kvc.service import create_app, hash_token
from tests.catalog_helpers import CS, FP, FP2, chain_records, receipt
from tests.services import serve_in_thread

NS = "default"
OTHER = "other"
TOKEN = "behaviour-suite-token-5d1e"
TOKENS = list(range(100, 118))  # 4 full chunks of CS=4 and a tail of 2
S3 = "s3://bucket/prefix"


@dataclass
class Impl:
    name: str
    cat: CatalogAPI
    # A catalog of the same kind whose server cannot be reached (built when called).
    unreachable: Callable[[], CatalogAPI]
    # The SQL catalog underneath (itself, or the one the service serves): what GC, which
    # runs beside the database and not over HTTP, uses.
    sql: Catalog


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sql_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture(params=["sqlite", "postgresql", "remote-sqlite", "remote-postgresql"])
def impl(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Impl]:
    kind = str(request.param)
    backend = kind.removeprefix("remote-")
    sql = Catalog.open(_sql_url(backend, tmp_path, request), upgrade=True)
    try:
        if not kind.startswith("remote-"):

            def unreachable_sql() -> CatalogAPI:
                if backend == "sqlite":
                    pytest.skip("an embedded SQLite file has no server to lose")
                return Catalog.open(f"postgresql+psycopg://kvc@127.0.0.1:{_closed_port()}/kvc")

            sql.ensure_namespace(NS, CS)
            yield Impl(kind, sql, unreachable_sql, sql)
            return
        token_hash = hash_token(TOKEN)
        app = create_app(sql, {NS: token_hash, OTHER: token_hash}, max_prompt_tokens=4096)
        with serve_in_thread(app) as url:
            remote = RemoteCatalog(url, TOKEN, namespace=NS)
            try:
                remote.ensure_namespace(NS, CS)
                yield Impl(
                    kind,
                    remote,
                    lambda: RemoteCatalog(
                        f"http://127.0.0.1:{_closed_port()}", TOKEN, namespace=NS
                    ),
                    sql,
                )
            finally:
                remote.close()
    finally:
        sql.close()


# -- namespaces and fingerprints -------------------------------------------------------


def test_namespace_chunk_size_is_fixed_at_creation(impl: Impl) -> None:
    cat = impl.cat
    assert cat.ensure_namespace(OTHER, 8) == 8
    assert cat.ensure_namespace(OTHER, 16) == 8  # the stored size wins
    assert cat.namespace_chunk_size(OTHER) == 8
    assert cat.namespace_chunk_size(NS) == CS


def test_fingerprints_round_trip_and_unknown_is_none(impl: Impl) -> None:
    cat = impl.cat
    cat.register_fingerprint(FP)
    got = cat.get_fingerprint(FP.hex)
    assert got is not None and got.hex == FP.hex and got.layout == FP.layout
    assert cat.get_fingerprint(FP2) is None
    with pytest.raises(IdentityError):
        cat.get_fingerprint("not-a-fingerprint")


# -- publish and lookup ----------------------------------------------------------------


def test_publish_then_lookup_finds_the_longest_prefix(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    res = cat.record_chunks(recs, actor="alice")
    assert (res.recorded, res.already_present, res.conflicts) == (len(recs), 0, ())
    m = cat.lookup(NS, FP, [*TOKENS, 7])
    assert m.matched_tokens == len(TOKENS)
    assert [c.blob_key for c in m.chunks] == [r.blob_key for r in recs]
    assert all(c.replicas and c.replicas[0].location == "file:///store" for c in m.chunks)
    # A prompt diverging inside the third chunk: two chunks and the part of the third
    # that agrees (a stored chunk serves its agreeing first tokens).
    m = cat.lookup(NS, FP, [*TOKENS[:10], 999, 1000])
    assert m.matched_tokens == 10
    assert [c.tokens_used for c in m.chunks] == [4, 4, 2]
    # Leaves a pending token; max_tokens caps it.
    assert cat.lookup(NS, FP, TOKENS).matched_tokens == len(TOKENS) - 1
    assert cat.lookup(NS, FP, [*TOKENS, 7], max_tokens=5).matched_tokens == 5


def test_publish_is_idempotent(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    again = cat.record_chunks(recs)
    assert (again.recorded, again.already_present, again.replicas_added) == (0, len(recs), 0)
    assert cat.stats(NS)["chunks"] == len(recs)


def test_misses_are_not_errors(impl: Impl) -> None:
    cat = impl.cat
    cat.record_chunks(chain_records(NS, TOKENS))
    assert not cat.lookup(NS, FP2, [*TOKENS, 7]).hit  # another fingerprint
    assert not cat.lookup(OTHER, FP, [*TOKENS, 7]).hit  # a namespace that does not exist
    assert not cat.lookup(NS, FP, [5, 6, 7, 8, 9]).hit


def test_bad_lookups_are_input_errors(impl: Impl) -> None:
    cat = impl.cat
    with pytest.raises(IdentityError):
        cat.lookup(NS, FP, [])
    with pytest.raises(IdentityError):
        cat.lookup(NS, FP, [-1, 2])
    with pytest.raises(CatalogInputError):
        cat.lookup(NS, FP, [1, 2, 3], max_tokens=-1)


def test_a_missing_parent_refuses_the_whole_batch(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    with pytest.raises(MissingParentError) as err:
        cat.record_chunks(recs[2:])
    assert isinstance(err.value, PublishError) and isinstance(err.value, ValueError)
    assert cat.stats(NS)["chunks"] == 0
    assert not cat.lookup(NS, FP, [*TOKENS, 7]).hit


def test_an_inconsistent_record_is_a_publish_error(impl: Impl) -> None:
    cat = impl.cat
    good = chain_records(NS, TOKENS)[0]
    with pytest.raises(PublishError):
        cat.record_chunks([dataclasses.replace(good, receipts=[])])  # no proof of durability
    with pytest.raises(PublishError):
        cat.record_chunks([dataclasses.replace(good, tokens=[1, 2, 3, 4])])  # hash does not commit
    assert cat.stats(NS)["chunks"] == 0


def test_same_chunk_other_bytes_keeps_the_first(impl: Impl) -> None:
    cat = impl.cat
    first = chain_records(NS, TOKENS[:8])
    cat.record_chunks(first)
    second = chain_records(NS, TOKENS[:8], salt="nondeterministic build")
    res = cat.record_chunks(second)
    assert [c.kept_key for c in res.conflicts] == [r.blob_key for r in first]
    m = cat.lookup(NS, FP, [*TOKENS[:8], 1])
    assert [c.blob_key for c in m.chunks] == [r.blob_key for r in first]
    assert cat.events(namespace=NS, kind="conflict")


def test_known_blob_keys_names_what_is_catalogued(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs[:2])
    known = cat.known_blob_keys(NS, FP, [r.prefix_hash for r in recs], recs[0].shard)
    assert known == {r.prefix_hash: r.blob_key for r in recs[:2]}


# -- replicas --------------------------------------------------------------------------


def test_replicas_add_mark_verify_list_and_remove(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    key = recs[0].blob_key
    assert cat.record_replica(key, receipt(S3, "object"), namespace=NS, actor="uploader")
    assert not cat.record_replica(key, receipt(S3, "object"), namespace=NS)  # already there
    first = cat.lookup(NS, FP, [*TOKENS, 7]).chunks[0]
    assert [r.location for r in first.replicas] == ["file:///store", S3]  # best tier first
    assert cat.replicas_at(S3, namespace=NS) == [key]
    assert cat.touch_verified(S3, [key], namespace=NS) == 1

    assert cat.mark_replica(key, "file:///store", "corrupt", reason="digest", namespace=NS)
    first = cat.lookup(NS, FP, [*TOKENS, 7]).chunks[0]
    assert [r.location for r in first.replicas] == [S3]  # a corrupt replica is never offered
    assert cat.events(namespace=NS, kind="replica.corrupt")
    assert not cat.mark_replica(key, "file:///nowhere", "missing", reason="x", namespace=NS)
    with pytest.raises(CatalogInputError):
        cat.mark_replica(key, S3, "sideways", reason="x", namespace=NS)  # type: ignore[arg-type]

    assert cat.remove_replicas(S3, [key], reason="evicted", namespace=NS) == 1
    assert cat.replicas_at(S3, namespace=NS) == []
    with pytest.raises(NotFoundError):
        cat.record_replica("ab" * 32, receipt(S3, "object"), namespace=NS)


def test_a_chunk_without_usable_replicas_ends_the_match(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    cat.mark_replica(recs[2].blob_key, "file:///store", "missing", reason="fsck", namespace=NS)
    assert cat.lookup(NS, FP, [*TOKENS, 7]).matched_tokens == 2 * CS


def test_gc_marks_refuse_a_publish_relying_on_deleted_bytes(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    # GC marks a replica `deleting` before it deletes the bytes: a publish reusing
    # them must put them again instead of recording a replica about to vanish.
    impl.sql.mark_replica(
        recs[0].blob_key, "file:///store", "deleting", reason="gc", namespace=NS
    )
    with pytest.raises(PurgeInProgressError) as err:
        cat.record_chunks(recs[:1])
    assert isinstance(err.value, CatalogConflictError)
    assert not cat.mark_replica(
        recs[0].blob_key, "file:///store", "missing", reason="reader", namespace=NS
    )  # GC owns a replica it is deleting
    if impl.name.startswith("remote-"):
        # `deleting` is GC's state: a tenant cannot set it over HTTP (it would block
        # publishes of the same bytes by every namespace holding them).
        with pytest.raises(CatalogInputError):
            cat.mark_replica(
                recs[1].blob_key, "file:///store", "deleting", reason="x", namespace=NS
            )


# -- refs, pins, demand ------------------------------------------------------------------


def test_refs_compare_and_swap(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    a, b = recs[1].prefix_hash, recs[3].prefix_hash
    ref = cat.create_ref(NS, "chat", FP, a, pending_token=7, actor="alice")
    assert (ref.head_hash, ref.pending_token) == (a, 7)
    with pytest.raises(RefConflictError):
        cat.create_ref(NS, "chat", FP, b)
    moved = cat.update_ref(NS, "chat", expected_head=a, new_head=b, pending_token=8)
    assert moved.head_hash == b
    # A move that changes nothing records nothing; one that changes the pending token does.
    assert len(cat.events(namespace=NS, kind="ref.update")) == 1
    same = cat.update_ref(NS, "chat", expected_head=b, new_head=b, pending_token=8)
    assert (same.head_hash, same.pending_token) == (b, 8)
    assert len(cat.events(namespace=NS, kind="ref.update")) == 1
    cat.update_ref(NS, "chat", expected_head=b, new_head=b, pending_token=9)
    assert cat.get_ref(NS, "chat").pending_token == 9
    assert len(cat.events(namespace=NS, kind="ref.update")) == 2
    with pytest.raises(RefConflictError):  # still a compare-and-swap
        cat.update_ref(NS, "chat", expected_head=a, new_head=a, pending_token=8)
    with pytest.raises(RefConflictError) as lost:
        cat.update_ref(NS, "chat", expected_head=a, new_head=recs[2].prefix_hash)
    assert isinstance(lost.value, CatalogConflictError)
    assert cat.get_ref(NS, "chat").head_hash == b
    fork = cat.fork_ref(NS, "chat", "chat-2")
    assert fork.head_hash == b and fork.forked_from == "chat"
    assert [r.name for r in cat.list_refs(NS)] == ["chat", "chat-2"]
    cat.delete_ref(NS, "chat")
    with pytest.raises(NotFoundError) as err:
        cat.get_ref(NS, "chat")
    assert isinstance(err.value, LookupError)
    with pytest.raises(NotFoundError):
        cat.delete_ref(NS, "chat")
    with pytest.raises(CatalogInputError):
        cat.create_ref(NS, "bad\nname", FP, a)
    with pytest.raises(NotFoundError):
        cat.create_ref(NS, "nowhere", FP, bytes(32))
    created = cat.events(namespace=NS, kind="ref.create")
    assert len(created) == 2 and "alice" in (created[0].actor or "")


def test_pins_hold_and_release(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    pin = cat.pin(NS, "keep", recs[1].prefix_hash, ttl_s=3600, reason="demo", actor="ops")
    assert pin.prefix_hash == recs[1].prefix_hash and pin.expires_at is not None
    assert [p.name for p in cat.list_pins(NS)] == ["keep"]
    cat.unpin(NS, "keep")
    assert cat.list_pins(NS) == []
    with pytest.raises(NotFoundError):
        cat.unpin(NS, "keep")
    with pytest.raises(CatalogInputError):
        cat.pin(NS, "keep", recs[1].prefix_hash, ttl_s=-1)
    with pytest.raises(NotFoundError):
        cat.pin(NS, "keep", bytes(32))


def test_demand_is_summed_over_workers_and_namespaced(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    h = recs[1].prefix_hash
    cat.declare_demand("w1", NS, h, priority=2.0, ttl_s=600)
    cat.declare_demand("w2", NS, h, priority=0.5, ttl_s=600)
    cat.declare_demand("w1", NS, h, priority=3.0, ttl_s=600)  # a worker's new word replaces its old
    assert cat.demand(NS, [h, recs[0].prefix_hash]) == {h: 3.5}
    cat.ensure_namespace(OTHER, CS)
    assert cat.demand(OTHER, [h]) == {}
    cat.declare_demand("w1", OTHER, h, priority=100.0, ttl_s=600)  # another tenant, same hash
    assert cat.demand(NS, [h]) == {h: 3.5}  # cannot renew or reweigh this namespace's demand
    with pytest.raises(NotFoundError):
        cat.declare_demand("w1", "nowhere", h)


# -- lineage, quarantine, history --------------------------------------------------------


def test_lineage_and_descendants(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    fork = chain_records(NS, [*TOKENS[:8], 1, 2, 3, 4], start_chunk=2)
    cat.record_chunks(fork)
    line = cat.lineage(NS, recs[3].prefix_hash)
    assert [p.prefix_hash for p in line] == [r.prefix_hash for r in recs[:4]]
    assert line[0].parent_hash == chain_root(NS)
    below = {p.prefix_hash for p in cat.descendants(NS, recs[1].prefix_hash)}
    assert below == {r.prefix_hash for r in recs[2:]} | {fork[0].prefix_hash}
    assert cat.get_prefix(NS, recs[2].prefix_hash).tokens == tuple(TOKENS[8:12])
    with pytest.raises(NotFoundError):
        cat.get_prefix(NS, bytes(32))
    with pytest.raises(IdentityError):
        cat.lineage(NS, b"short")


def test_a_node_is_found_by_its_own_tokens_whatever_its_parent(impl: Impl) -> None:
    """What SGLang's backend asks: a page whose tokens commit to its prefix, from them alone."""
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    # The same tokens under another parent (at the root): a second node, shallower.
    moved = chain_records(NS, [*TOKENS[4:8], *TOKENS[:4]])
    cat.record_chunks(moved)
    found = cat.prefixes_with_tokens(NS, TOKENS[4:8])
    assert [p.prefix_hash for p in found] == [moved[0].prefix_hash, recs[1].prefix_hash]
    assert [(p.depth, p.token_start) for p in found] == [(0, 0), (1, 4)]
    assert [p.prefix_hash for p in cat.prefixes_with_tokens(NS, TOKENS[4:8], limit=1)] == [
        moved[0].prefix_hash
    ]
    # Exactly its tokens: a tail is found by its two, a chunk not by its first two.
    assert [p.prefix_hash for p in cat.prefixes_with_tokens(NS, TOKENS[16:])] == [
        recs[4].prefix_hash
    ]
    assert cat.prefixes_with_tokens(NS, TOKENS[:2]) == []
    # Never across namespaces.
    cat.ensure_namespace(OTHER, CS)
    cat.record_chunks(chain_records(OTHER, TOKENS[8:12]))
    assert [p.prefix_hash for p in cat.prefixes_with_tokens(NS, TOKENS[8:12])] == [
        recs[2].prefix_hash
    ]
    assert cat.prefixes_with_tokens(OTHER, TOKENS[:4]) == []
    with pytest.raises(IdentityError):
        cat.prefixes_with_tokens(NS, [])


def test_quarantine_makes_a_subtree_unrestorable(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    cat.record_replica(recs[3].blob_key, receipt(S3, "object"), namespace=NS)
    directives = cat.quarantine(NS, recs[2].prefix_hash, "bad kernel", actor="ops")
    assert sorted((d.blob_key, d.location) for d in directives) == sorted(
        [(r.blob_key, "file:///store") for r in recs[2:]] + [(recs[3].blob_key, S3)]
    )
    assert cat.lookup(NS, FP, [*TOKENS, 7]).matched_tokens == 2 * CS
    assert cat.get_prefix(NS, recs[3].prefix_hash).quarantined
    with pytest.raises(PublishError):
        cat.record_chunks(recs[3:4])  # no republishing under a quarantined node
    with pytest.raises(CatalogInputError):
        cat.quarantine(NS, recs[1].prefix_hash, "")
    with pytest.raises(NotFoundError):
        cat.quarantine(NS, bytes(32), "why")


def test_events_record_actor_and_filter(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs[:2], actor="alice")
    cat.record_chunks(recs[2:], actor="bob")
    published = cat.events(namespace=NS, kind="publish")
    assert len(published) == 2
    assert "alice" in (published[0].actor or "") and "bob" in (published[1].actor or "")
    assert [
        e.seq for e in cat.events(namespace=NS, kind="publish", since_seq=published[0].seq)
    ] == [published[1].seq]
    assert len(cat.events(namespace=NS, limit=1)) == 1


def test_stats_count_what_was_published(impl: Impl) -> None:
    cat = impl.cat
    recs = chain_records(NS, TOKENS)
    cat.record_chunks(recs)
    cat.create_ref(NS, "chat", FP, recs[-1].prefix_hash)
    stats = cat.stats(NS)
    assert (stats["chunks"], stats["prefixes"], stats["refs"]) == (len(recs), len(recs), 1)
    assert stats["replicas"] == {"durable": len(recs)}
    assert stats["stored_bytes"] == sum(r.stored_bytes for r in recs)


# -- outages ---------------------------------------------------------------------------


def test_an_unreachable_catalog_is_unavailable_not_a_bug(impl: Impl) -> None:
    with pytest.raises(CatalogUnavailableError) as err:
        impl.unreachable().lookup(NS, FP, [*TOKENS, 7])
    assert isinstance(err.value, ConnectionError)


def test_a_connection_lost_under_a_lookup_is_unavailable_then_replaced(postgres_url: str) -> None:
    """The lookup's statements run on the driver's cursor (`driver_rows`): a server that
    drops the pooled connection still gives `CatalogUnavailableError` (not the driver's own
    error, naming what the server said), and the next lookup gets a working connection."""
    import sqlalchemy as sa

    cat = Catalog.open(postgres_url, upgrade=True)
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        cat.ensure_namespace(NS, CS)
        cat.record_chunks(chain_records(NS, TOKENS))
        prompt = [*TOKENS[:-1], 99, 7]  # ends inside the last chunk: both lookup statements
        assert cat.lookup(NS, FP, prompt).matched_tokens == len(TOKENS) - 1
        database = sa.make_url(postgres_url).database
        killed = 0

        def kill_backends(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            nonlocal killed
            if "sibling_candidates" in statement and not killed:
                with admin.connect() as a:
                    killed = a.execute(
                        sa.text(
                            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
                            " WHERE datname = :d AND pid <> pg_backend_pid()"
                        ),
                        {"d": database},
                    ).scalar_one()

        sa.event.listen(cat.engine, "before_cursor_execute", kill_backends)
        with pytest.raises(CatalogUnavailableError) as ei:
            cat.lookup(NS, FP, prompt)
        # The statement's own failure is reported, not a later one from the broken connection.
        assert "administrator command" in str(ei.value)
        assert killed
        sa.event.remove(cat.engine, "before_cursor_execute", kill_backends)
        assert cat.lookup(NS, FP, prompt).matched_tokens == len(TOKENS) - 1
    finally:
        admin.dispose()
        cat.close()


def test_a_connection_lost_while_committing_is_outcome_unknown(postgres_url: str) -> None:
    # The rare path, forced: the server drops the connection as COMMIT is sent. The
    # writer cannot know whether it landed, so it must not be told "nothing changed".
    import sqlalchemy as sa

    cat = Catalog.open(postgres_url, upgrade=True)
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        cat.ensure_namespace(NS, CS)
        killed: list[int] = []

        def kill_before_commit(conn: sa.Connection) -> None:
            if not killed:
                pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
                with admin.connect() as a:
                    a.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                killed.append(pid)

        sa.event.listen(cat.engine, "commit", kill_before_commit)
        recs = chain_records(NS, TOKENS)
        with pytest.raises(OutcomeUnknownError):
            cat.record_chunks(recs)
        assert killed
        # Publishing again is safe (idempotent) and the catalog reconnects by itself.
        res = cat.record_chunks(recs)
        assert res.recorded + res.already_present == len(recs)
        assert cat.lookup(NS, FP, [*TOKENS, 7]).matched_tokens == len(TOKENS)
    finally:
        admin.dispose()
        cat.close()
