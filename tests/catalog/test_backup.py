"""`kvc backup` and catalog.backup: a consistent, verified SQLite copy, even while writers publish."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from catalog import chain_root
from catalog.backup import backup_sqlite
from catalog.catalog import Catalog
from catalog.errors import CatalogInputError, CatalogUnavailableError
from kvc.cli import cli
from tests.catalog_helpers import CS, FP, chain_records, publish

NS = "default"


def tokens_of(i: int) -> list[int]:
    # 5 chunks of 4 plus a tail: distinct chains that share nothing after the root.
    return [i * 1000 + k for k in range(22)]


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace(NS, CS)
    yield c
    c.close()


def whole_chains(path: Path) -> tuple[int, int]:
    """(prefixes, chunks) of the catalog at `path`, asserting every chain in it is whole."""
    with Catalog.open(f"sqlite:///{path}") as c, c.engine.connect() as conn:
        prefixes = {
            bytes(h): bytes(p)
            for h, p in conn.exec_driver_sql("SELECT prefix_hash, parent_hash FROM prefixes")
        }
        chunk_prefixes = [
            bytes(h) for (h,) in conn.exec_driver_sql("SELECT prefix_hash FROM chunks")
        ]
    root = chain_root(NS)
    orphans = [
        h.hex() for h, parent in prefixes.items() if parent != root and parent not in prefixes
    ]
    assert orphans == [], "prefix nodes whose parent is not catalogued"
    assert set(chunk_prefixes) <= set(prefixes)
    return len(prefixes), len(chunk_prefixes)


def test_a_backup_taken_while_a_writer_publishes_is_one_consistent_snapshot(
    cat: Catalog, tmp_path: Path
) -> None:
    before = 40
    for i in range(before):
        publish(cat, NS, tokens_of(i))
    published = threading.Semaphore(0)
    stop = threading.Event()
    written: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        # Chains land in two transactions (the head after its parents), so a copy mixing
        # pages from before and after a commit would show a child without its parent.
        try:
            i = before
            while not stop.is_set():
                recs = chain_records(NS, tokens_of(i))
                cat.record_chunks(recs[:3])
                cat.record_chunks(recs[3:])
                written.append(i)
                published.release()
                i += 1
        except BaseException as exc:
            errors.append(exc)
            published.release()

    steps: list[tuple[int, int | None]] = []

    def progress(stage: str, done: int, total: int | None) -> None:
        assert stage == "backup"
        # A copy that is not one snapshot restarts whenever a writer commits: done drops back.
        assert not steps or done > steps[-1][0], "the backup restarted after a commit"
        steps.append((done, total))
        # Every step waits for the writer to commit another chain: writes interleave the copy.
        assert published.acquire(timeout=30), "the writer stalled during the backup"
        assert not errors, errors

    t = threading.Thread(target=writer)
    t.start()
    try:
        report = backup_sqlite(cat, tmp_path / "backup.db", pages_per_step=2, progress=progress)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert len(steps) >= 5 and steps[-1][0] == steps[-1][1] == report.pages
    assert report.integrity == "ok" and report.revision == cat.current_revision()
    assert report.bytes == (tmp_path / "backup.db").stat().st_size

    n_prefixes, n_chunks = whole_chains(tmp_path / "backup.db")
    live_prefixes, _ = whole_chains(tmp_path / "catalog.db")
    assert n_prefixes == n_chunks
    assert before * 6 <= n_prefixes < live_prefixes  # the writer went on after the snapshot
    with Catalog.open(f"sqlite:///{tmp_path / 'backup.db'}") as copy:
        found = 0
        for i in range(before + len(written)):
            m = copy.lookup(NS, FP, [*tokens_of(i), 7])
            assert m.matched_tokens in (0, 12, 22)  # nothing, the first transaction, or all
            found += m.matched_tokens == 22
            if i < before:
                assert m.matched_tokens == 22
        assert found >= before


def test_a_backup_is_one_self_contained_file(cat: Catalog, tmp_path: Path) -> None:
    publish(cat, NS, tokens_of(1))
    target = tmp_path / "b.db"
    backup_sqlite(f"sqlite:///{tmp_path / 'catalog.db'}", target)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("b.db")) == ["b.db"]
    conn = sqlite3.connect(f"{target.as_uri()}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        conn.close()


def test_an_existing_target_is_kept_unless_forced(cat: Catalog, tmp_path: Path) -> None:
    target = tmp_path / "b.db"
    target.write_bytes(b"keep me")
    with pytest.raises(CatalogInputError, match="exists"):
        backup_sqlite(cat, target)
    assert target.read_bytes() == b"keep me"
    report = backup_sqlite(cat, target, force=True)
    assert report.integrity == "ok" and target.stat().st_size == report.bytes
    with pytest.raises(CatalogInputError, match="the catalog itself"):
        backup_sqlite(cat, tmp_path / "catalog.db", force=True)


def test_a_failed_backup_leaves_nothing_at_the_target(cat: Catalog, tmp_path: Path) -> None:
    for i in range(5):
        publish(cat, NS, tokens_of(i))

    def die(stage: str, done: int, total: int | None) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        backup_sqlite(cat, tmp_path / "b.db", pages_per_step=1, progress=die)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        n for n in ("catalog.db", "catalog.db-shm", "catalog.db-wal") if (tmp_path / n).exists()
    ]


def test_postgresql_and_schemaless_catalogs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CatalogInputError, match="pg_dump"):
        backup_sqlite("postgresql+psycopg://kvc:secret@db/kvc", tmp_path / "b.db")
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    with pytest.raises(CatalogInputError, match="no kvc schema"):
        backup_sqlite(f"sqlite:///{empty}", tmp_path / "b.db")
    assert not (tmp_path / "b.db").exists()
    with pytest.raises(CatalogUnavailableError, match="does not exist"):
        backup_sqlite(f"sqlite:///{tmp_path / 'nothing.db'}", tmp_path / "b.db")
    assert not (tmp_path / "nothing.db").exists()  # never created by the attempt


def test_kvc_backup_command(cat: Catalog, tmp_path: Path) -> None:
    publish(cat, NS, tokens_of(1))
    runner = CliRunner()
    env = {"KVC_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}", "KVC_HOME": str(tmp_path)}
    target = tmp_path / "b.db"
    out = runner.invoke(cli, ["backup", str(target), "--json"], env=env)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["path"] == str(target) and doc["integrity"] == "ok"
    assert doc["revision"] == cat.current_revision() and doc["pages"] > 0
    whole_chains(target)

    again = runner.invoke(cli, ["backup", str(target)], env=env)
    assert again.exit_code == 2 and "exists" in again.stderr
    forced = runner.invoke(cli, ["backup", str(target), "--force"], env=env)
    assert forced.exit_code == 0 and "integrity ok" in forced.stdout

    pg = runner.invoke(
        cli, ["backup", str(tmp_path / "p.db"), "--catalog", "postgresql+psycopg://kvc:pw@db/kvc"]
    )
    assert pg.exit_code == 2
    assert "pg_dump" in pg.stderr and "pw" not in pg.stderr
    missing = runner.invoke(
        cli, ["backup", str(tmp_path / "m.db"), "--catalog", f"sqlite:///{tmp_path / 'no.db'}"]
    )
    assert missing.exit_code == 1 and "does not exist" in missing.stderr
