"""Token-exact resume, the heart of kvc: restored KV decodes bit-identically to recomputed KV.

Runs on SQLite and PostgreSQL, with local and S3 (SeaweedFS) stores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer
from tests.resume_worker import resume_in_new_process

SEED = 0
PAGE = 16
CHUNK = 32
ROOT = Path(__file__).resolve().parents[2]
MODEL = ReferenceModel.small(seed=SEED)


@dataclass
class Env:
    catalog_url: str
    store_url: str
    catalog: Catalog
    store: ChunkStore
    namespace: str = "default"


@pytest.fixture(
    params=[("sqlite", "local"), ("sqlite", "s3"), ("postgres", "local"), ("postgres", "s3")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    db, kind = request.param
    url = (
        f"sqlite:///{tmp_path / 'catalog.db'}"
        if db == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    store_url = (
        f"file://{tmp_path / 'blobs'}" if kind == "local" else request.getfixturevalue("s3_url")
    )
    cat = Catalog.open(url, upgrade=True)
    store = open_store(store_url)
    yield Env(url, store_url, cat, store)
    store.close()
    cat.close()


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, MODEL.vocab_size, n).tolist()


def digest(x: np.ndarray[Any, Any]) -> str:
    return blake3.blake3(x.tobytes()).hexdigest()


def straight(tokens: list[int], n: int) -> tuple[list[int], list[str]]:
    """Decode without kvc: prefill everything, then n greedy steps."""
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    return resume(pool, pool.new_route(), tokens, n)


def resume(pool: PagePool, route: int, rest: list[int], n: int) -> tuple[list[int], list[str]]:
    """Prefill `rest` after what the route holds, then n greedy steps: (tokens, logits digests)."""
    out, logits = MODEL.trace(pool, route, rest, n)
    return out, [digest(x) for x in logits]


def checkpoint(env: Env, tokens: list[int], name: str | None = None) -> None:
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    with Checkpointer(env.catalog, env.store, env.namespace, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, tokens, MODEL.fingerprint, name=name)


def corrupt(store: ChunkStore, key: str) -> None:
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    if store.name.startswith("file:"):
        path = store.path_of(key)  # type: ignore[attr-defined]
        os.chmod(path, 0o644)
        path.write_bytes(bytes(data))
    else:
        store.client.put_object(Bucket=store.bucket, Key=store.object_key(key), Body=bytes(data))  # type: ignore[attr-defined]


def test_resume_in_a_new_process_is_bit_identical(env: Env) -> None:
    p = prompt(100)
    want_tokens, want_logits = straight(p, 6)
    checkpoint(env, p, name="conversation")
    args = {
        "seed": SEED,
        "page_size": PAGE,
        "catalog": env.catalog_url,
        "stores": [env.store_url],
        "namespace": env.namespace,
        "prompt": p,
        "n": 6,
    }
    got = resume_in_new_process(args)
    assert got["restored"] == 99  # 3 full chunks and 3 of the 4-token tail; the last token is fed
    assert got["tokens"] == want_tokens
    assert got["logits"] == want_logits
    assert env.catalog.get_ref("default", "conversation").processed == 100


def test_divergence_inside_a_chunk_restores_the_shared_part(env: Env) -> None:
    p = prompt(100)
    checkpoint(env, p)
    q = [*p[:70], *prompt(30, seed=2)]
    want = straight(q, 5)
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    with Restorer(env.catalog, [env.store]) as r:
        res = r.restore(pool, q, MODEL.fingerprint)
    assert res.restored_tokens == 70 and res.recompute_from == 70
    assert res.route is not None
    assert resume(pool, res.route, q[70:], 5) == want


def test_two_forks_of_one_restore_decode_independently(env: Env) -> None:
    p = prompt(64)
    checkpoint(env, p)
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    with Restorer(env.catalog, [env.store]) as r:
        res = r.restore(pool, p, MODEL.fingerprint)
    assert res.route is not None and res.restored_tokens == 63
    before = pool.read(res.route)
    a, b = pool.fork(res.route), pool.fork(res.route)
    got_a = resume(pool, a, [p[63], 5], 3)
    got_b = resume(pool, b, [p[63], 9], 3)
    assert got_a == straight([*p, 5], 3)
    assert got_b == straight([*p, 9], 3)
    after = pool.read(res.route)
    assert all(
        np.array_equal(x.view(np.uint8), y.view(np.uint8))
        for x, y in zip(before, after, strict=True)
    )
    pool.check_invariants()


def test_corrupt_blob_degrades_to_the_verified_prefix(env: Env) -> None:
    p = prompt(100)
    checkpoint(env, p)
    m = env.catalog.lookup("default", MODEL.fingerprint, p)
    bad = m.chunks[1].blob_key
    corrupt(env.store, bad)
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    free = pool.free_pages
    with Restorer(env.catalog, [env.store]) as r:
        res = r.restore(pool, p, MODEL.fingerprint)
    assert res.restored_tokens == CHUNK and res.recompute_from == CHUNK
    assert any("corrupt" in f for f in res.report.failures)
    assert res.route is not None
    assert pool.free_pages == free - CHUNK // PAGE  # no page of the failed chunks is held
    assert resume(pool, res.route, p[CHUNK:], 4) == straight(p, 4)
    ev = env.catalog.events(kind="replica.corrupt")
    assert [e.subject for e in ev] == [bad]
    assert env.catalog.lookup("default", MODEL.fingerprint, p).matched_tokens == CHUNK
