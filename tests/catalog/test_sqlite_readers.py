"""The lookup's snapshot reads on SQLite's own connections (`Database.read_rows`, `SQLiteReaders`).

The same lookups through SQLAlchemy's pool (a statement listener on the engine sends them
there) and through the readers agree; one block is one snapshot; a failing block leaves
nothing open; the readers keep at most the pool's size idle, close with the catalog, and a
forked child opens its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from catalog import CatalogUnavailableError
from catalog.catalog import Catalog
from catalog.sqlite_readers import SQLiteReaders
from tests.catalog_helpers import CS, FP, publish

NS = "default"


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True, pool_size=2)
    c.ensure_namespace(NS, CS)
    try:
        yield c
    finally:
        c.close()


@contextlib.contextmanager
def _through_pool(cat: Catalog) -> Iterator[None]:
    """Lookups in this block run on the pool's connections (a listener watches statements)."""

    def watch(*_: Any) -> None:
        pass

    sa.event.listen(cat.engine, "before_cursor_execute", watch)
    try:
        yield
    finally:
        sa.event.remove(cat.engine, "before_cursor_execute", watch)


def test_lookups_through_the_readers_and_through_the_pool_agree(cat: Catalog) -> None:
    rng = np.random.default_rng(7)
    stored = [int(t) for t in rng.integers(1, 50, 10 * CS + 3)]
    publish(cat, NS, stored)
    publish(cat, NS, [*stored[: 4 * CS], *[int(t) for t in rng.integers(1, 50, 3 * CS)]])
    prompts = [stored, stored[: 5 * CS + 1], [*stored[: 4 * CS], 9, 9, 9], [1, 2, 3], [*stored, 5]]
    prompts += [[*stored[: int(n)], 77] for n in rng.integers(1, len(stored), 20)]
    direct = [cat.lookup(NS, FP, p) for p in prompts]
    with _through_pool(cat):
        pooled = [cat.lookup(NS, FP, p) for p in prompts]
    assert direct == pooled
    assert any(m.matched_tokens for m in direct) and any(not m.hit for m in direct)
    # A partial last chunk (the sibling statement) was looked up both ways.
    assert any(m.matched_tokens % CS for m in direct)


def test_one_block_is_one_snapshot(cat: Catalog, tmp_path: Path) -> None:
    """A namespace committed by another connection between two statements of one block is
    seen by neither (the block runs between BEGIN and COMMIT); the next block sees it."""
    count = "SELECT count(*) FROM namespaces"
    other = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
    try:
        with cat.db.read_rows() as rows:
            before = rows(count, ())[0][0]
            other.execute(
                "INSERT INTO namespaces (name, chunk_size, created_at) "
                "VALUES ('late', 4, '2026-12-07 00:00:00')"
            )
            assert rows(count, ())[0][0] == before
        with cat.db.read_rows() as rows:
            assert rows(count, ())[0][0] == before + 1
    finally:
        other.close()


def test_a_block_that_raises_ends_its_snapshot_and_the_connection_serves_again(
    cat: Catalog,
) -> None:
    publish(cat, NS, list(range(100, 100 + 3 * CS)))
    with pytest.raises(KeyError), cat.db.read_rows() as rows:
        rows("SELECT count(*) FROM chunks", ())
        raise KeyError("the caller's own error")
    # The same idle connection is taken next: had its transaction stayed open, BEGIN
    # would fail ("cannot start a transaction within a transaction").
    assert cat.lookup(NS, FP, list(range(100, 100 + 3 * CS))).matched_tokens == 3 * CS - 1


def test_a_database_error_is_unavailable_and_the_next_lookup_reconnects(
    cat: Catalog, tmp_path: Path
) -> None:
    tokens = list(range(100, 100 + 3 * CS))
    publish(cat, NS, tokens)
    assert cat.lookup(NS, FP, tokens).matched_tokens == 3 * CS - 1
    readers = cat.db._sqlite_readers
    assert readers is not None
    broken = readers.take()
    broken.close()  # as a connection the OS or SQLite dropped: every statement fails
    readers.give_back(broken)
    with pytest.raises(CatalogUnavailableError, match=r"catalog .* is unavailable"):
        cat.lookup(NS, FP, tokens)
    assert cat.lookup(NS, FP, tokens).matched_tokens == 3 * CS - 1


def test_readers_keep_at_most_their_size_idle_and_close_with_the_catalog(cat: Catalog) -> None:
    readers = SQLiteReaders(cat.engine, keep=2)
    taken = [readers.take() for _ in range(4)]
    assert len({id(c) for c in taken}) == 4
    for conn in taken:
        readers.give_back(conn)
    alive = [c for c in taken if _open(c)]
    assert len(alive) == 2  # two kept idle, two closed
    in_use = readers.take()
    readers.close()
    assert not any(_open(c) for c in taken if c is not in_use)
    assert _open(in_use)
    readers.give_back(in_use)  # given back after close: closed, not kept
    assert not _open(in_use)


def test_readers_are_configured_as_the_pool_connections(cat: Catalog) -> None:
    readers = SQLiteReaders(cat.engine, keep=1)
    conn = readers.take()
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert conn.isolation_level is None  # BEGIN and COMMIT are the reader's own
    finally:
        readers.close()
        readers.drop(conn)


def test_catalog_close_closes_the_idle_readers(tmp_path: Path) -> None:
    c = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    c.ensure_namespace(NS, CS)
    publish(c, NS, list(range(100, 100 + 2 * CS)))
    c.lookup(NS, FP, list(range(100, 100 + 2 * CS)))
    readers = c.db._sqlite_readers
    assert readers is not None
    idle = list(readers._idle)
    assert idle
    c.close()
    assert not any(_open(conn) for conn in idle)


_PARENT: Any = None  # the parent's catalog, as a forked child inherits it


def _lookup_in_child(tokens: list[int], out: Any) -> None:
    matched = _PARENT.lookup(NS, FP, tokens).matched_tokens
    out.put((matched, [id(c) for c in _PARENT.db._sqlite_readers._idle]))


def test_a_forked_child_opens_its_own_connections(cat: Catalog) -> None:
    """SQLite connections must not cross a fork: the child's lookup opens its own, and the
    parent's stay the parent's."""
    global _PARENT
    tokens = list(range(100, 100 + 3 * CS))
    publish(cat, NS, tokens)
    cat.lookup(NS, FP, tokens)
    readers = cat.db._sqlite_readers
    assert readers is not None
    parent_idle = list(readers._idle)
    assert parent_idle
    _PARENT = cat
    try:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_lookup_in_child, args=(tokens, out))
        child.start()
        matched, child_idle = out.get(timeout=60)
        child.join(60)
    finally:
        _PARENT = None
    assert child.exitcode == 0
    assert matched == 3 * CS - 1
    assert child_idle and not set(child_idle) & {id(c) for c in parent_idle}
    assert readers._idle == parent_idle and all(_open(c) for c in parent_idle)
    assert cat.lookup(NS, FP, tokens).matched_tokens == 3 * CS - 1


def _open(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return False
    return True
