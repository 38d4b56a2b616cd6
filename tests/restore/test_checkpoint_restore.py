"""Checkpoint and restore pipelines: ordering, skipping, queues, write-behind, shards, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from catalog.models import Shard
from chunkstore import ChunkStore, Receipt, open_store, record
from chunkstore.errors import StoreUnavailableError
from restore.checkpoint import Checkpointer
from restore.cores import usable_cores
from restore.engines.reference import ReferenceModel
from restore.errors import CheckpointBusyError, PoolExhaustedError, RestoreError
from restore.pool import PagePool
from restore.restore import Restorer
from tests.store_wrappers import Delegating

MODEL = ReferenceModel.small(seed=0)
CHUNK = 32


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    yield c
    c.close()


@pytest.fixture
def local(tmp_path: Path) -> ChunkStore:
    return open_store(f"file://{tmp_path / 'blobs'}")


def tokens(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, MODEL.vocab_size, n).tolist()


def computed(n: int, seed: int = 1) -> tuple[PagePool, int, list[int]]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=128)
    route = pool.new_route()
    t = tokens(n, seed)
    MODEL.prefill(pool, route, t)
    return pool, route, t


class Gate(Delegating):
    """A store that delegates to another, optionally blocking or failing puts and gets."""

    def __init__(self, inner: ChunkStore, name: str) -> None:
        super().__init__(inner)
        self._name = name
        self.put_gate = threading.Event()
        self.put_gate.set()
        self.fail_gets = False
        self.puts = 0

    @property
    def name(self) -> str:
        return self._name

    def put(self, key: str, data: Any) -> Receipt:
        self.put_gate.wait(30)
        self.puts += 1
        r = self.inner.put(key, data)
        return Receipt(self._name, r.key, r.size, r.checksum, r.stored_at, r.etag, r.version)

    def get(self, key: str) -> Any:
        if self.fail_gets:
            raise StoreUnavailableError(f"{self._name}: connection refused")
        return self.inner.get(key)


def test_checkpoint_skips_what_the_catalog_has(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(100)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        first = cp.checkpoint(pool, route, t, MODEL.fingerprint)
        again = cp.checkpoint(pool, route, t, MODEL.fingerprint)
        MODEL.prefill(pool, route, tokens(40, seed=5))
        longer = t + tokens(40, seed=5)
        grown = cp.checkpoint(pool, route, longer, MODEL.fingerprint, name="chat", pending=3)
    assert (first.chunks, first.new_chunks) == (4, 4)
    assert (again.new_chunks, again.skipped_chunks, again.stored_bytes) == (0, 4, 0)
    # The 4-token tail is a different node from the full chunk that replaces it.
    assert (grown.chunks, grown.new_chunks) == (5, 2)
    assert len(list(local.keys())) == 6
    ref = cat.get_ref("default", "chat")
    assert ref.processed == 140 and ref.pending_token == 3


def test_checkpoint_refuses_mismatched_input(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(10)
    other = ReferenceModel.small(seed=0, kv_dtype="float32")
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        with pytest.raises(RestoreError, match="holds 10 positions"):
            cp.checkpoint(pool, route, [*t, 1], MODEL.fingerprint)
        with pytest.raises(RestoreError, match="does not match"):
            cp.checkpoint(pool, route, t, other.fingerprint)
        with pytest.raises(ValueError, match="empty"):
            cp.checkpoint(pool, route, [], MODEL.fingerprint)
    assert list(local.keys()) == []
    with pytest.raises(RestoreError, match="chunk size"):
        Checkpointer(cat, local, chunk_size=CHUNK)
        Checkpointer(cat, local, chunk_size=64)


def test_submit_is_bounded_and_never_blocks(cat: Catalog, local: ChunkStore) -> None:
    gate = Gate(local, local.name)
    gate.put_gate.clear()  # the first job blocks inside put
    pool, route, t = computed(64)
    cp = Checkpointer(cat, gate, chunk_size=CHUNK, max_queue=2)
    f1 = cp.submit(pool, route, t, MODEL.fingerprint)
    f2 = cp.submit(pool, route, t, MODEL.fingerprint)
    assert f1 is not None and f2 is not None
    assert cp.submit(pool, route, t, MODEL.fingerprint) is None
    assert cp.dropped["queue_full"] == 1
    with pytest.raises(CheckpointBusyError, match="queue_full"):
        cp.submit(pool, route, t, MODEL.fingerprint, speculative=False)
    MODEL.decode(pool, route, 7)  # decoding goes on while captures are queued
    gate.put_gate.set()
    cp.close()
    assert f1.result().new_chunks == 2 and f2.result().new_chunks == 0
    small = Checkpointer(cat, local, chunk_size=CHUNK, staging_bytes=1000)
    assert small.submit(pool, route, t, MODEL.fingerprint) is None
    assert small.dropped["staging_budget"] == 1
    small.close()


def test_write_behind_records_the_object_replica_after_its_receipt(
    cat: Catalog, local: ChunkStore, tmp_path: Path
) -> None:
    remote = Gate(
        open_store(f"file://{tmp_path / 'remote'}?tier=object"),
        "s3://bucket/kvc?endpoint_url=http://x&region=r",
    )
    remote.put_gate.clear()
    pool, route, t = computed(64)
    cp = Checkpointer(cat, local, chunk_size=CHUNK, write_behind=remote)
    cp.checkpoint(pool, route, t, MODEL.fingerprint)
    with cat.engine.connect() as conn:
        tiers = conn.execute(sa.text("SELECT tier FROM replicas")).scalars().all()
    assert sorted(tiers) == ["local", "local"]  # the upload has no receipt yet
    remote.put_gate.set()
    cp.close()
    with cat.engine.connect() as conn:
        tiers = conn.execute(sa.text("SELECT tier FROM replicas")).scalars().all()
    assert sorted(tiers) == ["local", "local", "object", "object"]
    # The remote replica serves a restore when the local one is gone.
    for key in list(local.keys()):
        local.delete(key)
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [local, remote]) as r:
        res = r.restore(dst, t, MODEL.fingerprint)
    assert res.restored_tokens == 63 and set(res.report.replicas_used) == {remote.name}
    assert len(cat.events(kind="replica.missing")) == 2


class SlowToRecord:
    """A catalog whose publish transaction starts only after the object store holds every
    upload: the order a fast object store and a busy database produce."""

    def __init__(self, inner: Catalog, uploads_done: threading.Event) -> None:
        self._inner = inner
        self._uploads_done = uploads_done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def record_chunks(self, records: Any, **kw: Any) -> Any:
        assert self._uploads_done.wait(30), "the write-behind uploads never finished"
        return self._inner.record_chunks(records, **kw)


def test_write_behind_replicas_are_recorded_when_uploads_finish_before_the_publish(
    cat: Catalog, local: ChunkStore, tmp_path: Path
) -> None:
    done = threading.Event()

    class Counting(Gate):
        def put(self, key: str, data: Any) -> Receipt:
            r = super().put(key, data)
            if self.puts == 2:
                done.set()
            return r

    remote = Counting(
        open_store(f"file://{tmp_path / 'remote'}?tier=object"),
        "s3://bucket/kvc?endpoint_url=http://x&region=r",
    )
    pool, route, t = computed(64)
    with Checkpointer(SlowToRecord(cat, done), local, chunk_size=CHUNK, write_behind=remote) as cp:  # type: ignore[arg-type]
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    with cat.engine.connect() as conn:
        tiers = conn.execute(sa.text("SELECT tier FROM replicas")).scalars().all()
    assert sorted(tiers) == ["local", "local", "object", "object"]
    assert cp.dropped == {}


def test_a_failed_publish_records_no_write_behind_replica(
    cat: Catalog, local: ChunkStore, tmp_path: Path
) -> None:
    class Refusing(SlowToRecord):
        def record_chunks(self, records: Any, **kw: Any) -> Any:
            raise RuntimeError("database went away")

    remote = Gate(
        open_store(f"file://{tmp_path / 'remote'}?tier=object"),
        "s3://bucket/kvc?endpoint_url=http://x&region=r",
    )
    pool, route, t = computed(64)
    cp = Checkpointer(
        Refusing(cat, threading.Event()), local, chunk_size=CHUNK, write_behind=remote
    )  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="went away"):
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    cp.close()
    assert remote.puts == 2  # the bytes went up (orphans, reclaimed by GC after its grace)
    assert cp.dropped["write_behind_unpublished"] == 2
    with cat.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM replicas")).scalar_one() == 0


def test_shards_publish_and_restore_only_their_slab(cat: Catalog, local: ChunkStore) -> None:
    full_pool, route, t = computed(64)
    k, v = full_pool.read(route)
    lay = MODEL.layout
    halves = [Shard(0, 2, 0, lay.num_kv_heads), Shard(2, lay.num_layers, 0, lay.num_kv_heads)]
    for sh in halves:
        from catalog import AttentionLayout

        sl = AttentionLayout(sh.layer_hi - sh.layer_lo, lay.num_kv_heads, lay.head_dim, lay.dtype)
        pool = PagePool(sl, page_size=16, num_pages=16)
        r = pool.new_route()
        pool.append(r, k[sh.layer_lo : sh.layer_hi], v[sh.layer_lo : sh.layer_hi])
        with Checkpointer(cat, local, chunk_size=CHUNK, shard=sh) as cp:
            cp.checkpoint(pool, r, t, MODEL.fingerprint)
        dst = PagePool(sl, page_size=16, num_pages=16)
        with Restorer(cat, [local], shard=sh) as rs:
            res = rs.restore(dst, t, MODEL.fingerprint)
        assert res.restored_tokens == 63 and res.route is not None
        rk, rv = dst.read(res.route)
        assert np.array_equal(rk, k[sh.layer_lo : sh.layer_hi, :63])
        assert np.array_equal(rv, v[sh.layer_lo : sh.layer_hi, :63])
    # The whole-model shard was never published.
    with Restorer(cat, [local]) as rs:
        assert rs.restore(PagePool(MODEL.layout, num_pages=16), t, MODEL.fingerprint).route is None


def test_restore_miss_and_unreachable_store(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(64)
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [local]) as r:
        miss = r.restore(dst, t, MODEL.fingerprint)
    assert miss.route is None and miss.restored_tokens == 0 and not miss.hit
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    down = Gate(local, local.name)
    down.fail_gets = True
    with Restorer(cat, [down]) as r:
        res = r.restore(dst, t, MODEL.fingerprint)
    assert res.route is None and dst.free_pages == 64
    assert any("connection refused" in f for f in res.report.failures)
    assert cat.events(kind="replica.corrupt") == []  # unreachable is not the replica's fault


def test_restore_that_does_not_fit_changes_nothing(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(100)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    tiny = PagePool(MODEL.layout, page_size=16, num_pages=3)
    with Restorer(cat, [local]) as r, pytest.raises(PoolExhaustedError):
        r.restore(tiny, t, MODEL.fingerprint)
    assert tiny.free_pages == 3 and tiny.routes() == []


def test_cancelled_restore_leaves_no_route(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(100)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    cancel = threading.Event()
    cancel.set()
    with Restorer(cat, [local]) as r, pytest.raises(RestoreError, match="cancelled"):
        r.restore(dst, t, MODEL.fingerprint, cancel=cancel)
    assert dst.free_pages == 64 and dst.routes() == []
    dst.check_invariants()


def test_report_and_rates(cat: Catalog, local: ChunkStore) -> None:
    pool, route, t = computed(100)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [local]) as r:
        res = r.restore(dst, t, MODEL.fingerprint)
        assert r.tier_rates["local"] > 0
    rep = res.report
    assert rep.chunks == 4 and rep.replicas_used == {local.name: 4}
    assert {"lookup", "fetch+verify", "copy", "total"} <= set(rep.seconds)


class Device(Delegating):
    """A store whose reads either hash a 2 MiB buffer first (`waits` False: work on a core,
    outside the GIL, as hashing and copying from the page cache are) or wait 20 ms first
    (`waits` True: a device the reads wait on)."""

    WORK = bytes(2 << 20)

    def __init__(self, inner: ChunkStore) -> None:
        super().__init__(inner)
        self.waits = False

    def get(self, key: str) -> Any:
        if self.waits:
            time.sleep(0.02)
        else:
            blake3.blake3(self.WORK, max_threads=1).digest()
        return self.inner.get(key)


def test_local_lanes_follow_whether_reads_work_or_wait(cat: Catalog, local: ChunkStore) -> None:
    """Local chunks are read `max_parallel` at a time before any read of the tier and while
    reads mostly wait (on a device: more in flight keep it busy), and as many at a time as
    the cores while reads keep their core busy (the page cache: each lane hashes and copies,
    and more lanes than cores only take turns on them)."""
    cores = usable_cores()
    wide = cores + 2  # more lanes than cores, on any machine
    n = CHUNK * 2 * wide + 1
    pool = PagePool(MODEL.layout, page_size=16, num_pages=n // 16 + 2)
    route = pool.new_route()
    t = tokens(n)
    MODEL.prefill(pool, route, t)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    store = Device(local)
    lanes = []
    with Restorer(cat, [store], max_parallel=wide) as r:
        for waits in (False, False, True, True):
            store.waits = waits
            dst = PagePool(MODEL.layout, page_size=16, num_pages=n // 16 + 2)
            res = r.restore(dst, t, MODEL.fingerprint)
            assert res.restored_tokens == n - 1
            assert pool.read(route, 0, n - 1)[0].tobytes() == dst.read(res.route)[0].tobytes()
            lanes.append(res.report.lanes)
    # No read yet; reads that work; the first that wait (the reads before say work); waiting.
    assert lanes == [{"local": k, "object": 0} for k in (wide, cores, cores, wide)]


@pytest.mark.parametrize(
    ("header_cache", "parses"), [(Restorer.DEFAULT_HEADER_CACHE, 4), (3, 8), (0, 8)]
)
def test_a_chunk_verified_before_is_not_parsed_again(
    cat: Catalog,
    local: ChunkStore,
    monkeypatch: pytest.MonkeyPatch,
    header_cache: int,
    parses: int,
) -> None:
    """A restorer keeps the headers of the chunks it verified (the key commits to every byte):
    restoring them again hashes and copies them but parses no header. It keeps `header_cache`
    of them, least recently used forgotten (so 4 chunks read in turn through 3 places always
    miss), 0 keeps none; the same bytes are restored either way."""
    pool, route, t = computed(100)
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    parsed: list[int] = []
    real_parse = record._parse
    monkeypatch.setattr(record, "_parse", lambda view: parsed.append(1) or real_parse(view))
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [local], max_parallel=1, header_cache=header_cache) as r:
        routes = []
        for _ in range(2):
            res = r.restore(dst, t, MODEL.fingerprint)
            assert res.restored_tokens == 99 and res.report.chunks == 4
            routes.append(res.route)
    assert len(parsed) == parses
    want = pool.read(route, 0, 99)
    for got in (dst.read(rt) for rt in routes):
        assert all(
            np.array_equal(x.view(np.uint8), y.view(np.uint8))
            for x, y in zip(got, want, strict=True)
        )


def test_a_directory_declared_object_tier_is_catalogued_as_object(
    cat: Catalog, tmp_path: Path
) -> None:
    # The tier comes from the store's configuration, whatever its kind or name.
    store = open_store(f"file://{tmp_path / 'nfs'}?tier=object")
    pool, route, t = computed(40)
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    match = cat.lookup("default", MODEL.fingerprint, t)
    assert match.chunks and {(r.location, r.tier) for c in match.chunks for r in c.replicas} == {
        (store.name, "object")
    }


class Overlap(Delegating):
    """Counts gets in flight; each waits until `width` are in flight at once (or 10 s)."""

    def __init__(self, inner: ChunkStore, width: int) -> None:
        super().__init__(inner)
        self.width = width
        self.peak = self._active = 0
        self._lock = threading.Lock()
        self._reached = threading.Event()

    def get(self, key: str) -> Any:
        with self._lock:
            self._active += 1
            self.peak = max(self.peak, self._active)
            if self._active >= self.width:
                self._reached.set()
        try:
            self._reached.wait(10)
            return self.inner.get(key)
        finally:
            with self._lock:
                self._active -= 1


@pytest.mark.parametrize(("tier", "width"), [("local", 2), ("object", 6)])
def test_object_tier_chunks_keep_more_fetches_in_flight_than_local_ones(
    cat: Catalog, tmp_path: Path, tier: str, width: int
) -> None:
    """Chunks read from an object store wait on the network, so `object_parallel` of them are
    fetched at once; chunks read from a local disk keep the cores busy, `max_parallel`."""
    store = Overlap(open_store(f"file://{tmp_path / 'blobs'}?tier={tier}"), width)
    pool, route, t = computed(8 * CHUNK + 1)
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, route, t, MODEL.fingerprint)
    dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, [store], max_parallel=2, object_parallel=6) as r:
        res = r.restore(dst, t, MODEL.fingerprint)
    assert res.restored_tokens == 8 * CHUNK and store.peak == width
    with pytest.raises(ValueError, match="object_parallel must be at least 1"):
        Restorer(cat, [store], object_parallel=0)
