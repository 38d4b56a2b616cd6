"""maintenance.fsck, maintenance.sweep and maintenance.collect as a library: reports, progress, what they delete.

SQLite and local directory stores; `kvc fsck`/`kvc gc` over these are tested in
test_cli_commands.py and test_gc.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from catalog.catalog import Catalog
from catalog.gc import GC_LOCK, acquire_lock, lock_holder
from chunkstore import ChunkStore, open_store
from maintenance.collect import run_gc
from maintenance.errors import GcLockedError, MissingReplicasError
from maintenance.fsck import fsck
from maintenance.sweep import sweep_orphans
from restore.errors import InputError
from tests.kvc.test_cli_commands import Home, _populate

NS = "default"


class Calls:
    """A progress callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        self.calls.append((stage, done, total))

    def stages(self) -> list[str]:
        return list(dict.fromkeys(s for s, _, _ in self.calls))


@pytest.fixture
def home(tmp_path: Path) -> Iterator[tuple[Home, Catalog, ChunkStore]]:
    """100 tokens checkpointed as ref `chat` (4 chunks) in a SQLite catalog and a local store."""
    h = _populate(tmp_path / "home")
    store = open_store(h.store_name)
    with Catalog.open(h.catalog_url) as cat:
        yield h, cat, store
    store.close()


def state(cat: Catalog, key: str, location: str) -> str:
    from catalog.admin import replicas_of

    (r,) = [r for r in replicas_of(cat, [key])[key] if r.location == location]
    return r.state


def corrupt(h: Home, key: str) -> None:
    path = h.blob_path(key)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only reading the data can tell
    path.write_bytes(bytes(data))


def orphan(h: Home, store: ChunkStore, payload: bytes, age_s: float) -> str:
    key = blake3.blake3(payload).hexdigest()
    store.put(key, payload)
    t = time.time() - age_s
    os.utime(h.blob_path(key), (t, t))
    return key


def age_everything(h: Home, age_s: float) -> None:
    t = time.time() - age_s
    for p in (h.path / "blobs").rglob("*"):
        if p.is_file():
            os.utime(p, (t, t))


# -- fsck -----------------------------------------------------------------------------------


def test_fsck_clean_and_progress_has_totals(home: tuple[Home, Catalog, ChunkStore]) -> None:
    _h, cat, store = home
    progress = Calls()
    report = fsck(cat, [store], progress=progress)
    assert report.clean and (report.checked, report.ok) == (4, 4)
    assert report.stores == [store.name] and report.not_checked == {}
    assert progress.calls == [("fsck", i, 4) for i in range(1, 5)]


def test_fsck_reports_and_marks_missing_and_corrupt(home: tuple[Home, Catalog, ChunkStore]) -> None:
    h, cat, store = home
    (_, k0), (_, k1), (_, k2), _ = h.chain()
    h.blob_path(k2).unlink()
    corrupt(h, k1)
    quick = fsck(cat, [store])  # existence and size only: the corrupt blob passes
    assert [(m.blob_key, m.was) for m in quick.missing] == [(k2, "durable")]
    assert quick.corrupt == [] and not quick.clean and quick.ok == 3
    assert state(cat, k2, store.name) == "missing"
    full = fsck(cat, [store], read_data=True)
    assert [c.blob_key for c in full.corrupt] == [k1]
    assert "hash" in full.corrupt[0].reason
    assert [(m.blob_key, m.was) for m in full.missing] == [(k2, "missing")]
    assert state(cat, k1, store.name) == "corrupt" and state(cat, k0, store.name) == "durable"
    assert full.repaired == []  # no other store to repair from
    assert full.to_dict()["corrupt"][0]["blob_key"] == k1
    # Existence and size cannot clear a corrupt mark: a quick check still lists it.
    again = fsck(cat, [store])
    assert [c.blob_key for c in again.corrupt] == [k1] and not again.clean
    assert "marked corrupt" in again.corrupt[0].reason
    assert state(cat, k1, store.name) == "corrupt"


def test_fsck_repairs_from_a_second_store_and_revives(
    home: tuple[Home, Catalog, ChunkStore], tmp_path: Path
) -> None:
    from restore.write_behind import to_replica_receipt

    h, cat, store = home
    second = open_store(f"file://{tmp_path / 'second'}")
    for _, key in h.chain():
        cat.record_replica(key, to_replica_receipt(second.put(key, bytes(store.get(key))), "local"))
    _, key = h.chain()[2]
    corrupt(h, key)
    report = fsck(cat, [store, second], read_data=True)
    assert [(r.blob_key, r.location, r.source) for r in report.repaired] == [
        (key, store.name, second.name)
    ]
    assert state(cat, key, store.name) == "durable"
    assert fsck(cat, [store, second], read_data=True).clean
    second.close()


def test_fsck_subset_and_bad_subset(home: tuple[Home, Catalog, ChunkStore]) -> None:
    _h, cat, store = home
    parts = [fsck(cat, [store], subset=(n, 3)).checked for n in (1, 2, 3)]
    assert sum(parts) == 4
    with pytest.raises(InputError):
        fsck(cat, [store], subset=(3, 2))


def test_fsck_counts_other_locations_as_not_checked(
    home: tuple[Home, Catalog, ChunkStore], tmp_path: Path
) -> None:
    _h, cat, store = home
    other = open_store(f"file://{tmp_path / 'other'}")
    report = fsck(cat, [other])
    assert report.clean and report.checked == 0 and report.not_checked == {store.name: 4}


# -- the orphan sweep ------------------------------------------------------------------------


def test_sweep_respects_grace(home: tuple[Home, Catalog, ChunkStore]) -> None:
    h, cat, store = home
    age_everything(h, 7200)  # old catalogued blobs are never orphans
    old = orphan(h, store, b"left by a crashed publish", 7200)
    young = orphan(h, store, b"a publish in flight", 10)
    progress = Calls()
    dry = sweep_orphans(cat, [store], grace_s=3600, dry_run=True, progress=progress)
    assert [o.blob_key for o in dry.deleted] == [old] and h.blob_path(old).exists()
    assert (dry.kept_catalogued, dry.kept_young) == (4, 1)
    assert progress.stages() == [f"gc {store.name}"]
    assert [d for _, d, _ in progress.calls] == list(range(1, 7))  # six blobs listed
    report = sweep_orphans(cat, [store], grace_s=3600)
    assert [(o.blob_key, o.store) for o in report.deleted] == [(old, store.name)]
    assert report.deleted_bytes == len(b"left by a crashed publish") and report.errors == []
    assert not h.blob_path(old).exists() and h.blob_path(young).exists()
    assert all(h.blob_path(k).exists() for _, k in h.chain())
    again = sweep_orphans(cat, [store], grace_s=0)
    assert [o.blob_key for o in again.deleted] == [young]
    with pytest.raises(InputError):
        sweep_orphans(cat, [store], grace_s=-1)


def test_sweep_looks_up_the_store_a_page_at_a_time(
    home: tuple[Home, Catalog, ChunkStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep reads the catalogue by the listed keys, a page at a time: never every
    replica at the store (at ten million chunks, a set of ten million keys in memory)."""
    import sqlalchemy as sa

    import maintenance.sweep

    h, cat, store = home
    age_everything(h, 7200)
    old = [orphan(h, store, b"left by crashed publish %d" % i, 7200) for i in range(3)]
    monkeypatch.setattr(maintenance.sweep, "SWEEP_PAGE", 2)  # 7 blobs: four pages
    replica_reads: list[str] = []

    @sa.event.listens_for(cat.engine, "before_cursor_execute")
    def seen(conn: object, cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM replicas" in statement:
            replica_reads.append(statement)

    try:
        report = sweep_orphans(cat, [store], grace_s=3600)
    finally:
        sa.event.remove(cat.engine, "before_cursor_execute", seen)
    assert sorted(o.blob_key for o in report.deleted) == sorted(old)
    assert report.kept_catalogued == 4 and report.kept_young == 0
    assert all(h.blob_path(k).exists() for _, k in h.chain())
    assert len(replica_reads) == 5  # one per page, and one for the candidates
    assert all("replicas.blob_key IN" in sql for sql in replica_reads), replica_reads


# -- a GC run -------------------------------------------------------------------------------


def test_gc_run_deletes_only_purged_blobs(home: tuple[Home, Catalog, ChunkStore]) -> None:
    h, cat, store = home
    chain = h.chain()
    cat.delete_ref(NS, "chat")
    cat.quarantine(NS, bytes.fromhex(chain[2][0]), "bad kernel")
    progress = Calls()
    report = run_gc(cat, [store], NS, progress=progress)
    assert report.retention.plan is not None and report.retention.result is not None
    assert {i.blob_key for i in report.retention.plan.items} == {chain[2][1], chain[3][1]}
    assert report.retention.result.chunks_removed == 2
    assert not h.blob_path(chain[2][1]).exists() and not h.blob_path(chain[3][1]).exists()
    assert h.blob_path(chain[0][1]).exists() and h.blob_path(chain[1][1]).exists()
    assert report.sweep.deleted == [] and report.sweep.kept_catalogued == 2
    assert "gc purge" in progress.stages() and f"gc {store.name}" in progress.stages()
    assert lock_holder(cat, GC_LOCK) is None
    doc = report.to_dict()
    assert doc["retention"]["result"]["chunks_removed"] == 2 and doc["deleted"] == []


def test_gc_dry_run_changes_nothing(home: tuple[Home, Catalog, ChunkStore]) -> None:
    h, cat, store = home
    cat.delete_ref(NS, "chat")
    assert acquire_lock(cat, GC_LOCK, "someone else", 600)  # a dry run is not refused
    report = run_gc(cat, [store], NS, max_age_s=0, dry_run=True)
    assert report.retention.plan is not None and len(report.retention.plan.items) == 4
    assert report.retention.resumed is None and report.retention.result is None
    assert all(h.blob_path(k).exists() for _, k in h.chain())


def test_gc_run_refuses_while_locked_or_missing(home: tuple[Home, Catalog, ChunkStore]) -> None:
    h, cat, store = home
    _, key = h.chain()[1]
    assert acquire_lock(cat, GC_LOCK, "someone else", 600)
    with pytest.raises(GcLockedError) as locked:
        run_gc(cat, [store], NS)
    assert locked.value.holder == "someone else" and "another GC is running" in str(locked.value)
    from catalog.gc import release_lock

    release_lock(cat, GC_LOCK, "someone else")
    cat.mark_replica(key, store.name, "missing", reason="test")
    with pytest.raises(MissingReplicasError) as missing:
        run_gc(cat, [store], NS, holder="me")
    assert missing.value.missing == 1
    assert lock_holder(cat, GC_LOCK) is None  # released on the way out
    forced = run_gc(cat, [store], NS, force=True)
    assert forced.sweep.errors == [] and forced.retention.plan is not None


def test_gc_run_on_an_unknown_namespace_still_sweeps(
    home: tuple[Home, Catalog, ChunkStore],
) -> None:
    h, cat, store = home
    old = orphan(h, store, b"old bytes", 7200)
    report = run_gc(cat, [store], "nobody")
    assert report.retention.plan is None
    assert report.retention.to_dict()["items"] == []
    assert [o.blob_key for o in report.sweep.deleted] == [old]
