"""Token-exact resume through a real `kvc serve` (uvicorn on loopback) with RemoteCatalog."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog.catalog import Catalog
from catalog.connect import connect
from catalog.errors import CatalogInputError, NotFoundError, SchemaVersionError
from catalog.remote import RemoteCatalog
from chunkstore import ChunkStore, open_store
from kvc.service import create_app, hash_token
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer
from tests.restore.test_token_exact import digest
from tests.services import serve_in_thread

PAGE, CHUNK = 16, 32
MODEL = ReferenceModel.small(seed=0)
TOKEN = "remote-test-token-0c4e"


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    yield cat
    cat.close()


@pytest.fixture
def base_url(catalog: Catalog) -> Iterator[str]:
    app = create_app(catalog, {"default": hash_token(TOKEN)}, max_prompt_tokens=4096)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = open_store(f"file://{tmp_path / 'blobs'}")
    yield s
    s.close()


def prompt(n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(1).integers(0, MODEL.vocab_size, n)]


def run(pool: PagePool, route: int, rest: list[int], n: int) -> tuple[list[int], list[str]]:
    out, logits = MODEL.trace(pool, route, rest, n)
    return out, [digest(x) for x in logits]


def test_resume_through_the_service_is_bit_identical(
    base_url: str, store: ChunkStore, catalog: Catalog
) -> None:
    p = prompt(100)
    fresh = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    want = run(fresh, fresh.new_route(), p, 5)

    with RemoteCatalog(base_url, TOKEN) as remote:
        pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
        route = pool.new_route()
        MODEL.prefill(pool, route, p)
        with Checkpointer(remote, store, chunk_size=CHUNK) as cp:
            cp.checkpoint(pool, route, p, MODEL.fingerprint, name="conversation")

        target = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
        with Restorer(remote, [store]) as r:
            res = r.restore(target, p, MODEL.fingerprint)
        assert res.restored_tokens == 99 and res.route is not None
        got = run(target, res.route, p[99:], 5)
        assert got == want  # tokens and every logits vector, bit for bit

        ref = remote.get_ref("default", "conversation")
        assert ref.processed == 100
        assert remote.lineage("default", ref.head_hash)[-1].prefix_hash == ref.head_hash
    # What the service wrote is in the catalog itself.
    assert catalog.get_ref("default", "conversation").head_hash == ref.head_hash
    assert catalog.stats("default")["chunks"] == 4


def test_a_second_checkpoint_moves_the_ref_by_cas_and_skips_known_chunks(
    base_url: str, store: ChunkStore
) -> None:
    p = prompt(100)
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    route = pool.new_route()
    MODEL.prefill(pool, route, p)
    with RemoteCatalog(base_url, TOKEN) as remote:
        with Checkpointer(remote, store, chunk_size=CHUNK) as cp:
            first: Any = cp.checkpoint(pool, route, p[:64], MODEL.fingerprint, name="c")
            second: Any = cp.checkpoint(pool, route, p, MODEL.fingerprint, name="c")
        assert first.new_chunks == 2
        assert second.skipped_chunks == 2 and second.new_chunks == 2
        assert remote.get_ref("default", "c").processed == 100
        remote.delete_ref("default", "c")
        with pytest.raises(NotFoundError):
            remote.get_ref("default", "c")


def test_connect_opens_a_service_or_a_database_by_url(
    base_url: str, catalog: Catalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVC_SERVICE_TOKEN", TOKEN)
    remote = connect(base_url)
    assert isinstance(remote, RemoteCatalog)
    assert remote.stats("default") == catalog.stats("default")
    remote.close()
    sql = connect(f"sqlite:///{tmp_path / 'catalog.db'}")
    assert isinstance(sql, Catalog)
    sql.close()
    monkeypatch.delenv("KVC_SERVICE_TOKEN")
    with pytest.raises(CatalogInputError, match="bearer token"):
        connect(base_url)
    with pytest.raises(CatalogInputError, match="empty"):
        connect(" ")
    with pytest.raises(SchemaVersionError, match="does not exist"):  # nothing created on open
        connect(f"sqlite:///{tmp_path / 'other.db'}")
    assert not (tmp_path / "other.db").exists()
    (tmp_path / "empty.db").touch()
    with pytest.raises(SchemaVersionError, match="no kvc schema"):  # never migrated on open
        connect(f"sqlite:///{tmp_path / 'empty.db'}")


def test_connect_reads_an_existing_sqlite_catalog_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.db"
    with pytest.raises(SchemaVersionError, match="does not exist"):
        connect(f"sqlite:///{missing}")
    assert not missing.parent.exists()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database")
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4096)
    for path in (garbage, damaged, tmp_path):
        with pytest.raises(SchemaVersionError, match="not a SQLite database"):
            connect(f"sqlite:///{path}")
    assert garbage.read_bytes() == b"not a database"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.db", "garbage.db"]
