"""The journal: committed ref, pin, quarantine and GC changes written to stores and read back.

SQLite catalogs; local stores everywhere, the SeaweedFS S3 store for the round trip.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from catalog import RefConflictError
from catalog.catalog import Catalog
from catalog.changes import Change, RefSet
from catalog.gc import plan_gc
from catalog.purge import apply_gc
from catalog.schema import Pin
from chunkstore import ChunkStore, open_store
from chunkstore.base import DOCUMENTS_DIR
from chunkstore.local import LocalStore
from maintenance.journal import read_journal
from restore.journal import JOURNAL_PREFIX, StoreJournal, attach_journal, encode_change
from tests.catalog_helpers import CS, FP, publish

NS = "team/\u00e9t\u00e9 x"  # characters a document name cannot hold
A = list(range(12))  # three chunks: a1 a2 a3
B = [0, 1, 2, 3, 50, 51, 52, 53]  # a1 b2


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture
def cat(db_url: str) -> Iterator[Catalog]:
    c = Catalog.open(db_url, upgrade=True)
    c.ensure_namespace(NS, CS)
    yield c
    c.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = LocalStore(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def chain(cat: Catalog) -> list[bytes]:
    """Hashes of a1 a2 a3 (then b2, a sibling of a2)."""
    a = publish(cat, NS, A)
    b = publish(cat, NS, B)
    return [r.prefix_hash for r in a] + [b[1].prefix_hash]


def journal_names(store: ChunkStore) -> list[str]:
    return list(store.documents(JOURNAL_PREFIX))


def test_every_change_is_journaled_and_read_back_as_the_latest_state(
    cat: Catalog, store: ChunkStore, chain: list[bytes]
) -> None:
    a1, a2, a3, b2 = chain
    attach_journal(cat, [store])
    cat.create_ref(NS, "chat/1", FP, a1, pending_token=7)
    cat.update_ref(NS, "chat/1", expected_head=a1, new_head=a2, pending_token=8)
    moved = cat.update_ref(NS, "chat/1", expected_head=a2, new_head=a3, pending_token=9)
    cat.fork_ref(NS, "chat/1", "chat/1-fork")
    cat.create_ref(NS, "gone", FP, a1)
    cat.delete_ref(NS, "gone")
    cat.pin(NS, "keep", a1, reason="golden")
    pinned = cat.pin(NS, "keep", a2, ttl_s=3600, reason="moved", actor="ops")
    cat.pin(NS, "temp", a1)
    cat.unpin(NS, "temp")
    cat.quarantine(NS, b2, "bad bytes")

    assert len(journal_names(store)) == 11  # one document per committed change
    state = read_journal([store])
    assert state.skipped == []
    ref = state.refs[(NS, "chat/1")]
    assert (ref.head_hash, ref.pending_token, ref.fingerprint) == (a3, 9, FP.hex)
    assert ref.at == moved.updated_at and not ref.deleted
    fork = state.refs[(NS, "chat/1-fork")]
    assert (fork.head_hash, fork.forked_from, fork.pending_token) == (a3, "chat/1", 9)
    assert state.refs[(NS, "gone")].deleted
    pin = state.pins[(NS, "keep")]
    assert (pin.prefix_hash, pin.reason, pin.created_by) == (a2, "moved", "ops")
    assert pin.expires_at == pinned.expires_at and pin.at == pinned.created_at
    assert state.pins[(NS, "temp")].deleted
    [q] = state.quarantines
    assert (q.namespace, q.prefix_hash, q.reason) == (NS, b2, "bad bytes")
    assert all(r.at.tzinfo is not None for r in state.refs.values())


def test_a_gc_purge_is_journaled_so_rebuild_does_not_resurrect_the_blobs(
    cat: Catalog, store: ChunkStore
) -> None:
    recs = publish(cat, NS, A)
    expired_pin = cat.pin(NS, "old", recs[2].prefix_hash, ttl_s=60)
    with cat.engine.begin() as conn:  # expired a minute ago
        conn.execute(sa.update(Pin).values(expires_at=datetime.now(UTC) - timedelta(seconds=60)))
    attach_journal(cat, [store])
    cat.quarantine(NS, recs[1].prefix_hash, "corrupt")  # a2 and a3 go
    plan = plan_gc(cat, NS, max_age_s=None, max_bytes=None, now=datetime.now(UTC))
    result = apply_gc(cat, plan, lambda location, key: True)
    assert result.chunks_removed == 2

    state = read_journal([store])
    assert state.purged_blobs == {recs[1].blob_key, recs[2].blob_key}
    by_key = {p.blob_key: p for p in state.purged}
    p = by_key[recs[2].blob_key]
    assert (p.namespace, p.fingerprint, p.prefix_hash) == (NS, FP.hex, recs[2].prefix_hash)
    assert p.shard == (0, 2, 0, 2)
    # The expired pin GC dropped with its prefix is journaled as removed too.
    assert state.pins[(NS, "old")].deleted
    assert state.pins[(NS, "old")].at > expired_pin.created_at


def test_a_refused_compare_and_swap_journals_nothing(
    cat: Catalog, store: ChunkStore, chain: list[bytes]
) -> None:
    a1, a2, a3, _ = chain
    cat.create_ref(NS, "r", FP, a1)
    attach_journal(cat, [store])
    with pytest.raises(RefConflictError):
        cat.update_ref(NS, "r", expected_head=a2, new_head=a3)
    with pytest.raises(RefConflictError):
        cat.create_ref(NS, "r", FP, a2)
    assert journal_names(store) == []
    assert cat.journal_failures == 0


def test_concurrent_writers_on_one_store_keep_every_record_and_the_latest_wins(
    db_url: str, cat: Catalog, store: ChunkStore, chain: list[bytes]
) -> None:
    a1, a2, a3, b2 = chain
    heads = [a1, a2, a3, b2]
    cat.create_ref(NS, "shared", FP, a1)
    other = Catalog.open(db_url)
    catalogs = [cat, other]
    for c in catalogs:
        attach_journal(c, [store])  # each with its own StoreJournal on the same store
    landed = [0] * 4
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        c = catalogs[i % 2]
        try:
            own = f"own-{i}"
            c.create_ref(NS, own, FP, a1)
            landed[i] += 1
            for step in range(6):
                c.update_ref(NS, own, expected_head=heads[step % 4], new_head=heads[(step + 1) % 4])
                landed[i] += 1
                while True:  # move the shared ref by compare-and-swap, retrying when beaten
                    current = c.get_ref(NS, "shared").head_hash
                    nxt = heads[(heads.index(current) + 1) % 4]
                    try:
                        c.update_ref(NS, "shared", expected_head=current, new_head=nxt)
                    except RefConflictError:
                        continue
                    landed[i] += 1
                    break
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    other.close()
    assert errors == []
    assert len(journal_names(store)) == sum(landed)
    state = read_journal([store])
    assert state.skipped == []
    for name in ["shared", *(f"own-{i}" for i in range(4))]:
        assert state.refs[(NS, name)].head_hash == cat.get_ref(NS, name).head_hash


def _latest_file(store_dir: Path, store: ChunkStore) -> Path:
    return store_dir / DOCUMENTS_DIR / journal_names(store)[-1]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_torn_record_is_skipped_and_the_earlier_one_used(
    tmp_path: Path, cat: Catalog, store: ChunkStore, chain: list[bytes], damage: str
) -> None:
    a1, a2, _, _ = chain
    attach_journal(cat, [store])
    cat.create_ref(NS, "r", FP, a1)
    cat.update_ref(NS, "r", expected_head=a1, new_head=a2)
    newest = _latest_file(tmp_path / "store", store)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    else:  # a flipped bit that still parses: in a hex digit of the head
        i = data.index(b'"head":"') + 8
        newest.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])
    state = read_journal([store])
    assert state.skipped == [journal_names(store)[-1]]
    assert state.refs[(NS, "r")].head_hash == a1


def test_a_record_under_another_name_is_not_trusted(
    cat: Catalog, store: ChunkStore, chain: list[bytes]
) -> None:
    """A whole, valid record copied under another ref's name (or time) is skipped."""
    a1, a2, _, _ = chain
    attach_journal(cat, [store])
    cat.create_ref(NS, "a", FP, a1)
    cat.create_ref(NS, "b", FP, a2)
    [doc_a] = [n for n in journal_names(store) if store.get_document(n).find(b'"name":"a"') > 0]
    b_dir = next(n for n in journal_names(store) if n != doc_a).rsplit("/", 1)[0]
    forged = f"{b_dir}/99991231T235959.999999Z-{'0' * 32}.json"
    store.put_document(forged, store.get_document(doc_a))
    store.put_document(f"{JOURNAL_PREFIX}junk", b"{}")
    state = read_journal([store])
    assert sorted(state.skipped) == sorted([forged, f"{JOURNAL_PREFIX}junk"])
    assert state.refs[(NS, "b")].head_hash == a2


def test_two_stores_are_merged_and_a_shared_record_counts_once(
    tmp_path: Path, cat: Catalog, chain: list[bytes]
) -> None:
    a1, _, a3, _ = chain
    s1, s2 = LocalStore(tmp_path / "s1"), LocalStore(tmp_path / "s2")
    both = attach_journal(cat, [s1, s2])
    cat.create_ref(NS, "r", FP, a1)
    cat.pin(NS, "p", a1)
    cat.remove_change_listener(both)
    attach_journal(cat, [s2])  # later changes reach only the second store
    cat.update_ref(NS, "r", expected_head=a1, new_head=a3)
    cat.unpin(NS, "p")
    assert set(journal_names(s1)) < set(journal_names(s2))
    assert len(journal_names(s1)) == 2 and len(journal_names(s2)) == 4
    state = read_journal([s1, s2])
    assert state.records == 4 and state.skipped == []
    assert state.refs[(NS, "r")].head_hash == a3
    assert state.pins[(NS, "p")].deleted
    # The first store alone still gives the older values.
    old = read_journal([s1])
    assert old.refs[(NS, "r")].head_hash == a1 and not old.pins[(NS, "p")].deleted
    # A torn copy in one store is covered by the whole copy in the other.
    name = journal_names(s1)[0]
    (tmp_path / "s1" / DOCUMENTS_DIR / name).write_bytes(b'{"v": 1')
    assert read_journal([s1, s2]).skipped == []
    assert read_journal([s1]).skipped == [name]


def test_a_failing_listener_does_not_fail_the_change(
    cat: Catalog, chain: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    a1, a2, _, _ = chain
    seen: list[Change] = []

    def broken(change: Change) -> None:
        raise OSError("disk full at s3://secret-bucket?token=hunter2\nsecond line")

    cat.add_change_listener(broken)
    cat.add_change_listener(seen.append)
    caplog.set_level(logging.ERROR, logger="catalog.changes")
    cat.create_ref(NS, "r", FP, a1)
    moved = cat.update_ref(NS, "r", expected_head=a1, new_head=a2)
    assert cat.get_ref(NS, "r").head_hash == a2 == moved.head_hash
    assert cat.journal_failures == 2
    assert [type(c) for c in seen] == [RefSet, RefSet]  # later listeners still run
    assert "ref set" in caplog.text and "OSError" in caplog.text
    assert "second line" not in caplog.text


def test_a_store_that_refuses_records_is_counted_and_the_others_still_get_them(
    tmp_path: Path, cat: Catalog, chain: list[bytes]
) -> None:
    class Refusing(LocalStore):
        def put_document(self, name: str, data: bytes) -> bool:
            raise OSError("refused")

    good, bad = LocalStore(tmp_path / "good"), Refusing(tmp_path / "bad")
    journal = attach_journal(cat, [bad, good])
    cat.create_ref(NS, "r", FP, chain[0])
    assert cat.journal_failures == 1 and journal.failures == 1 and journal.written == 1
    assert read_journal([good]).refs[(NS, "r")].head_hash == chain[0]


def test_from_urls_opens_the_stores_on_the_first_change(
    tmp_path: Path, cat: Catalog, chain: list[bytes]
) -> None:
    journal = StoreJournal.from_urls([f"file://{tmp_path / 'lazy'}"])
    cat.add_change_listener(journal)
    assert not (tmp_path / "lazy").exists() or not any((tmp_path / "lazy").iterdir())
    cat.create_ref(NS, "r", FP, chain[0])
    journal.close()
    with open_store(f"file://{tmp_path / 'lazy'}") as s:
        assert read_journal([s]).refs[(NS, "r")].head_hash == chain[0]


def test_records_have_unique_valid_names(cat: Catalog, chain: list[bytes]) -> None:
    ref = cat.create_ref(NS, "n" * 255, FP, chain[0])
    names = {encode_change(RefSet(ref))[0] for _ in range(100)}
    assert len(names) == 100
    assert all(len(n) <= 512 for n in names)


def test_round_trip_on_s3(s3_url: str, cat: Catalog, chain: list[bytes]) -> None:
    a1, a2, _, b2 = chain
    with open_store(s3_url) as s3:
        attach_journal(cat, [s3])
        cat.create_ref(NS, "r", FP, a1)
        cat.update_ref(NS, "r", expected_head=a1, new_head=a2)
        cat.pin(NS, "p", a1)
        cat.quarantine(NS, b2, "bad")
        state = read_journal([s3])
    assert state.refs[(NS, "r")].head_hash == a2
    assert state.pins[(NS, "p")].prefix_hash == a1
    assert [q.prefix_hash for q in state.quarantines] == [b2]
    assert state.skipped == [] and state.records == 4


def test_the_cli_journals_to_the_configured_stores(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvc.cli import cli

    home = tmp_path / "home"
    home.mkdir()
    with Catalog.open(f"sqlite:///{home / 'catalog.db'}", upgrade=True) as c:
        c.ensure_namespace("default", CS)
        h = publish(c, "default", A)[0].prefix_hash
    args = ["--home", str(home)]
    out = CliRunner().invoke(cli, ["pins", "set", "launch", h.hex(), "--reason", "week", *args])
    assert out.exit_code == 0, out.output
    with open_store(f"file://{home / 'blobs'}") as s:  # the embedded default's store
        pin = read_journal([s]).pins[("default", "launch")]
    assert (pin.prefix_hash, pin.reason, pin.created_by) == (h, "week", "kvc pins set")
    out = CliRunner().invoke(cli, ["pins", "rm", "launch", *args])
    assert out.exit_code == 0, out.output
    with open_store(f"file://{home / 'blobs'}") as s:
        assert read_journal([s]).pins[("default", "launch")].deleted


def test_the_service_exposes_journal_failures(cat: Catalog, chain: list[bytes]) -> None:
    from fastapi.testclient import TestClient

    from kvc.service import create_app

    def broken(change: Change) -> None:
        raise OSError("store down")

    app = create_app(cat, {NS: "0" * 64}, max_prompt_tokens=1000)
    cat.add_change_listener(broken)
    cat.create_ref(NS, "r", FP, chain[0])
    with TestClient(app) as client:
        text = client.get("/metrics").text
    assert "kvc_journal_failures 1.0" in text


def test_resync_repairs_what_failed_journal_writes_left_out(
    tmp_path: Path, cat: Catalog, chain: list[bytes]
) -> None:
    from maintenance.journal import resync_journal

    a1, a2, _, _ = chain
    s = LocalStore(tmp_path / "s")
    journal = attach_journal(cat, [s])
    cat.create_ref(NS, "moved", FP, a1)
    cat.create_ref(NS, "deleted", FP, a1)
    cat.pin(NS, "p", a1)
    cat.remove_change_listener(journal)  # as if the store refused these writes
    cat.update_ref(NS, "moved", expected_head=a1, new_head=a2)
    cat.delete_ref(NS, "deleted")
    cat.create_ref(NS, "new", FP, a2)
    stale = read_journal([s])
    assert stale.refs[(NS, "moved")].head_hash == a1 and not stale.refs[(NS, "deleted")].deleted

    assert resync_journal(cat, [s]) == 3
    state = read_journal([s])
    assert state.refs[(NS, "moved")].head_hash == a2
    assert state.refs[(NS, "deleted")].deleted
    assert state.refs[(NS, "new")].head_hash == a2
    assert state.pins[(NS, "p")].prefix_hash == a1
    assert resync_journal(cat, [s]) == 0  # in agreement now
