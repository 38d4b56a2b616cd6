"""Hostile input: fuzzed HTTP bodies and paths, bad library calls, store URLs and settings.

Every refusal is a clear, typed error, and a refused call changes nothing stored.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

with warnings.catch_warnings():
    # Starlette nudges towards `httpx2`; the project uses httpx, which TestClient still supports.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

from catalog.catalog import Catalog
from catalog.errors import CatalogError, IdentityError
from catalog.identity import chain_root
from catalog.models import Shard
from catalog.wire import ChunkRecordModel
from chunkstore import ChunkStore, open_store
from chunkstore.errors import StoreURLError
from chunkstore.record import encode_chunk
from kvc.service import create_app, hash_token
from kvc.settings import Settings
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.errors import RestoreError
from restore.pool import PagePool
from restore.restore import Restorer
from tests.catalog_helpers import CS, FP, LAYOUT, chain_records

TOKEN_A = "hostile-token-a-5e1f"
TOKEN_B = "hostile-token-b-0c2d"
MAX_PROMPT = 64
TOKENS = list(range(200, 210))
TABLES = ("namespaces", "fingerprints", "prefixes", "chunks", "replicas", "refs", "events")
FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# -- helpers -------------------------------------------------------------------


def row_counts(cat: Catalog) -> dict[str, int]:
    with cat.engine.connect() as conn:
        return {
            t: int(conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in TABLES
        }


def snapshot(cat: Catalog, store: ChunkStore | None = None) -> tuple[dict[str, int], list[str]]:
    return row_counts(cat), sorted(store.keys()) if store is not None else []


# -- the service under fuzzing ---------------------------------------------------


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TestClient, dict[str, Any]]]:
    cat = Catalog.open(f"sqlite:///{tmp_path_factory.mktemp('svc') / 'catalog.db'}", upgrade=True)
    cat.ensure_namespace("a", CS)
    cat.ensure_namespace("b", CS)
    recs = chain_records("a", TOKENS)
    cat.record_chunks(recs)
    tokens = {"a": hash_token(TOKEN_A), "b": hash_token(TOKEN_B)}
    app = create_app(cat, tokens, max_prompt_tokens=MAX_PROMPT)
    shard = {
        "layer_lo": 0,
        "layer_hi": LAYOUT.num_layers,
        "head_lo": 0,
        "head_hi": LAYOUT.num_kv_heads,
    }
    h = [r.prefix_hash.hex() for r in recs]
    other = chain_records("a", list(range(300, 309)))
    valid: dict[str, Any] = {
        "lookup": {"fingerprint": FP.hex, "tokens": [*TOKENS, 7], "shard": shard, "max_tokens": 5},
        "chunks": {
            "fingerprints": {FP.hex: dict(FP.descriptor)},
            "records": [ChunkRecordModel.of(r).model_dump(mode="json") for r in other],
            "actor": "fuzz",
        },
        "ref": {"fingerprint": FP.hex, "head_hash": h[0], "pending_token": 3, "forked_from": "x"},
        "cas": {"expected_head": h[0], "new_head": h[1], "pending_token": 1},
        "fork": {"name": "forked", "actor": None},
        "quarantine": {"prefix_hash": h[2], "reason": "fuzz"},
        "mark": {
            "blob_key": recs[0].blob_key,
            "location": "file:///store",
            "state": "corrupt",
            "reason": "fuzz",
        },
        "known": {"fingerprint": FP.hex, "prefix_hashes": h, "shard": shard},
        "hashes": h,
    }
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, valid
    cat.close()


_HEX = st.text(alphabet="0123456789abcdefABCDEFxg", min_size=0, max_size=70)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**200),
    st.integers(min_value=-(2**200), max_value=-1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "-0", "1e999", "", " ", "../../etc/passwd"]),
    _HEX,
)
HOSTILE = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
SEGMENT = st.one_of(
    st.text(min_size=1, max_size=40),
    _HEX.filter(bool),
    st.sampled_from(["..", ".", "%2e%2e", "a/../b", "%00", "a" * 300]),
)


def mutate(value: Any, draw: Callable[[Any], Any]) -> Any:
    """`value` with one field somewhere replaced by a hostile one (or the whole thing)."""
    if not isinstance(value, dict | list) or not value or draw(st.integers(0, 3)) == 0:
        return draw(HOSTILE)
    if isinstance(value, dict):
        key = draw(st.sampled_from(sorted(value)))
        out = dict(value)
        if draw(st.booleans()):
            out[key] = mutate(value[key], draw)
        else:
            out[draw(st.text(max_size=8))] = draw(HOSTILE)  # an unknown field
        return out
    i = draw(st.integers(0, len(value) - 1))
    items = list(value)
    items[i] = mutate(value[i], draw)
    return items


def seg(s: str) -> str:
    return urllib.parse.quote(s, safe="")


# (method, path builder over a fuzzed segment, key of the valid body or None)
ENDPOINTS: list[tuple[str, Callable[[str], str], str | None]] = [
    ("POST", lambda s: "/v1/namespaces/a/lookup", "lookup"),
    ("POST", lambda s: f"/v1/namespaces/{s}/lookup", "lookup"),
    ("POST", lambda s: "/v1/namespaces/a/chunks", "chunks"),
    ("PUT", lambda s: f"/v1/namespaces/a/refs/{s}", "ref"),
    ("POST", lambda s: f"/v1/namespaces/a/refs/{s}/cas", "cas"),
    ("POST", lambda s: f"/v1/namespaces/a/refs/{s}/fork", "fork"),
    ("DELETE", lambda s: f"/v1/namespaces/a/refs/{s}", None),
    ("GET", lambda s: f"/v1/namespaces/a/refs/{s}", None),
    ("GET", lambda s: f"/v1/namespaces/a/prefixes/{s}/lineage", None),
    ("POST", lambda s: "/v1/namespaces/a/quarantine", "quarantine"),
    ("POST", lambda s: "/v1/namespaces/a/replicas/mark", "mark"),
    ("POST", lambda s: "/v1/namespaces/a/known", "known"),
]


@pytest.mark.parametrize(
    ("method", "path", "body_key"),
    ENDPOINTS,
    ids=[f"{m} {k or i}" for i, (m, _, k) in enumerate(ENDPOINTS)],
)
@FUZZ
@given(data=st.data())
def test_fuzzed_requests_never_500(
    service: tuple[TestClient, dict[str, Any]],
    method: str,
    path: Callable[[str], str],
    body_key: str | None,
    data: st.DataObject,
) -> None:
    client, valid = service
    url = path(seg(data.draw(SEGMENT)))
    content: bytes | None = None
    if body_key is not None:
        body = (
            data.draw(HOSTILE) if data.draw(st.booleans()) else mutate(valid[body_key], data.draw)
        )
        content = json.dumps(body).encode()  # NaN and Infinity as JSON's non-standard literals
    r = client.request(
        method,
        url,
        content=content,
        headers={"Authorization": f"Bearer {TOKEN_A}", "Content-Type": "application/json"},
    )
    assert r.status_code < 500, (url, content, r.text)
    if r.status_code >= 400:
        assert "detail" in r.json()


def test_oversized_prompt_is_refused_before_the_catalog(
    service: tuple[TestClient, dict[str, Any]],
) -> None:
    client, valid = service
    for path, body in [
        ("lookup", {"fingerprint": FP.hex, "tokens": list(range(MAX_PROMPT + 1))}),
        ("known", {**valid["known"], "prefix_hashes": valid["hashes"][:1] * (MAX_PROMPT + 1)}),
    ]:
        r = client.post(
            f"/v1/namespaces/a/{path}", json=body, headers={"Authorization": f"Bearer {TOKEN_A}"}
        )
        assert r.status_code in (413, 422)
        assert str(MAX_PROMPT) in r.json()["detail"]


def test_unpublished_fingerprint_is_a_plain_miss_over_http(
    service: tuple[TestClient, dict[str, Any]],
) -> None:
    client, _ = service
    r = client.post(
        "/v1/namespaces/a/lookup",
        json={"fingerprint": "ab" * 32, "tokens": [*TOKENS, 7]},
        headers={"Authorization": f"Bearer {TOKEN_A}"},
    )
    assert r.status_code == 204


# -- bad calls into the library ----------------------------------------------------

MODEL = ReferenceModel.small(seed=0)
CHUNK = 16


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    yield c
    c.close()


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    return open_store(f"file://{tmp_path / 'blobs'}")


def computed(n: int) -> tuple[PagePool, int, list[int]]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=32)
    route = pool.new_route()
    toks = np.random.default_rng(3).integers(0, MODEL.vocab_size, n).tolist()
    MODEL.prefill(pool, route, toks)
    return pool, route, toks


def test_empty_tokens_are_refused_everywhere(cat: Catalog, store: ChunkStore) -> None:
    pool, route, toks = computed(20)
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, toks, MODEL.fingerprint)
        before = snapshot(cat, store)
        with pytest.raises(IdentityError, match="empty"):
            cat.lookup("default", MODEL.fingerprint, [])
        with pytest.raises(IdentityError, match="empty"):
            cp.checkpoint(pool, route, [], MODEL.fingerprint)
        with Restorer(cat, [store]) as rs, pytest.raises(IdentityError, match="empty"):
            rs.restore(PagePool(MODEL.layout, num_pages=4), [], MODEL.fingerprint)
        assert snapshot(cat, store) == before


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_kv_is_refused_by_the_pool_and_the_encoder(bad: float) -> None:
    pool = PagePool(LAYOUT, page_size=4, num_pages=4)
    route = pool.new_route()
    shape = (LAYOUT.num_layers, 3, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = np.zeros(shape, dtype=np.float16)
    v = np.zeros(shape, dtype=np.float16)
    v[1, 2, 0, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        pool.append(route, k, v)
    assert pool.length(route) == 0 and pool.free_pages == 4

    kv = np.zeros((LAYOUT.num_layers, 2, 3, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    kv[0, 1, 0, 0, 0] = bad
    root = chain_root("a")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_chunk(
            fingerprint=FP.hex,
            namespace="a",
            prefix_hash=b"\x01" * 32,
            parent_hash=root,
            token_start=0,
            tokens=[1, 2, 3],
            kv=kv,
        )


@pytest.mark.parametrize("poisoned_position", [0, 40])  # first chunk, or a later one
def test_checkpoint_of_poisoned_pool_memory_stores_nothing(
    cat: Catalog, store: ChunkStore, poisoned_position: int
) -> None:
    pool, route, toks = computed(50)
    page, slot = divmod(poisoned_position, pool.page_size)
    pool.kv[1, 0, pool.page_table(route)[page], slot, 0, 0] = np.nan  # memory gone bad
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        before = snapshot(cat, store)
        with pytest.raises(ValueError, match="NaN or Inf"):
            cp.checkpoint(pool, route, toks, MODEL.fingerprint, name="poisoned")
        assert snapshot(cat, store) == before
        assert list(store.keys()) == []


def test_kv_shapes_that_do_not_match_the_layout(cat: Catalog, store: ChunkStore) -> None:
    pool = PagePool(LAYOUT, page_size=4, num_pages=4)
    route = pool.new_route()
    good = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    for shape in [
        (LAYOUT.num_layers + 1, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim),
        (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim + 1),
        (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads),
    ]:
        with pytest.raises(ValueError, match="must be shaped"):
            pool.append(route, np.zeros(shape, np.float16), np.zeros(shape, np.float16))
    with pytest.raises(ValueError, match="must be shaped"):
        pool.append(route, np.zeros(good, np.float32), np.zeros(good, np.float32))
    with pytest.raises(ValueError, match="same shape"):
        pool.append(
            route,
            np.zeros(good, np.float16),
            np.zeros((LAYOUT.num_layers, 3, *good[2:]), np.float16),
        )
    assert pool.length(route) == 0
    with pytest.raises(ValueError):
        encode_chunk(
            fingerprint=FP.hex,
            namespace="a",
            prefix_hash=b"\x01" * 32,
            parent_hash=chain_root("a"),
            token_start=0,
            tokens=[1, 2, 3],  # 3 ids, 2 positions of KV
            kv=np.zeros((2, 2, 2, 2, 4), np.float16),
        )
    # A pool whose geometry is not the fingerprint's: refused before anything is stored.
    other = PagePool(LAYOUT, page_size=4, num_pages=4)
    r2 = other.new_route()
    other.append(r2, np.zeros(good, np.float16), np.zeros(good, np.float16))
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        before = snapshot(cat, store)
        with pytest.raises(RestoreError, match="does not match"):
            cp.checkpoint(other, r2, [1, 2], MODEL.fingerprint)
        assert snapshot(cat, store) == before


@pytest.mark.parametrize(
    "fp", ["zz", "AB" * 32, "ab" * 31, "ab" * 33, "", " " + "ab" * 32, "g" * 64]
)
def test_malformed_fingerprint_hex_is_an_identity_error(
    cat: Catalog, store: ChunkStore, fp: str
) -> None:
    cat.ensure_namespace("default", CHUNK)
    before = snapshot(cat, store)
    with pytest.raises(IdentityError, match="malformed fingerprint"):
        cat.lookup("default", fp, [1, 2, 3])
    with Restorer(cat, [store]) as rs, pytest.raises(IdentityError, match="malformed fingerprint"):
        rs.restore(PagePool(MODEL.layout, num_pages=4), [1, 2, 3], fp)
    assert snapshot(cat, store) == before


@pytest.mark.parametrize("bad", [b"", b"xx", b"\x00" * 31, b"\x00" * 33, "ab" * 32, 5, None])
def test_malformed_prefix_hash_is_a_clear_catalog_error(cat: Catalog, bad: Any) -> None:
    cat.ensure_namespace("a", CS)
    cat.record_chunks(chain_records("a", TOKENS))
    before = row_counts(cat)
    for call in (cat.get_prefix, cat.lineage, cat.descendants):
        with pytest.raises(CatalogError, match="prefix"):
            call("a", bad)
    with pytest.raises(CatalogError, match="prefix"):
        cat.quarantine("a", bad, "bad hash")
    assert row_counts(cat) == before


def test_a_fingerprint_nothing_was_published_under_is_a_plain_miss(
    cat: Catalog, store: ChunkStore
) -> None:
    pool, route, toks = computed(40)
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, toks, MODEL.fingerprint)
    unknown = "cd" * 32
    m = cat.lookup("default", unknown, [*toks, 1])
    assert m.matched_tokens == 0 and not m.hit
    fresh = PagePool(MODEL.layout, num_pages=8)
    with Restorer(cat, [store]) as rs:
        res = rs.restore(fresh, [*toks, 1], unknown)
    assert res.route is None and res.restored_tokens == 0 and res.recompute_from == 0
    assert fresh.routes() == [] and fresh.free_pages == 8
    # The shard given explicitly: still a miss, not an error.
    assert cat.lookup("default", unknown, [*toks, 1], shard=Shard.full(MODEL.layout)).hit is False


# -- store URLs ---------------------------------------------------------------------------

SECRET = "s3cr3tPW"


class _FakeStore:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs


@pytest.fixture
def aws_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@FUZZ
@given(url=st.text(max_size=80))
def test_arbitrary_text_as_a_store_url(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Constructors replaced: arbitrary text must never create directories or clients.
    monkeypatch.setattr("chunkstore.local.LocalStore", _FakeStore)
    monkeypatch.setattr("chunkstore.s3.S3Store", _FakeStore)
    try:
        opened = open_store(url)
    except StoreURLError:
        return
    assert isinstance(opened, _FakeStore)


_SCHEMES = st.sampled_from(["file", "s3", "S3", "http", "https", "", "ftp", "s3a", "File"])
_HOSTS = st.one_of(
    st.just(""),
    st.sampled_from(["bucket", "my-bucket.x", "B", "ab", "127.0.0.1:9000", "[::1]", "a" * 70]),
    st.text(alphabet="abcXYZ09.-_%:[]", max_size=20),
)
_PATHS = st.lists(st.text(alphabet="abz09._-%~ ", max_size=8), max_size=4).map(
    lambda xs: "/" + "/".join(xs)
)
_OPTION_NAMES = st.sampled_from(
    [
        "endpoint_url",
        "region",
        "retry_mode",
        "max_attempts",
        "connect_timeout",
        "part_size",
        "multipart_threshold",
        "max_concurrency",
        "addressing_style",
        "refresh_after_s",
        "temp_grace_s",
        "read_timeout",
        "token",
        "secret",
    ]
)
_OPTION_VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "nan",
            "inf",
            "-1",
            "0",
            "1",
            "8MiB",
            "5GiB",
            "9" * 40,
            "standard",
            "path",
            "us-east-1",
            "http://h:1",
            f"http://AK:{SECRET}@h:1",
            "ftp://x",
        ]
    ),
    st.text(alphabet="abc019.:/-@%", max_size=12),
)
_QUERIES = st.lists(st.tuples(_OPTION_NAMES, _OPTION_VALUES), max_size=3).map(
    lambda kv: "&".join(f"{k}={v}" for k, v in kv)
)


@FUZZ
@given(
    scheme=_SCHEMES,
    userinfo=st.sampled_from(["", f"AKIAXXXX:{SECRET}@", f"{SECRET}@", f":{SECRET}@"]),
    host=_HOSTS,
    path=_PATHS,
    query=_QUERIES,
)
def test_built_store_urls_open_or_raise_store_url_errors_without_secrets(
    tmp_path: Path,
    aws_isolated: None,
    scheme: str,
    userinfo: str,
    host: str,
    path: str,
    query: str,
) -> None:
    if scheme.lower() == "file" and not userinfo and not host:
        path = str(tmp_path) + path  # valid file URLs stay inside the test's directory
    url = f"{scheme}://{userinfo}{host}{path}" + (f"?{query}" if query else "")
    try:
        opened = open_store(url)
    except StoreURLError as exc:
        assert SECRET not in str(exc)
        assert SECRET not in repr(exc.__cause__) and SECRET not in repr(exc.__context__)
        return
    assert isinstance(opened, ChunkStore)
    assert SECRET not in opened.name
    assert not userinfo


def test_store_url_with_a_nul_byte_is_a_store_url_error(tmp_path: Path) -> None:
    with pytest.raises(StoreURLError):
        open_store(f"file://{tmp_path}/a%00b")
    with pytest.raises(StoreURLError):
        open_store(f"file://{tmp_path}/a\x00b")


# -- settings ---------------------------------------------------------------------------------

_FIELDS = [
    "home",
    "catalog_url",
    "stores",
    "namespace",
    "chunk_size",
    "page_size",
    "host",
    "port",
    "daemon_port",
    "worker_id",
    "service_url",
    "service_token",
    "tokens_file",
    "max_prompt_tokens",
]
_ENV_TEXT = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=30
)
_ENV_VALUES = st.one_of(
    _ENV_TEXT,
    st.sampled_from(
        ["nan", "inf", "-1", "0", "65536", "65537", "1e3", "9" * 40, "true", "[]", "{}", " 8 "]
    ),
)


@FUZZ
@given(env=st.dictionaries(st.sampled_from(_FIELDS), _ENV_VALUES, max_size=5))
def test_settings_from_environment_like_values(env: dict[str, str], tmp_path: Path) -> None:
    environ = {f"KVC_{k.upper()}": v for k, v in env.items()}
    environ["KVC_CONFIG"] = str(tmp_path / "absent.toml")
    with mock.patch.dict(os.environ, environ, clear=False):
        for k in list(os.environ):
            if k.startswith("KVC_") and k not in environ:
                del os.environ[k]
        try:
            s = Settings()
        except ValidationError:
            return
    assert 1 <= s.port <= 65535 and 1 <= s.chunk_size <= 65536 and s.max_prompt_tokens >= 1


@FUZZ
@given(values=st.dictionaries(st.sampled_from([*_FIELDS, "nope"]), HOSTILE, max_size=4))
def test_settings_from_arbitrary_values(values: dict[str, Any], tmp_path: Path) -> None:
    config = {"KVC_CONFIG": str(tmp_path / "absent.toml")}
    with mock.patch.dict(os.environ, config), contextlib.suppress(ValidationError):
        Settings(**values)
