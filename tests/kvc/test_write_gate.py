"""Writes waiting for the database's write lock never make a lookup wait for a thread."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from catalog.catalog import Catalog
from catalog.wire import ChunkRecordModel
from kvc.service import create_app, hash_token
from kvc.service.gate import is_write
from tests.catalog_helpers import CS, FP, chain_records, publish
from tests.services import serve_in_thread

TOKEN = "token-for-the-write-gate-test-0001"
STORED = list(range(100, 100 + 4 * CS))
THREADS = 2
WRITERS = 4  # more writes in flight than the service has threads


class CountRequests:
    """The app, counting the publishes it has received (before any middleware of the app)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.publishes = 0
        self.changed = threading.Condition()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chunks"):
            with self.changed:
                self.publishes += 1
                self.changed.notify_all()
        await self.app(scope, receive, send)


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace("a", CS)
    publish(c, "a", STORED)
    yield c
    c.close()


def publish_body(seed: int) -> dict[str, Any]:
    recs = chain_records("a", list(range(10_000 * (seed + 1), 10_000 * (seed + 1) + 2 * CS)))
    return {
        "fingerprints": {FP.hex: dict(FP.descriptor)},
        "records": [ChunkRecordModel.of(r).model_dump(mode="json") for r in recs],
    }


def test_a_lookup_answers_while_more_writes_than_threads_wait_for_the_write_lock(
    cat: Catalog, tmp_path: Path
) -> None:
    app = CountRequests(create_app(cat, {"a": hash_token(TOKEN)}, max_prompt_tokens=1024, threads=THREADS))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    entered = threading.Semaphore(0)
    record_chunks = cat.record_chunks

    def counted_record_chunks(*args: Any, **kwargs: Any) -> Any:
        entered.release()
        return record_chunks(*args, **kwargs)

    cat.record_chunks = counted_record_chunks  # type: ignore[method-assign]
    statuses: list[int] = []
    # Another process's writer holds SQLite's write lock: every publish waits for it.
    holder = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with serve_in_thread(app, lifespan="on") as url, httpx.Client(base_url=url, timeout=60) as http:

        def write(seed: int) -> None:
            statuses.append(http.post("/v1/namespaces/a/chunks", json=publish_body(seed), headers=headers).status_code)

        writers = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS)]
        for t in writers:
            t.start()
        try:
            with app.changed:
                assert app.changed.wait_for(lambda: app.publishes == WRITERS, timeout=30)
            assert entered.acquire(timeout=30), "no publish reached the catalog"
            # The lock is still held: the lookup is answered beside the waiting writes.
            r = http.post(
                "/v1/namespaces/a/lookup",
                json={"fingerprint": FP.hex, "tokens": [*STORED, 7]},
                headers=headers,
                timeout=20,
            )
            assert r.status_code == 200, r.text
            assert r.json()["matched_tokens"] == len(STORED)
            assert statuses == []  # no write got through meanwhile
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            for t in writers:
                t.join(timeout=60)
    assert statuses == [200] * WRITERS


@pytest.mark.parametrize(
    ("method", "path", "write"),
    [
        ("GET", "/v1/namespaces/a/stats", False),
        ("POST", "/v1/namespaces/a/lookup", False),
        ("POST", "/v1/namespaces/a/known", False),
        ("POST", "/v1/namespaces/a/prefixes/with-tokens", False),
        ("POST", "/v1/namespaces/a/demand/query", False),
        ("POST", "/v1/namespaces/a/chunks", True),
        ("POST", "/v1/namespaces/a/demand", True),
        ("POST", "/v1/namespaces/a/replicas/mark", True),
        ("PUT", "/v1/namespaces/a/refs/x", True),
        ("DELETE", "/v1/namespaces/a/pins/x", True),
    ],
)
def test_reads_and_writes_are_told_apart(method: str, path: str, write: bool) -> None:
    assert is_write({"type": "http", "method": method, "path": path}) is write
