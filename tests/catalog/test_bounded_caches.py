"""The catalog's in-process caches and batches are bounded: namespace and fingerprint caches
(an LRU of `CACHE_ENTRIES`), and the access uses waiting for a flush (`MAX_NOTED`, the
excess counted, not kept)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from catalog import transactions
from catalog.access import AccessLog
from catalog.catalog import Catalog
from catalog.identity import Fingerprint
from catalog.lru import LRU
from kvc.service.app import create_app
from kvc.service.limits import BodyLimit
from tests.catalog_helpers import CS, FP, publish

TOKENS = list(range(100, 114))  # chunks of 4, 4, 4 and a tail of 2


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace("default", CS)
    yield c
    c.close()


def test_the_lru_forgets_the_least_recently_used() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # "b" is now the least recently used
    lru.put("c", 3)
    assert len(lru) == 2 and "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    with pytest.raises(ValueError):
        LRU(0)


def test_a_weighed_lru_keeps_its_weight_under_the_bound() -> None:
    lru: LRU[str, bytes] = LRU(100, max_weight=10, weigh=len)
    lru.put("a", b"xxxx")
    lru.put("b", b"xxxx")
    lru.put("c", b"xxxx")  # 12 > 10: "a" goes
    assert "a" not in lru and lru.weight == 8
    lru.put("b", b"x")  # replacing an entry replaces its weight
    assert lru.weight == 5
    lru.put("huge", b"x" * 11)  # heavier than the bound: not kept, nothing else lost
    assert "huge" not in lru and lru.weight == 5 and len(lru) == 2
    with pytest.raises(ValueError, match="go together"):
        LRU(2, max_weight=10)


def test_the_fingerprint_cache_is_bounded_by_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Many large descriptors (each under the 64 KiB cap) never hold more than the byte bound."""
    monkeypatch.setattr(transactions, "FINGERPRINT_CACHE_BYTES", 200_000)
    small = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    try:
        for i in range(20):
            desc = dict(FP.descriptor)
            desc["config"] = {"i": i, "pad": "x" * 60_000}
            small.register_fingerprint(Fingerprint.from_descriptor(desc), namespace="default")
        assert small.db._fp_cache.weight <= 200_000 and len(small.db._fp_cache) == 3
        first = dict(FP.descriptor)
        first["config"] = {"i": 0, "pad": "x" * 60_000}
        again = Fingerprint.from_descriptor(first)
        assert small.get_fingerprint(again.hex, namespace="default") == again  # read again
    finally:
        small.close()


def test_the_namespace_cache_is_bounded(
    cat: Catalog, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(transactions, "CACHE_ENTRIES", 3)
    small = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        for i in range(10):
            assert small.ensure_namespace(f"ns{i}", CS) == CS
        assert len(small.db._ns_cache) == 3
        # Forgotten entries are read again from the database.
        assert small.ensure_namespace("ns0", CS + 1) == CS
        publish(small, "default", TOKENS)
        assert small.lookup("default", FP, TOKENS).matched_tokens == len(TOKENS) - 1
        assert len(small.db._ns_cache) == 3 and len(small.db._fp_cache) == 1
    finally:
        small.close()


def test_access_uses_past_the_limit_are_counted_not_kept(cat: Catalog) -> None:
    publish(cat, "default", TOKENS)
    # A limit of 8 chunk uses between flushes: two lookups of 4 chunks fit, the third is dropped.
    cat._access.close()
    cat._access = AccessLog(cat.db, flush_s=3600, max_noted=8)
    for _ in range(3):
        cat.lookup("default", FP, TOKENS)
    assert cat._access.dropped == 4
    cat.flush_access()
    cat.lookup("default", FP, TOKENS)  # room again after a flush
    cat.flush_access()
    with cat.engine.connect() as conn:
        counts = conn.execute(sa.text("SELECT access_count FROM chunks")).scalars().all()
    assert counts == [3, 3, 3, 3] and cat._access.dropped == 4


# -- the service's request bodies ------------------------------------------------------


def test_request_bodies_over_the_limit_are_413_unparsed() -> None:
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=100)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"got": len(await request.body())}

    client = TestClient(app)
    assert client.post("/echo", content=b"x" * 100).json() == {"got": 100}
    big = client.post("/echo", content=b"x" * 101)
    assert big.status_code == 413 and "100 bytes" in big.json()["detail"]

    def chunks(n: int) -> Iterator[bytes]:
        for _ in range(n):
            yield b"x" * 30

    # Without a Content-Length (chunked): read up to the limit, then refused or passed on.
    assert client.post("/echo", content=chunks(3)).json() == {"got": 90}
    assert client.post("/echo", content=chunks(4)).status_code == 413


def test_the_service_refuses_a_body_over_its_limit(cat: Catalog) -> None:
    token = "t0k3n"
    app = create_app(
        cat,
        {"default": hashlib.sha256(token.encode()).hexdigest()},
        max_prompt_tokens=1 << 20,
        max_body_bytes=1000,
    )
    client = TestClient(app)
    auth = {"Authorization": f"Bearer {token}"}
    body = {"fingerprint": FP.hex, "tokens": list(range(1000))}
    r = client.post("/v1/namespaces/default/lookup", json=body, headers=auth)
    assert r.status_code == 413, r.text
    # Without a token it is still a 401, body unread.
    assert client.post("/v1/namespaces/default/lookup", json=body).status_code == 401
