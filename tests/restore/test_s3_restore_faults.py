"""Faults on the real S3 path: a proxy between boto3 and SeaweedFS fails, stalls and damages answers.

The same promises as tests/restore/test_restore_faults.py, with the faults made by
an HTTP server rather than a wrapping store: transient errors are retried by
the store; bits flipped once are read again; damage on every read falls over
to another replica and marks this one corrupt; a replica that cannot be read
at all (or only ever arrives cut short) is not condemned; with no good
replica the restore stops at the longest verified prefix. Nothing unverified
reaches a page, and what is restored is bit-exact against a fresh prefill.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import boto3
import numpy as np
import pytest

from catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.errors import ChunkIntegrityError, StoreUnavailableError
from chunkstore.local import LocalStore
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer, RestoreResult
from restore.write_behind import to_replica_receipt
from tests.fault_proxy import Action, FaultProxy, Seen
from tests.services import S3Server

MODEL = ReferenceModel.small(seed=0)
TOKENS = np.random.default_rng(4).integers(0, MODEL.vocab_size, 100).tolist()
PAGES = 64
# Two attempts per request keeps the persistent faults fast; a read timeout of
# 1.5 s is far above a loopback GET yet keeps a stalled answer short.
MAX_ATTEMPTS = 2
READ_TIMEOUT_S = 1.5
TUNING = f"max_attempts={MAX_ATTEMPTS}&connect_timeout=2&read_timeout={READ_TIMEOUT_S}"


@dataclass
class Rig:
    """A proxy in front of the S3 server, and a catalog of TOKENS published through it."""

    server: S3Server
    proxy: FaultProxy
    prefix: str
    template: Path  # the catalog right after publishing, copied for each test
    keys: list[str]
    want: tuple[np.ndarray, np.ndarray]  # K and V of a fresh prefill of TOKENS
    session: boto3.session.Session  # loads botocore's models once for every store

    def url(self, suffix: str, *, direct: bool = False) -> str:
        srv = self.server
        endpoint = srv.endpoint_url if direct else self.proxy.url
        return f"s3://{srv.bucket}/{self.prefix}-{suffix}?endpoint_url={endpoint}&region={srv.region}&{TUNING}"

    def open(self, suffix: str = "a", *, direct: bool = False) -> ChunkStore:
        # A store (boto3 client) per test: botocore's retry quota is per client.
        return open_store(self.url(suffix, direct=direct), session=self.session)


@pytest.fixture(scope="module")
def rig(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    srv = s3_server
    if not srv.endpoint_url.startswith("http://"):
        pytest.skip(f"the fault proxy speaks plain HTTP; the S3 endpoint is {srv.endpoint_url}")
    root = tmp_path_factory.mktemp("s3-faults")
    with FaultProxy(srv.endpoint_url, stall_s=10 * READ_TIMEOUT_S) as proxy:
        pool = PagePool(MODEL.layout, page_size=16, num_pages=PAGES)
        r = pool.new_route()
        MODEL.prefill(pool, r, TOKENS)
        want = pool.read(r, 0, len(TOKENS))
        session = boto3.session.Session(
            aws_access_key_id=srv.access_key, aws_secret_access_key=srv.secret_key
        )
        rig = Rig(srv, proxy, f"t-{uuid.uuid4().hex[:12]}", root / "c.db", [], want, session)
        cat = Catalog.open(f"sqlite:///{rig.template}", upgrade=True)
        # Published once, through the (still harmless) proxy: chunks of 32, 32, 32, 4.
        with rig.open() as s3, Checkpointer(cat, s3, chunk_size=32, write_behind=None) as cp:
            cp.checkpoint(pool, r, TOKENS, MODEL.fingerprint)
        rig.keys = [c.blob_key for c in cat.lookup("default", MODEL.fingerprint, TOKENS).chunks]
        cat.close()
        assert len(rig.keys) == 4 and all(s.fault is None for s in proxy.seen())
        yield rig


@pytest.fixture
def published(rig: Rig, tmp_path: Path) -> Iterator[tuple[Rig, Catalog, ChunkStore]]:
    """This test's copy of the published catalog, and the S3 store through the proxy."""
    for f in rig.template.parent.glob(rig.template.name + "*"):
        shutil.copy(f, tmp_path / f.name)
    rig.proxy.clear()
    cat = Catalog.open(f"sqlite:///{tmp_path / rig.template.name}")
    s3 = rig.open()
    try:
        yield rig, cat, s3
    finally:
        s3.close()
        cat.close()
        rig.proxy.clear()


def restore(cat: Catalog, stores: list[ChunkStore]) -> tuple[RestoreResult, PagePool]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=PAGES)
    with Restorer(cat, stores) as r:
        res = r.restore(pool, TOKENS, MODEL.fingerprint)
    pool.check_invariants()
    return res, pool


def assert_exact(rig: Rig, res: RestoreResult, pool: PagePool) -> None:
    """The pool holds one route of `restored_tokens` positions, bit-identical to a fresh prefill."""
    assert res.route is not None and pool.routes() == [res.route]
    n = res.restored_tokens
    assert pool.length(res.route) == n == res.recompute_from
    got = pool.read(res.route)
    want = [w[:, :n] for w in rig.want]
    assert all(
        np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(got, want, strict=True)
    )


def states(cat: Catalog, key: str) -> dict[str, str]:
    with cat.engine.connect() as conn:
        return dict(
            conn.exec_driver_sql(
                "SELECT location, state FROM replicas WHERE blob_key = ?", (key,)
            ).all()
        )


def copy_replicas(
    cat: Catalog, keys: list[str], src: ChunkStore, dst: ChunkStore, tier: str
) -> None:
    """A second replica of every blob: copied from `src` into `dst` and catalogued."""
    for k in keys:
        cat.record_replica(k, to_replica_receipt(dst.put(k, src.get(k)), tier))


def faults(proxy: FaultProxy, key: str) -> list[str | None]:
    return [s.fault for s in proxy.seen("GET", key)]


Published = tuple[Rig, Catalog, ChunkStore]


@pytest.mark.parametrize("action", ["500", "503", "slowdown", "reset", "reset_body", "truncate"])
def test_a_transient_fault_on_a_get_is_retried(published: Published, action: Action) -> None:
    rig, cat, s3 = published
    key = rig.keys[1]
    rig.proxy.inject(action, key=key)
    res, pool = restore(cat, [s3])
    assert faults(rig.proxy, key) == [action, None]  # the store asked again
    assert res.restored_tokens == 99 and res.report.failures == []
    assert res.report.replicas_used == {s3.name: 4}
    assert states(cat, key) == {s3.name: "durable"}
    assert_exact(rig, res, pool)


@pytest.mark.parametrize("action", ["stall", "stall_body"])
def test_an_answer_stalled_past_the_read_timeout_is_retried(
    published: Published, action: Action
) -> None:
    rig, cat, s3 = published
    key = rig.keys[0]
    rig.proxy.inject(action, key=key)
    res, pool = restore(cat, [s3])
    assert faults(rig.proxy, key) == [action, None]
    assert res.restored_tokens == 99 and res.report.failures == []
    assert states(cat, key) == {s3.name: "durable"}
    assert_exact(rig, res, pool)


# "flip" is caught by the restore's digest check (the store saw a clean answer);
# "whole_flip" by botocore against the checksum the server sent with the body.
@pytest.mark.parametrize(("action", "then"), [("flip", None), ("whole_flip", "whole")])
def test_bits_flipped_on_the_first_read_only_are_read_again(
    published: Published, action: Action, then: Action | None
) -> None:
    rig, cat, s3 = published
    key = rig.keys[1]
    rig.proxy.inject(action, key=key)
    if then is not None:
        rig.proxy.inject(then, key=key, times=None)
    res, pool = restore(cat, [s3])
    assert faults(rig.proxy, key) == [action, then]
    assert res.restored_tokens == 99 and res.report.replicas_used == {s3.name: 4}
    assert states(cat, key) == {s3.name: "durable"}  # damaged in transit: not condemned
    assert_exact(rig, res, pool)


def test_a_body_failing_the_servers_checksum_is_an_integrity_error(published: Published) -> None:
    # Regression: botocore's FlexibleChecksumError escaped S3Store.get, and with
    # it Restorer.restore (and rebuild, fsck), instead of being bad bytes.
    rig, _, s3 = published
    key = rig.keys[0]
    rig.proxy.inject("whole_flip", key=key)
    with pytest.raises(ChunkIntegrityError, match="checksum the server sent"):
        s3.get(key)
    rig.proxy.inject("whole", key=key)
    assert blake3.blake3(bytes(s3.get(key))).hexdigest() == key
    assert faults(rig.proxy, key) == ["whole_flip", "whole"]


# What each persistent fault says about the replica: bytes that arrive intact in
# framing but fail the digest twice are damaged at rest; bytes that never arrive
# whole (cut off before Content-Length, or no answer) say nothing about the object.
PERSISTENT: list[tuple[Action, str]] = [
    ("flip", "corrupt"),
    ("whole_flip", "corrupt"),
    ("short", "corrupt"),
    ("truncate", "durable"),
    ("503", "durable"),
]


@pytest.mark.parametrize(("action", "state"), PERSISTENT)
def test_a_persistent_fault_uses_another_replica(
    published: Published, action: Action, state: str
) -> None:
    rig, cat, s3 = published
    key = rig.keys[2]
    # A second object-tier replica of every chunk under another prefix, reached
    # directly; its store name sorts after the proxied one, so it is tried second.
    with rig.open("b", direct=True) as b:
        assert s3.name < b.name
        copy_replicas(cat, rig.keys, s3, b, "object")
        rig.proxy.clear()
        rig.proxy.inject(action, key=key, times=None)
        res, pool = restore(cat, [s3, b])
        # Damage is read twice by the restore; transport failures are retried by the store.
        assert faults(rig.proxy, key) == [action] * 2
        assert res.restored_tokens == 99
        assert res.report.replicas_used == {s3.name: 3, b.name: 1}
        assert states(cat, key) == {s3.name: state, b.name: "durable"}
        assert all(states(cat, k)[s3.name] == "durable" for k in rig.keys if k != key)
        assert_exact(rig, res, pool)


def test_a_local_replica_damaged_at_rest_falls_over_to_s3_through_a_503(
    published: Published, tmp_path: Path
) -> None:
    # A local replica ranks first, so S3 is read only when it fails: here its
    # file has a flipped bit, and S3's first answer for that chunk is a 503.
    rig, cat, s3 = published
    key = rig.keys[2]
    with LocalStore(tmp_path / "local") as local:
        copy_replicas(cat, rig.keys, s3, local, "local")
        path = local.path_of(key)
        damaged = bytearray(path.read_bytes())
        damaged[len(damaged) // 2] ^= 0x01
        path.chmod(0o644)
        path.write_bytes(damaged)
        rig.proxy.clear()
        rig.proxy.inject("503", key=key)
        res, pool = restore(cat, [local, s3])
        assert rig.proxy.seen("GET") == [Seen("GET", key, "503"), Seen("GET", key, None)]
        assert res.restored_tokens == 99
        assert res.report.replicas_used == {local.name: 3, s3.name: 1}
        assert states(cat, key) == {local.name: "corrupt", s3.name: "durable"}
        assert_exact(rig, res, pool)


@pytest.mark.parametrize(("action", "state"), PERSISTENT)
def test_no_good_replica_degrades_to_the_verified_prefix(
    published: Published, action: Action, state: str
) -> None:
    rig, cat, s3 = published
    key = rig.keys[2]
    rig.proxy.inject(action, key=key, times=None)
    res, pool = restore(cat, [s3])
    assert faults(rig.proxy, key) == [action] * 2
    assert res.restored_tokens == 64 and res.recompute_from == 64 and res.prompt_tokens == 100
    assert pool.free_pages == PAGES - 4  # the pages reserved for chunks 2 and 3 went back
    assert res.report.replicas_used == {s3.name: 2}
    assert any(f.startswith(key[:16]) for f in res.report.failures)
    assert states(cat, key) == {s3.name: state}
    assert_exact(rig, res, pool)


@pytest.mark.parametrize("action", ["503", "slowdown", "stall", "reset"])
def test_a_store_that_never_answers_marks_nothing_and_degrades(
    published: Published, action: Action
) -> None:
    rig, cat, s3 = published
    key = rig.keys[0]
    rig.proxy.inject(action, key=key, times=None)
    res, pool = restore(cat, [s3])
    assert faults(rig.proxy, key) == [action] * MAX_ATTEMPTS
    assert res.route is None and res.restored_tokens == 0 and res.recompute_from == 0
    assert pool.free_pages == PAGES and pool.routes() == []
    assert states(cat, key) == {s3.name: "durable"}  # the outcome is unknown, not bad bytes


def test_a_put_failing_with_500_catalogues_nothing(rig: Rig, tmp_path: Path) -> None:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=PAGES)
    r = pool.new_route()
    MODEL.prefill(pool, r, TOKENS)
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    rig.proxy.clear()
    # The first PUT is the fingerprint's descriptor (before the first blob), then two blobs.
    rig.proxy.inject("500", method="PUT", times=None, after=3)
    try:
        with rig.open("put") as s3:
            with (
                # One chunk at a time, so the PUTs come in a known order.
                Checkpointer(cat, s3, chunk_size=32, write_behind=None, parallel=1) as cp,
                pytest.raises(StoreUnavailableError, match="outcome unknown"),
            ):
                cp.checkpoint(pool, r, TOKENS, MODEL.fingerprint, name="x")
            puts = rig.proxy.seen("PUT")
            assert [s.fault for s in puts] == [None, None, None, "500", "500"]
            assert puts[0].key == MODEL.fingerprint.hex
            assert cat.stats()["chunks"] == 0 and cat.list_refs("default") == []
            # Bytes first, catalog second: the two blobs that landed are orphans, for GC.
            assert sorted(s3.keys()) == sorted({puts[1].key, puts[2].key})
            miss, _ = restore(cat, [s3])
            assert miss.route is None
    finally:
        cat.close()
        rig.proxy.clear()
