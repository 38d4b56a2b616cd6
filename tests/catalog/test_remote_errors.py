"""RemoteCatalog against a real `kvc serve`: the whole catalog seam, the same error classes as the
SQL catalog, and transport failures as "did not land" or "outcome unknown"."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    # Starlette nudges towards `httpx2`; the project uses httpx, which TestClient still supports.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

from catalog import Catalog, CatalogAPI
from catalog.errors import (
    CatalogUnavailableError,
    OutcomeUnknownError,
)
from catalog.remote import RemoteCatalog
from kvc.service import create_app, hash_token
from tests.catalog_helpers import CS, FP, chain_records, publish, receipt
from tests.fault_proxy import FaultProxy
from tests.services import serve_in_thread

TOKEN_A = "remote-errors-token-a-5d1e"
TOKEN_B = "remote-errors-token-b-0c7a"
TOKENS = list(range(300, 310))  # 2 full chunks of 4 and a tail of 2
UNKNOWN = bytes(range(32))


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace("a", CS)
    c.ensure_namespace("b", CS)
    yield c
    c.close()


@pytest.fixture
def url(cat: Catalog) -> Iterator[str]:
    app = create_app(
        cat, {"a": hash_token(TOKEN_A), "b": hash_token(TOKEN_B)}, max_prompt_tokens=64
    )
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture
def remote(url: str) -> Iterator[RemoteCatalog]:
    with RemoteCatalog(url, TOKEN_A, namespace="a", timeout=10) as r:
        yield r


def test_importing_the_client_loads_no_web_framework() -> None:
    code = (
        "import sys, catalog.remote\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- the same mistake, the same class ----------------------------------------------------

# Each takes a catalog with namespace "a" holding the chain of TOKENS and the ref "r"
# at its first chunk, and makes one mistake.
Mistake = Callable[[CatalogAPI, list[bytes]], object]
MISTAKES: dict[str, Mistake] = {
    "empty ref name": lambda c, h: c.create_ref("a", "", FP, h[0]),
    "ref name with a newline": lambda c, h: c.create_ref("a", "x\ny", FP, h[0]),
    "unknown ref": lambda c, h: c.get_ref("a", "nope"),
    "delete an unknown ref": lambda c, h: c.delete_ref("a", "nope"),
    "ref that exists": lambda c, h: c.create_ref("a", "r", FP, h[1]),
    "ref CAS conflict": lambda c, h: c.update_ref("a", "r", expected_head=h[1], new_head=h[2]),
    "ref at an unknown prefix": lambda c, h: c.create_ref("a", "new", FP, UNKNOWN),
    "fork onto an existing name": lambda c, h: c.fork_ref("a", "r", "r"),
    "empty tokens": lambda c, h: c.lookup("a", FP, []),
    "token out of range": lambda c, h: c.lookup("a", FP, [1, 2**32]),
    "negative max_tokens": lambda c, h: c.lookup("a", FP, [1, 2, 3], max_tokens=-1),
    "unknown replica state": lambda c, h: c.mark_replica(
        chain_records("a", TOKENS)[0].blob_key,
        "file:///store",
        "lost",
        reason="x",  # type: ignore[arg-type]
    ),
    "quarantine without a reason": lambda c, h: c.quarantine("a", h[0], ""),
    "quarantine an unknown prefix": lambda c, h: c.quarantine("a", UNKNOWN, "bad"),
    "lineage of an unknown prefix": lambda c, h: c.lineage("a", UNKNOWN),
    "an unknown prefix": lambda c, h: c.get_prefix("a", UNKNOWN),
    "a short prefix hash": lambda c, h: c.lineage("a", b"\x01\x02"),
    "pin an unknown prefix": lambda c, h: c.pin("a", "p", UNKNOWN),
    "pin with a negative ttl": lambda c, h: c.pin("a", "p", h[0], ttl_s=-1),
    "empty pin name": lambda c, h: c.pin("a", "", h[0]),
    "pin name with a tab": lambda c, h: c.pin("a", "a\tb", h[0]),
    "unpin an unknown pin": lambda c, h: c.unpin("a", "nope"),
    "publish without the parent": lambda c, h: c.record_chunks(
        chain_records("a", [*TOKENS, 1, 2, 3], start_chunk=3)
    ),
    "a replica of an unknown blob": lambda c, h: c.record_replica(
        "0" * 64, receipt(), namespace="a"
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_same_mistake_raises_the_same_class(
    cat: Catalog, remote: RemoteCatalog, mistake: str
) -> None:
    recs = publish(cat, "a", TOKENS)
    heads = [r.prefix_hash for r in recs]
    cat.create_ref("a", "r", FP, heads[0])
    make = MISTAKES[mistake]
    with pytest.raises(Exception) as local:
        make(cat, heads)
    with pytest.raises(Exception) as over_http:
        make(remote, heads)
    assert type(over_http.value) is type(local.value), (local.value, over_http.value)
    assert cat.get_ref("a", "r").head_hash == heads[0]  # and nothing changed


# -- transport failures --------------------------------------------------------------------


def test_a_closed_port_is_unavailable_for_reads_and_writes() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens there now: the connection is refused, nothing was sent.
    with RemoteCatalog(f"http://127.0.0.1:{port}", TOKEN_A, namespace="a", timeout=5) as r:
        with pytest.raises(CatalogUnavailableError):
            r.get_ref("a", "r")
        with pytest.raises(CatalogUnavailableError):
            r.record_chunks(chain_records("a", TOKENS))
        with pytest.raises(ConnectionError):  # a CatalogUnavailableError is a ConnectionError
            r.stats()


def test_a_write_whose_answer_is_lost_is_outcome_unknown(cat: Catalog, url: str) -> None:
    with FaultProxy(url) as proxy, RemoteCatalog(proxy.url, TOKEN_A, namespace="a") as r:
        # The service records the chunks, then the connection drops mid-answer.
        proxy.inject("reset_body", method="POST", key="chunks")
        with pytest.raises(OutcomeUnknownError):
            r.record_chunks(chain_records("a", TOKENS))
        assert cat.stats("a")["chunks"] == 3  # it had landed
        assert r.record_chunks(chain_records("a", TOKENS)).already_present == 3  # idempotent

        # A read that loses its answer did not change anything: unavailable, retry.
        proxy.inject("reset_body", method="POST", key="lookup")
        with pytest.raises(CatalogUnavailableError):
            r.lookup("a", FP, [*TOKENS, 7])
        proxy.inject("reset", method="GET", key="refs")
        with pytest.raises(CatalogUnavailableError):
            r.list_refs("a")

        # A 503 never landed; a 500 to a write may have.
        proxy.inject("503", method="PUT")
        with pytest.raises(CatalogUnavailableError):
            r.create_ref("a", "r", FP, chain_records("a", TOKENS)[0].prefix_hash)
        proxy.inject("500", method="POST", key="chunks")
        with pytest.raises(OutcomeUnknownError):
            r.record_chunks(chain_records("a", TOKENS))
        proxy.inject("500", method="GET", key="stats")
        with pytest.raises(CatalogUnavailableError):
            r.stats()
        assert r.lookup("a", FP, [*TOKENS, 7]).matched_tokens == 10  # and it works again


@pytest.mark.parametrize(
    ("error", "status", "raised"),
    [
        (CatalogUnavailableError("the database is down"), 503, CatalogUnavailableError),
        (OutcomeUnknownError("the commit's answer was lost"), 504, OutcomeUnknownError),
    ],
)
def test_the_catalogs_transport_errors_cross_the_service(
    cat: Catalog,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    status: int,
    raised: type[Exception],
) -> None:
    def failing(*a: object, **k: object) -> Any:
        raise error

    monkeypatch.setattr(cat, "record_chunks", failing)
    app = create_app(cat, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=64)
    with TestClient(app, raise_server_exceptions=False) as client:
        from catalog.wire import ChunkRecordModel

        body = {
            "fingerprints": {FP.hex: dict(FP.descriptor)},
            "records": [
                ChunkRecordModel.of(x).model_dump(mode="json") for x in chain_records("a", TOKENS)
            ],
        }
        r = client.post(
            "/v1/namespaces/a/chunks", json=body, headers={"Authorization": f"Bearer {TOKEN_A}"}
        )
        assert r.status_code == status
        assert r.json()["error"] == type(error).__name__
        assert (r.headers.get("retry-after") is not None) == (status == 503)
        with (
            serve_in_thread(app) as base,
            RemoteCatalog(base, TOKEN_A, namespace="a") as remote,
            pytest.raises(raised),
        ):
            remote.record_chunks(chain_records("a", TOKENS))


# -- the rest of the seam, call for call ------------------------------------------------------


def test_every_call_answers_as_the_sql_catalog(cat: Catalog, remote: RemoteCatalog) -> None:
    recs = publish(cat, "a", TOKENS)
    heads = [r.prefix_hash for r in recs]
    keys = [r.blob_key for r in recs]
    assert remote.get_prefix("a", heads[1]) == cat.get_prefix("a", heads[1])
    assert remote.descendants("a", heads[0]) == cat.descendants("a", heads[0])
    assert remote.lineage("a", heads[2]) == cat.lineage("a", heads[2])
    assert remote.namespace_chunk_size("a") == CS and remote.namespace_chunk_size("zz") is None

    assert remote.replicas_at("file:///store") == cat.replicas_at("file:///store", namespace="a")
    assert sorted(remote.replicas_at("file:///store")) == sorted(keys)
    assert remote.touch_verified("file:///store", keys[:2]) == 2
    assert remote.remove_replicas("file:///store", keys[2:], reason="gone", actor="w1") == 1
    assert sorted(remote.replicas_at("file:///store")) == sorted(keys[:2])
    assert remote.touch_verified("file:///store", []) == 0

    pin = remote.pin("a", "keep/1", heads[1], ttl_s=60, reason="demo", actor="ops")
    assert pin.created_by == "ops" and pin.live
    assert remote.list_pins("a") == cat.list_pins("a")
    assert remote.list_pins("a", include_expired=False) == cat.list_pins("a", include_expired=False)
    remote.unpin("a", "keep/1", actor="ops")
    assert remote.list_pins("a") == []

    remote.declare_demand("worker-1", "a", heads[0], priority=2.5, ttl_s=60)
    remote.declare_demand("worker-2", "a", heads[0])
    assert remote.demand("a", [heads[0], heads[1]]) == cat.demand("a", [heads[0], heads[1]])
    assert remote.demand("a", [heads[0]]) == {heads[0]: 3.5}
    assert remote.demand("a", []) == {}

    remote.create_ref("a", "chat", FP, heads[0], actor="alice")
    remote.delete_ref("a", "chat", actor="bob")
    events = remote.events(namespace="a")
    assert events == cat.events(namespace="a")
    by_kind = {e.kind: e for e in events}
    # The actor the client names is recorded as sent.
    assert by_kind["pin.set"].actor == "ops" and by_kind["pin.remove"].actor == "ops"
    assert by_kind["replica.remove"].actor == "w1"
    assert [e.actor for e in events if e.subject == "chat"] == ["alice", "bob"]
    assert remote.events(kind="pin.set") == cat.events(namespace="a", kind="pin.set")
    last = events[-1].seq
    assert remote.events(since_seq=last) == [] and len(remote.events(limit=1)) == 1


def test_replica_calls_never_reach_another_namespace(cat: Catalog, url: str) -> None:
    recs = publish(cat, "a", TOKENS)
    keys = [r.blob_key for r in recs]
    publish(cat, "b", [7, 7, 7, 7, 7])
    b_keys = cat.replicas_at("file:///store", namespace="b")
    with RemoteCatalog(url, TOKEN_B, namespace="b") as b:
        assert b.replicas_at("file:///store") == b_keys  # only b's own
        assert b.touch_verified("file:///store", keys) == 0
        assert b.remove_replicas("file:///store", keys, reason="x") == 0
        assert b.events(namespace="b") == cat.events(namespace="b")
        with pytest.raises(LookupError):  # a's namespace does not exist for b's token
            b.replicas_at("file:///store", namespace="a")
        with pytest.raises(LookupError):
            b.events(namespace="a")
        with pytest.raises(LookupError):
            b.mark_replica(keys[0], "file:///store", "corrupt", reason="x")
    assert sorted(cat.replicas_at("file:///store", namespace="a")) == sorted(keys)
