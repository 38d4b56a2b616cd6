"""Tenancy and secrets: namespaces never alias or leak, tokens are hashed and compared in constant time."""

from __future__ import annotations

import hmac
import logging
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

with warnings.catch_warnings():
    # Starlette nudges towards `httpx2`; the project uses httpx, which TestClient still supports.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

import kvc.service.auth
from catalog.catalog import Catalog
from catalog.errors import NotFoundError
from catalog.schema import Chunk, PrefixNode
from chunkstore import ChunkStore, open_store
from kvc.service import create_app, hash_token
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer
from tests.catalog_helpers import CS, FP, publish

TOKEN_A = "tenancy-token-a-2b7e"
TOKEN_B = "tenancy-token-b-9f01"
TOKENS = list(range(500, 510))
MODEL = ReferenceModel.small(seed=0)


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    c.ensure_namespace("a", CS)
    c.ensure_namespace("b", CS)
    yield c
    c.close()


@pytest.fixture
def client(cat: Catalog) -> Iterator[TestClient]:
    app = create_app(
        cat, {"a": hash_token(TOKEN_A), "b": hash_token(TOKEN_B)}, max_prompt_tokens=64
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def shape(msg: str, *secrets: str) -> str:
    for s in secrets:
        msg = msg.replace(s, "<X>")
    return msg


# -- the library -------------------------------------------------------------------


def test_namespace_a_cannot_see_b_through_the_catalog(cat: Catalog) -> None:
    recs_b = publish(cat, "b", TOKENS)
    cat.create_ref("b", "secret-ref", FP, recs_b[-1].prefix_hash)
    assert cat.lookup("a", FP, [*TOKENS, 1]).matched_tokens == 0
    assert cat.list_refs("a") == []
    assert cat.stats("a")["chunks"] == 0

    b_hash = recs_b[0].prefix_hash
    nowhere = b"\x42" * 32
    for call in (cat.get_prefix, cat.lineage):
        with pytest.raises(NotFoundError) as theirs:
            call("a", b_hash)
        with pytest.raises(NotFoundError) as none:
            call("a", nowhere)
        assert shape(str(theirs.value), b_hash.hex()) == shape(str(none.value), nowhere.hex())
    with pytest.raises(NotFoundError) as theirs_ref:
        cat.get_ref("a", "secret-ref")
    with pytest.raises(NotFoundError) as no_ref:
        cat.get_ref("a", "no-such-ref")
    assert shape(str(theirs_ref.value), "secret-ref") == shape(str(no_ref.value), "no-such-ref")
    # B still sees its own.
    assert cat.get_ref("b", "secret-ref").processed == len(TOKENS)


def test_a_cannot_restore_b_s_chunks(cat: Catalog, tmp_path: Path) -> None:
    store: ChunkStore = open_store(f"file://{tmp_path / 'blobs'}")
    pool = PagePool(MODEL.layout, page_size=16, num_pages=16)
    route = pool.new_route()
    toks = np.random.default_rng(7).integers(0, MODEL.vocab_size, 40).tolist()
    MODEL.prefill(pool, route, toks)
    with Checkpointer(cat, store, namespace="b", chunk_size=CS) as cp:
        cp.checkpoint(pool, route, toks, MODEL.fingerprint)
    fresh = PagePool(MODEL.layout, page_size=16, num_pages=16)
    with Restorer(cat, [store], namespace="a") as rs:
        res = rs.restore(fresh, [*toks, 1], MODEL.fingerprint)
    assert res.route is None and res.restored_tokens == 0
    assert fresh.routes() == []
    with Restorer(cat, [store], namespace="b") as rs:
        assert rs.restore(fresh, [*toks, 1], MODEL.fingerprint).restored_tokens == 40


def test_identical_prompts_in_two_namespaces_share_nothing(cat: Catalog) -> None:
    ra = publish(cat, "a", TOKENS)
    rb = publish(cat, "b", TOKENS)
    ha = {r.prefix_hash for r in ra}
    hb = {r.prefix_hash for r in rb}
    assert ha.isdisjoint(hb)
    assert {r.blob_key for r in ra}.isdisjoint({r.blob_key for r in rb})
    with cat.engine.connect() as conn:
        prefixes = conn.execute(sa.select(PrefixNode.prefix_hash, PrefixNode.namespace_id)).all()
        chunks = conn.execute(sa.select(Chunk.prefix_hash)).all()
    assert len(prefixes) == len(ha) + len(hb) == 6
    by_ns: dict[int, set[bytes]] = {}
    for h, ns in prefixes:
        by_ns.setdefault(ns, set()).add(h)
    assert sorted(map(frozenset, by_ns.values()), key=len) == sorted(
        [frozenset(ha), frozenset(hb)], key=len
    )
    assert sorted(h for (h,) in chunks) == sorted(ha | hb)  # one chunk row each, none shared


# -- the service ---------------------------------------------------------------------


def test_a_token_on_b_namespace_is_an_indistinguishable_404(
    client: TestClient, cat: Catalog
) -> None:
    recs_b = publish(cat, "b", TOKENS)
    cat.create_ref("b", "r", FP, recs_b[0].prefix_hash)
    b_hash = recs_b[1].prefix_hash.hex()
    nonexistent = client.get("/v1/namespaces/nope/refs", headers=auth(TOKEN_A))
    assert nonexistent.status_code == 404
    for method, path, body in [
        ("GET", "/v1/namespaces/b/refs", None),
        ("GET", "/v1/namespaces/b/refs/r", None),
        ("GET", "/v1/namespaces/b/stats", None),
        ("GET", f"/v1/namespaces/b/prefixes/{b_hash}/lineage", None),
        ("POST", "/v1/namespaces/b/lookup", {"fingerprint": FP.hex, "tokens": [*TOKENS, 1]}),
        ("POST", "/v1/namespaces/b/quarantine", {"prefix_hash": b_hash, "reason": "x"}),
    ]:
        r = client.request(method, path, json=body, headers=auth(TOKEN_A))
        assert (r.status_code, r.json()) == (404, nonexistent.json()), path
    # B's prefix hash queried through A's own namespace: the same 404 as a hash nobody has.
    theirs = client.get(f"/v1/namespaces/a/prefixes/{b_hash}/lineage", headers=auth(TOKEN_A))
    nobody = client.get(f"/v1/namespaces/a/prefixes/{'42' * 32}/lineage", headers=auth(TOKEN_A))
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json() == nobody.json() == nonexistent.json()
    hit = client.post(
        "/v1/namespaces/a/lookup",
        json={"fingerprint": FP.hex, "tokens": [*TOKENS, 1]},
        headers=auth(TOKEN_A),
    )
    assert hit.status_code == 204
    # Nothing about B changed.
    assert cat.lookup("b", FP, [*TOKENS, 1]).matched_tokens == len(TOKENS)


def test_tokens_are_stored_hashed(client: TestClient) -> None:
    held = client.app.state.token_hashes  # type: ignore[attr-defined]
    assert held == {
        "a": hash_token(TOKEN_A).encode("ascii"),
        "b": hash_token(TOKEN_B).encode("ascii"),
    }
    assert all(TOKEN_A.encode() not in h and TOKEN_B.encode() not in h for h in held.values())
    with pytest.raises(ValueError, match="not a sha256"):
        create_app(Catalog.__new__(Catalog), {"a": TOKEN_A}, max_prompt_tokens=8)


def test_tokens_are_compared_with_hmac_compare_digest(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    assert vars(kvc.service.auth)["hmac"] is hmac  # kvc.service.auth calls hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert client.get("/v1/namespaces/a/refs", headers=auth(TOKEN_A)).status_code == 200
    assert client.get("/v1/namespaces/a/refs", headers=auth("wrong")).status_code == 401
    # Every namespace's hash is compared, for a right and a wrong token alike.
    assert len(calls) == 4
    assert {b for _, b in calls} == {hash_token(TOKEN_A).encode(), hash_token(TOKEN_B).encode()}
    assert all(TOKEN_A.encode() not in a for a, _ in calls)


def test_a_bearer_token_is_never_logged(
    client: TestClient, cat: Catalog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    publish(cat, "a", TOKENS)
    client.post(
        "/v1/namespaces/a/lookup",
        json={"fingerprint": FP.hex, "tokens": [*TOKENS, 1]},
        headers=auth(TOKEN_A),
    )
    client.get("/v1/namespaces/b/refs", headers=auth(TOKEN_A))
    client.get("/v1/namespaces/a/refs", headers=auth(TOKEN_A + "x"))
    client.post("/v1/namespaces/a/chunks", json={"records": "x"}, headers=auth(TOKEN_A))
    assert caplog.records
    for secret in (TOKEN_A, hash_token(TOKEN_A), hash_token(TOKEN_A + "x")):
        assert secret not in caplog.text


# -- secrets through the CLI ---------------------------------------------------------------

KVC = str(Path(sys.executable).parent / "kvc")


def run_kvc(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVC, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": str(Path(sys.executable).parent),
            "HOME": str(cwd),
            "KVC_CONFIG": str(cwd / "none.toml"),
        },
    )


def test_secrets_never_reach_cli_output(tmp_path: Path) -> None:
    assert run_kvc(["init", "--home", str(tmp_path / "home")], tmp_path).returncode == 0
    home = ["--home", str(tmp_path / "home")]
    cases = [
        ["db", "current", "--catalog", "postgresql+psycopg://u:s3cr3t-pw@127.0.0.1:1/x", "--json"],
        ["db", "current", "--catalog", "postgresql+psycopg://u:s3cr3t-pw@127.0.0.1:1/x"],
        ["fsck", *home, "--store", "s3://AKIAXXXX:s3cr3t@bucket/p", "--json"],
        ["fsck", *home, "--store", "s3://bucket/p?endpoint_url=http://AK:s3cr3t@h:1", "--json"],
        ["fsck", *home, "--store", "file://AK:s3cr3t@host/p", "--json"],
        ["stats", *home, "--catalog", "postgresql://AKIA:s3cr3t@127.0.0.1:1/db", "--json"],
    ]
    for args in cases:
        r = run_kvc(args, tmp_path)
        assert r.returncode != 0, args
        assert "s3cr3t" not in r.stdout and "s3cr3t" not in r.stderr, (args, r.stdout, r.stderr)
        assert r.stderr.strip()  # a message, without the secret
    # A command that never opens the store does not echo it either.
    r = run_kvc(["stats", *home, "--store", "s3://AKIAXXXX:s3cr3t@bucket/p", "--json"], tmp_path)
    assert "s3cr3t" not in r.stdout + r.stderr
