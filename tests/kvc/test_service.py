"""The HTTP service: auth and tenancy, status codes, publish and lookup, refs, quarantine, metrics."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

with warnings.catch_warnings():
    # Starlette nudges towards `httpx2`; the project uses httpx, which TestClient still supports.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

from catalog.catalog import Catalog
from catalog.remote import RemoteCatalog
from catalog.schema import Replica
from catalog.wire import ChunkRecordModel
from kvc.service import create_app, hash_token
from tests.catalog_helpers import CS, FP, chain_records, kill_gc_after_marking, publish
from tests.services import serve_in_thread

TOKEN_A = "token-for-namespace-a-7f3c"
TOKEN_B = "token-for-namespace-b-91d2"
MAX_PROMPT = 64
TOKENS = list(range(100, 110))  # 2 full chunks of 4 and a tail of 2


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace("a", CS)
    c.ensure_namespace("b", CS)
    yield c
    c.close()


@pytest.fixture
def client(cat: Catalog) -> Iterator[TestClient]:
    tokens = {"a": hash_token(TOKEN_A), "b": hash_token(TOKEN_B), "empty": hash_token("e")}
    app = create_app(cat, tokens, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def auth(token: str = TOKEN_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def metrics(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def lookup_body(tokens: list[int] = TOKENS, **kw: Any) -> dict[str, Any]:
    return {"fingerprint": FP.hex, "tokens": tokens, **kw}


def publish_body(namespace: str = "a", tokens: list[int] = TOKENS) -> dict[str, Any]:
    recs = chain_records(namespace, tokens)
    return {
        "fingerprints": {FP.hex: dict(FP.descriptor)},
        "records": [ChunkRecordModel.of(r).model_dump(mode="json") for r in recs],
    }


def test_healthz_needs_no_token(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_publish_then_lookup_hits_with_the_plan(client: TestClient, cat: Catalog) -> None:
    r = client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    assert r.status_code == 200, r.text
    assert r.json()["recorded"] == 3
    again = client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    assert again.json()["recorded"] == 0 and again.json()["already_present"] == 3

    r = client.post("/v1/namespaces/a/lookup", json=lookup_body([*TOKENS, 7]), headers=auth())
    assert r.status_code == 200
    plan = r.json()
    assert plan["matched_tokens"] == 10
    assert [c["token_start"] for c in plan["chunks"]] == [0, 4, 8]
    assert [c["tokens_used"] for c in plan["chunks"]] == [4, 4, 2]
    first = plan["chunks"][0]
    assert len(first["prefix_hash"]) == 64 and len(first["blob_key"]) == 64
    assert first["replicas"][0]["state"] == "durable"
    # The same plan the catalog gives in-process.
    local = cat.lookup("a", FP, [*TOKENS, 7])
    assert [c["blob_key"] for c in plan["chunks"]] == [c.blob_key for c in local.chunks]


def test_lookup_miss_is_204(client: TestClient) -> None:
    r = client.post("/v1/namespaces/a/lookup", json=lookup_body(), headers=auth())
    assert r.status_code == 204 and r.content == b""


def test_metrics_count_lookups_hits_tokens_and_publishes(client: TestClient) -> None:
    before = metrics(client)
    client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    client.post("/v1/namespaces/a/lookup", json=lookup_body([*TOKENS, 7]), headers=auth())
    client.post("/v1/namespaces/a/lookup", json=lookup_body([1, 2, 3]), headers=auth())
    after = metrics(client)
    assert after["kvc_publish_chunks_total"] - before["kvc_publish_chunks_total"] == 3
    assert after["kvc_lookups_total"] - before["kvc_lookups_total"] == 2
    assert after["kvc_lookup_hits_total"] - before["kvc_lookup_hits_total"] == 1
    assert after["kvc_restorable_tokens_total"] - before["kvc_restorable_tokens_total"] == 10
    assert "# TYPE kvc_errors_total counter" in client.get("/metrics").text


def test_unexpected_error_is_a_bare_500_and_counted(
    client: TestClient, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("secret internals /etc/db-password")

    monkeypatch.setattr(cat, "stats", boom)
    before = metrics(client)["kvc_errors_total"]
    r = client.get("/v1/namespaces/a/stats", headers=auth())
    assert r.status_code == 500
    assert r.json() == {"detail": "internal error"}
    assert metrics(client)["kvc_errors_total"] == before + 1


def test_missing_token_is_401(client: TestClient) -> None:
    r = client.get("/v1/namespaces/a/stats")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/namespaces/a/stats", headers=auth("wrong")).status_code == 401


def test_another_namespace_or_unknown_namespace_looks_like_nothing_there(
    client: TestClient,
) -> None:
    client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    real_miss = client.get("/v1/namespaces/a/refs/no-such-ref", headers=auth())
    other = client.get("/v1/namespaces/b/refs/no-such-ref", headers=auth())
    unknown = client.get("/v1/namespaces/zzz/refs/no-such-ref", headers=auth())
    other_lookup = client.post("/v1/namespaces/b/lookup", json=lookup_body(), headers=auth())
    assert real_miss.status_code == other.status_code == unknown.status_code == 404
    assert other_lookup.status_code == 404
    assert real_miss.json() == other.json() == unknown.json() == other_lookup.json()
    # B's token sees none of A's data.
    r = client.post(
        "/v1/namespaces/a/lookup", json=lookup_body([*TOKENS, 7]), headers=auth(TOKEN_B)
    )
    assert r.status_code == 404 and r.json() == real_miss.json()


def test_replicas_of_another_namespace_cannot_be_marked(client: TestClient) -> None:
    body = publish_body()
    client.post("/v1/namespaces/a/chunks", json=body, headers=auth())
    key = body["records"][0]["blob_key"]
    mark = {"blob_key": key, "location": "file:///store", "state": "corrupt", "reason": "x"}
    r = client.post("/v1/namespaces/b/replicas/mark", json=mark, headers=auth(TOKEN_B))
    assert r.status_code == 404
    r = client.post("/v1/namespaces/a/replicas/mark", json=mark, headers=auth())
    assert r.status_code == 200 and r.json() == {"changed": True}
    hit = client.post("/v1/namespaces/a/lookup", json=lookup_body([*TOKENS, 7]), headers=auth())
    assert hit.status_code == 204  # the corrupt first chunk breaks the chain


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"fingerprint": FP.hex}, "tokens"),
        ({"fingerprint": FP.hex, "tokens": [1, -2, 3]}, "tokens"),
        ({"fingerprint": "not-hex", "tokens": [1, 2]}, "fingerprint"),
        ({"fingerprint": FP.hex.upper(), "tokens": [1, 2]}, "fingerprint"),
        ({"fingerprint": FP.hex, "tokens": [1, 2], "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    r = client.post("/v1/namespaces/a/lookup", json=body, headers=auth())
    assert r.status_code == 422
    assert any(field in e["loc"] for e in r.json()["detail"])


def test_inconsistent_publish_is_422_with_the_catalog_message(client: TestClient) -> None:
    body = publish_body()
    body["records"] = body["records"][1:]  # parent not catalogued
    r = client.post("/v1/namespaces/a/chunks", json=body, headers=auth())
    assert r.status_code == 422
    assert r.json()["error"] == "MissingParentError"
    assert "parent" in r.json()["detail"]


def test_prompt_over_the_limit_is_refused(client: TestClient) -> None:
    r = client.post(
        "/v1/namespaces/a/lookup", json=lookup_body(list(range(MAX_PROMPT + 1))), headers=auth()
    )
    assert r.status_code == 413
    assert f"limit of {MAX_PROMPT} tokens" in r.json()["detail"]


def test_refs_create_get_cas_conflict_fork_delete(client: TestClient, cat: Catalog) -> None:
    recs = publish(cat, "a", TOKENS)
    h1, h2 = recs[0].prefix_hash.hex(), recs[1].prefix_hash.hex()
    base = "/v1/namespaces/a/refs"
    r = client.put(f"{base}/chat/1", json={"fingerprint": FP.hex, "head_hash": h1}, headers=auth())
    assert r.status_code == 201 and r.json()["processed"] == 4
    assert client.get(f"{base}/chat/1", headers=auth()).json()["head_hash"] == h1
    dup = client.put(
        f"{base}/chat/1", json={"fingerprint": FP.hex, "head_hash": h1}, headers=auth()
    )
    assert dup.status_code == 409

    r = client.post(
        f"{base}/chat/1/cas", json={"expected_head": h1, "new_head": h2}, headers=auth()
    )
    assert r.status_code == 200 and r.json()["processed"] == 8
    stale = client.post(
        f"{base}/chat/1/cas", json={"expected_head": h1, "new_head": h2}, headers=auth()
    )
    assert stale.status_code == 409 and "moved" in stale.json()["detail"]

    fork = client.post(f"{base}/chat/1/fork", json={"name": "side"}, headers=auth())
    assert fork.status_code == 201 and fork.json()["forked_from"] == "chat/1"
    names = [x["name"] for x in client.get(base, headers=auth()).json()["refs"]]
    assert names == ["chat/1", "side"]
    assert client.delete(f"{base}/side", headers=auth()).status_code == 204
    assert client.get(f"{base}/side", headers=auth()).status_code == 404
    assert cat.get_ref("a", "chat/1").head_hash.hex() == h2


def test_ref_onto_a_chunk_gc_is_purging_is_409_and_retryable(
    client: TestClient, cat: Catalog
) -> None:
    from datetime import UTC, datetime, timedelta

    from catalog.errors import PurgeInProgressError
    from catalog.gc import plan_gc

    recs = publish(cat, "a", TOKENS)
    plan = plan_gc(cat, "a", max_age_s=0, max_bytes=None, now=datetime.now(UTC) + timedelta(days=1))
    kill_gc_after_marking(cat, plan)
    head = recs[0].prefix_hash.hex()
    r = client.put(
        "/v1/namespaces/a/refs/r", json={"fingerprint": FP.hex, "head_hash": head}, headers=auth()
    )
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "PurgeInProgressError" and r.headers["retry-after"] == "1"
    with (
        serve_in_thread(client.app) as url,
        RemoteCatalog(url, TOKEN_A, namespace="a") as remote,
        pytest.raises(PurgeInProgressError),
    ):
        remote.create_ref("a", "r", FP, recs[0].prefix_hash)
    assert cat.list_refs("a") == []


def test_lineage_quarantine_and_stats(client: TestClient, cat: Catalog) -> None:
    recs = publish(cat, "a", TOKENS)
    tail = recs[-1].prefix_hash.hex()
    r = client.get(f"/v1/namespaces/a/prefixes/{tail}/lineage", headers=auth())
    assert r.status_code == 200
    assert [p["token_start"] for p in r.json()["prefixes"]] == [0, 4, 8]

    stats = client.get("/v1/namespaces/a/stats", headers=auth()).json()
    assert stats["chunks"] == 3 and stats["namespace"] == "a"

    mid = recs[1].prefix_hash.hex()
    r = client.post(
        "/v1/namespaces/a/quarantine", json={"prefix_hash": mid, "reason": "bad"}, headers=auth()
    )
    assert r.status_code == 200
    directives = r.json()["directives"]
    assert {d["prefix_hash"] for d in directives} == {mid, tail}
    hit = client.post("/v1/namespaces/a/lookup", json=lookup_body([*TOKENS, 7]), headers=auth())
    assert hit.json()["matched_tokens"] == 4
    blank = client.post(
        "/v1/namespaces/a/quarantine", json={"prefix_hash": mid, "reason": "  "}, headers=auth()
    )
    assert blank.status_code == 422


def test_namespace_endpoint_creates_and_reports_chunk_size(client: TestClient) -> None:
    r = client.get("/v1/namespaces/empty/namespace", headers=auth("e"))
    assert r.json() == {"chunk_size": None}
    r = client.post("/v1/namespaces/empty/namespace", json={"chunk_size": 8}, headers=auth("e"))
    assert r.json() == {"chunk_size": 8}
    r = client.post("/v1/namespaces/empty/namespace", json={"chunk_size": 16}, headers=auth("e"))
    assert r.json() == {"chunk_size": 8}  # fixed at creation


@pytest.mark.parametrize("chunk_size", [1, 3, 65537])
def test_a_chunk_size_out_of_bounds_is_422_naming_the_bound(
    client: TestClient, chunk_size: int
) -> None:
    url = "/v1/namespaces/empty/namespace"
    r = client.post(url, json={"chunk_size": chunk_size}, headers=auth("e"))
    assert r.status_code == 422
    bound = "4" if chunk_size < 4 else "65536"
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "chunk_size"]]
    assert bound in r.json()["detail"][0]["msg"]
    assert client.get(url, headers=auth("e")).json() == {"chunk_size": None}


def test_openapi_is_served(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "/v1/namespaces/{namespace}/lookup" in doc["paths"]


def test_token_never_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    client.post("/v1/namespaces/a/lookup", json=lookup_body(), headers=auth())
    client.get("/v1/namespaces/b/stats", headers=auth())
    client.get("/v1/namespaces/a/stats", headers=auth("not-" + TOKEN_A))
    client.post("/v1/namespaces/a/lookup", json={"tokens": "x"}, headers=auth())
    assert caplog.records  # something was logged at DEBUG, and
    assert TOKEN_A not in caplog.text and hash_token(TOKEN_A) not in caplog.text


def test_remote_catalog_maps_errors_back(client: TestClient, cat: Catalog) -> None:
    from catalog.errors import NotFoundError, PublishError, RefConflictError

    recs = publish(cat, "a", TOKENS)
    # A real server: the TestClient's transport belongs to whichever httpx it found
    # (httpx2 when huggingface_hub installed it), not to the httpx RemoteCatalog uses.
    with serve_in_thread(client.app) as url, RemoteCatalog(url, TOKEN_A, namespace="a") as remote:
        with pytest.raises(NotFoundError):
            remote.get_ref("a", "nope")
        with pytest.raises(NotFoundError):
            remote.get_ref("b", "nope")
        remote.create_ref("a", "r.../x", FP, recs[0].prefix_hash)
        assert remote.get_ref("a", "r.../x").processed == 4
        with pytest.raises(RefConflictError):
            remote.update_ref(
                "a", "r.../x", expected_head=recs[1].prefix_hash, new_head=recs[2].prefix_hash
            )
        with pytest.raises(PublishError):
            remote.record_chunks(chain_records("a", [*TOKENS, 1, 2, 3], start_chunk=3))
        assert remote.get_fingerprint(FP.hex) == FP
        m = remote.lookup("a", FP, [*TOKENS, 7])
        assert m == cat.lookup("a", FP, [*TOKENS, 7])
        assert remote.lookup("a", FP, [9, 9, 9]).hit is False
        assert remote.stats("a")["chunks"] == 3


# -- found by tests/kvc/test_service_fuzz.py ------------------------------------------


def test_without_a_token_the_body_is_not_read(client: TestClient, cat: Catalog) -> None:
    """401 before anything else: FastAPI parses a body before the token's dependency runs."""
    broken = {"content": b'{"tokens": [1, 2,', "headers": {"Content-Type": "application/json"}}
    for token in (None, "not-a-token"):
        headers = {**broken["headers"], **(auth(token) if token else {})}
        r = client.post("/v1/namespaces/a/lookup", content=broken["content"], headers=headers)
        assert r.status_code == 401, r.text  # was 422 with the body's JSON error
        assert r.headers["www-authenticate"] == "Bearer" and "tokens" not in r.text
    r = client.post("/v1/namespaces/a/chunks", content=b"\xff\xfe", headers=broken["headers"])
    assert r.status_code == 401  # was 400
    assert client.get("/v1/namespaces/a/no-such-route").status_code == 401
    # With a token the body is read: broken JSON is a 400 (docs/http-api.md).
    r = client.post("/v1/namespaces/a/lookup", content=broken["content"], headers={**broken["headers"], **auth()})
    assert r.status_code == 400 and r.json()["detail"].startswith("the body is not valid JSON")


def test_the_document_declares_every_refusal(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    lookup = paths["/v1/namespaces/{namespace}/lookup"]["post"]["responses"]
    assert set(lookup) == {"200", "204", "400", "401", "404", "413", "422"}
    assert "409" in paths["/v1/namespaces/{namespace}/refs/{name}"]["put"]["responses"]
    stats = paths["/v1/namespaces/{namespace}/stats"]["get"]["responses"]
    assert set(stats) == {"200", "401", "404", "422"}
    assert lookup["401"]["headers"]["WWW-Authenticate"]["required"] is True


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[TestClient, Catalog]]:
    """A client over a SQLite or a PostgreSQL catalog holding one chain of namespace a."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    c = Catalog.open(url, upgrade=True)
    c.ensure_namespace("a", CS)
    publish(c, "a", TOKENS)
    app = create_app(c, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=MAX_PROMPT)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, c
    c.close()


def _receipt(**kw: Any) -> dict[str, Any]:
    good = {"location": "file:///s", "tier": "local", "size": 100, "checksum": "c"}
    return {**good, "stored_at": "2024-01-01T00:00:00Z", **kw}


KEY = chain_records("a", TOKENS)[0].blob_key
HEAD = chain_records("a", TOKENS)[0].prefix_hash.hex()
NEW = ChunkRecordModel.of(chain_records("a", [7, 8, 9, 10])[0]).model_dump(mode="json")

# (method, path, body, the field the 422 must name). Each was a 500 on PostgreSQL
# (VARCHAR lengths, NUL characters, BIGINT range); on SQLite the integers past 2**63
# and the times that leave the year range in UTC were 500s too, the rest stored as given.
UNSTORABLE = [
    ("POST", "replicas", {"blob_key": KEY, "receipt": _receipt(etag="e" * 256)}, "etag"),
    ("POST", "replicas", {"blob_key": KEY, "receipt": _receipt(checksum="c" * 256)}, "checksum"),
    ("POST", "replicas", {"blob_key": KEY, "receipt": _receipt(location="x" * 40)}, "location"),
    ("POST", "replicas", {"blob_key": KEY, "receipt": _receipt(location="f:a\x00")}, "location"),
    ("POST", "replicas", {"blob_key": KEY, "receipt": _receipt(size=2**63)}, "size"),
    (
        "POST",
        "replicas",
        {"blob_key": KEY, "receipt": _receipt(stored_at="0001-01-01T00:00:00+01:00")},
        "stored_at",
    ),
    (
        "POST",
        "replicas",
        {"blob_key": KEY, "receipt": _receipt(stored_at="9999-12-31T23:59:59-01:00")},
        "stored_at",
    ),
    ("POST", "chunks", {"records": [{**NEW, "codec": "c" * 33}]}, "codec"),
    ("POST", "chunks", {"records": [{**NEW, "kv_bytes": 2**63}]}, "kv_bytes"),
    ("POST", "quarantine", {"prefix_hash": HEAD, "reason": "bad\x00"}, "reason"),
    (
        "POST",
        "replicas/mark",
        {
            "blob_key": KEY,
            "location": "file:///s",
            "state": "corrupt",
            "reason": "r",
            "actor": "\x00",
        },
        "actor",
    ),
    (
        "PUT",
        "refs/r",
        {"fingerprint": FP.hex, "head_hash": HEAD, "forked_from": "\x00"},
        "forked_from",
    ),
    ("GET", "refs/a%00b", None, "name"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), UNSTORABLE)
def test_what_the_catalog_cannot_store_is_422_naming_the_field(
    any_backend: tuple[TestClient, Catalog],
    method: str,
    path: str,
    body: dict[str, Any] | None,
    field: str,
) -> None:
    client, cat = any_backend
    before = cat.stats("a")
    r = client.request(method, f"/v1/namespaces/a/{path}", json=body, headers=auth())
    assert r.status_code == 422, r.text
    assert any(e["loc"][-1] == field for e in r.json()["detail"]), r.text
    assert cat.stats("a") == before


def test_the_largest_storable_values_are_stored(any_backend: tuple[TestClient, Catalog]) -> None:
    client, cat = any_backend
    receipt = _receipt(size=2**63 - 1, stored_at="2024-01-01T05:30:00+05:30", etag="e" * 255)
    r = client.post(
        "/v1/namespaces/a/replicas", json={"blob_key": KEY, "receipt": receipt}, headers=auth()
    )
    assert r.status_code == 200 and r.json() == {"added": True}
    with cat.engine.connect() as conn:
        size, stored_at = conn.execute(
            sa.select(Replica.size, Replica.stored_at).where(Replica.location == "file:///s")
        ).one()
    assert size == 2**63 - 1 and stored_at == datetime(2024, 1, 1, tzinfo=UTC)


# -- metrics and health ----------------------------------------------------------------


def test_two_apps_in_one_process_count_apart(client: TestClient, cat: Catalog) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST

    other = create_app(cat, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=MAX_PROMPT)
    with TestClient(other) as second:
        second.post("/v1/namespaces/a/lookup", json=lookup_body(), headers=auth())
        assert metrics(second)["kvc_lookups_total"] == 1
    assert metrics(client)["kvc_lookups_total"] == 0
    r = client.get("/metrics")
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST  # Prometheus text format
    assert "# HELP kvc_publish_chunks_total Chunks newly recorded by publishes." in r.text


def test_healthz_is_503_when_the_catalog_does_not_answer(
    client: TestClient, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down() -> None:
        raise ConnectionRefusedError("db-password-in-a-message")

    monkeypatch.setattr(cat, "ping", down)
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json() == {"detail": "catalog unavailable"}


def test_the_catalogs_unavailability_is_503_with_retry_after(
    client: TestClient, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    from catalog.errors import CatalogUnavailableError

    def down(*a: object, **k: object) -> None:
        raise CatalogUnavailableError("the database is restarting")

    monkeypatch.setattr(cat, "list_refs", down)
    r = client.get("/v1/namespaces/a/refs", headers=auth())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == "CatalogUnavailableError"
    assert metrics(client)["kvc_catalog_unavailable_total"] == 1


def test_a_body_that_is_not_json_is_400_and_json_that_fails_validation_is_422(
    client: TestClient,
) -> None:
    url = "/v1/namespaces/a/lookup"
    bad_json = client.post(
        url, content=b"not json{", headers={**auth(), "content-type": "application/json"}
    )
    assert bad_json.status_code == 400
    assert bad_json.json()["detail"].startswith("the body is not valid JSON")
    plain = client.post(url, content=b"tokens=1,2", headers={**auth(), "content-type": "text/plain"})
    assert plain.status_code == 400 and "send JSON" in plain.json()["detail"]
    # Sent in chunks (no Content-Length), still not JSON: 400, and the body is not echoed.
    chunked = client.post(
        url, content=iter([b"secret=", b"1"]), headers={**auth(), "content-type": "text/plain"}
    )
    assert chunked.status_code == 400 and "secret" not in chunked.text
    invalid = client.post(url, json={"tokens": "x"}, headers=auth())
    assert invalid.status_code == 422
    assert any(e["loc"] == ["body", "fingerprint"] for e in invalid.json()["detail"])
    # Another JSON media type is read as JSON: its validation is a 422 too, not a 400.
    merge = client.post(
        url,
        content=b'{"tokens": "x"}',
        headers={**auth(), "content-type": "application/merge-patch+json"},
    )
    assert merge.status_code == 422
    assert any(e["loc"] == ["body", "fingerprint"] for e in merge.json()["detail"])
    # No body where one is required is a validation error (the field `body` is missing).
    empty = client.post(url, content=b"", headers={**auth(), "content-type": "application/json"})
    assert empty.status_code == 422 and empty.json()["detail"][0]["loc"] == ["body"]
    # A query parameter that fails validation is a 422 naming it.
    bad_query = client.get("/v1/namespaces/a/events?limit=many", headers=auth())
    assert bad_query.status_code == 422
    assert bad_query.json()["detail"][0]["loc"] == ["query", "limit"]


def test_every_route_with_a_body_declares_400_and_413(client: TestClient) -> None:
    """Any body may be unreadable (400) or over the byte limit (413): the document says so."""
    paths = client.get("/openapi.json").json()["paths"]
    with_body = [
        (path, method, op["responses"])
        for path, ops in paths.items()
        for method, op in ops.items()
        if "requestBody" in op
    ]
    assert len(with_body) > 10
    for path, method, responses in with_body:
        assert {"400", "413", "422"} <= set(responses), (method, path)


def test_a_catalog_that_is_down_answers_503_without_its_url_or_the_drivers_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "catalog-home"
    home.mkdir()
    down = Catalog.open(f"sqlite:///{home / 'catalog.db'}", upgrade=True)
    down.ensure_namespace("a", CS)
    app = create_app(down, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=MAX_PROMPT)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            # The database's directory goes away: every new connection fails to open it.
            home.rename(tmp_path / "gone")
            down.db.engine.dispose()
            with caplog.at_level(logging.WARNING, logger="kvc.service.app"):
                r = client.post("/v1/namespaces/a/lookup", json=lookup_body(), headers=auth())
                r_stats = client.get("/v1/namespaces/a/stats", headers=auth())
    finally:
        down.close()
    for answer in (r, r_stats):
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json() == {
            "detail": "catalog unavailable",
            "error": "CatalogUnavailableError",
        }
        assert "catalog-home" not in answer.text and "sqlite" not in answer.text
        assert "unable to open" not in answer.text
    # The operator still learns which database and what the driver said.
    logged = caplog.text
    assert "catalog-home" in logged and "unable to open database file" in logged


def test_an_outcome_unknown_answers_504_without_the_catalogs_url(
    client: TestClient,
    cat: Catalog,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from catalog.errors import OutcomeUnknownError

    def lost(*a: object, **k: object) -> None:
        raise OutcomeUnknownError(f"catalog {cat.url}: the connection was lost while committing")

    monkeypatch.setattr(cat, "record_chunks", lost)
    with caplog.at_level(logging.WARNING, logger="kvc.service.app"):
        r = client.post("/v1/namespaces/a/chunks", json=publish_body(), headers=auth())
    assert r.status_code == 504 and r.json()["error"] == "OutcomeUnknownError"
    assert cat.url not in r.text and "may or may not have landed" in r.json()["detail"]
    assert cat.url in caplog.text


# -- body caps derived from the token limit, and parsing off the event loop (issue 25) --------


def _asgi_post(app: Any, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, int]:
    """POST `chunks` to `app` over raw ASGI: (status, body messages the app read)."""
    import anyio

    read = 0
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    anyio.run(app, scope, receive, send)
    return status, read


def test_a_lookup_over_the_token_limits_byte_size_is_413_unread(cat: Catalog) -> None:
    from kvc.service.limits import LOOKUP_ENVELOPE, TOKEN_BYTES

    limit = 100_000
    app = create_app(cat, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=limit)
    cap = LOOKUP_ENVELOPE + limit * TOKEN_BYTES  # about 1.2 MB, not the 64 MiB of any call
    assert cap < 2 << 20
    url = "/v1/namespaces/a/lookup"
    headers = {**auth(), "content-type": "application/json"}
    # 60 MiB announced: refused before one byte of it is read.
    status, read = _asgi_post(app, url, {**headers, "content-length": str(60 << 20)}, [b"x"])
    assert (status, read) == (413, 0)
    # The same 60 MiB streamed (no Content-Length): refused once past the cap, not at its end.
    piece = b" " * (64 << 10)
    status, read = _asgi_post(app, url, headers, [piece] * (60 << 4))
    assert status == 413 and read * len(piece) <= cap + len(piece)
    # The largest lookup the token limit allows (every id 10 digits) is still parsed.
    body = json.dumps(lookup_body([4_294_967_295] * limit, shard=None)).encode()
    status, _ = _asgi_post(app, url, {**headers, "content-length": str(len(body))}, [body])
    assert status == 204


def test_metrics_answer_while_a_big_lookup_body_is_parsed(
    cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    app = create_app(cat, {"a": hash_token(TOKEN_A)}, max_prompt_tokens=200_000)
    body = json.dumps(lookup_body(list(range(200_000)))).encode()
    parsing, release = threading.Event(), threading.Event()
    real_loads = json.loads

    def held_loads(s: Any, *a: Any, **k: Any) -> Any:
        # Holds the parse of this one body (wherever the service parses it) until released.
        if isinstance(s, bytes | bytearray) and s == body:
            parsing.set()
            release.wait(60)
        return real_loads(s, *a, **k)

    monkeypatch.setattr(json, "loads", held_loads)
    answers: dict[str, Any] = {}
    with TestClient(app, raise_server_exceptions=False) as client:

        def big_lookup() -> None:
            answers["lookup"] = client.post(
                "/v1/namespaces/a/lookup",
                content=body,
                headers={**auth(), "content-type": "application/json"},
            )

        def scrape() -> None:
            answers["metrics"] = client.get("/metrics")

        poster = threading.Thread(target=big_lookup)
        poster.start()
        try:
            assert parsing.wait(30), "the lookup's body was never parsed"
            scraper = threading.Thread(target=scrape)
            scraper.start()
            # While the parse is held, the event loop still answers: the parse is elsewhere.
            scraper.join(20)
            metrics_answered = not scraper.is_alive()
        finally:
            release.set()
            poster.join(60)
    assert metrics_answered, "/metrics waited for a body being parsed on the event loop"
    assert answers["metrics"].status_code == 200
    assert answers["lookup"].status_code == 204
