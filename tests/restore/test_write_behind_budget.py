"""The write-behind queue is bounded by bytes: a hung object store cannot make the process grow.

A fault proxy in front of the real S3 server (SeaweedFS) holds every PUT.
While it does, the encoded bytes of uploads admitted and not yet put never
exceed the budget; speculative captures past it keep their catalogued local
replica and get no object copy (counted: `write_behind_budget`); an explicit
checkpoint waits for room and is refused (`CheckpointBusyError`, nothing
stored) when none comes in time, or goes through once the store moves again.
Once the proxy lets the PUTs through every admitted upload lands and is
catalogued. The process's resident memory grows by less than the budget plus
RSS_SLACK while ~16 times the budget passes through.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import psutil
import pytest
import sqlalchemy as sa

from catalog import Catalog
from chunkstore import ChunkStore, Receipt, open_store
from chunkstore.errors import StoreUnavailableError
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceConfig, ReferenceModel
from restore.errors import CheckpointBusyError
from restore.pool import AttentionLayout
from tests.fault_proxy import FaultProxy
from tests.services import S3Server
from tests.store_wrappers import Delegating

# float32, 8 layers x 8 kv heads x 64: 32 KiB of KV per token, so a chunk of 32
# tokens is a 1 MiB blob and memory effects stand out from the interpreter's noise.
MODEL = ReferenceModel(
    ReferenceConfig(hidden=512, num_heads=8, num_kv_heads=8, num_layers=8, kv_dtype="float32"),
    seed=0,
)
CHUNK = 32
CHUNKS_PER_ROUTE = 4
MiB = 1 << 20
BUDGET = 8 * MiB
ROUTES = 32  # 128 chunks, 128 MiB: 16 budgets
# What the process may grow by beyond the budget: the blob being encoded and put
# locally, the two the upload threads hand to boto3 (and its copies), allocator
# slack. Without the bound it would grow by at least the 120 MiB past the budget.
RSS_SLACK = 48 * MiB


class RandomKV:
    """A KVSnapshot of `length` positions of seeded random KV, made on each read (holds nothing)."""

    def __init__(self, layout: AttentionLayout, length: int, seed: int) -> None:
        self._layout = layout
        self._length = length
        self._seed = seed

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return self._length

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        lay = self._layout
        rng = np.random.default_rng((self._seed, start, end))
        shape = (lay.num_layers, 2, end - start, lay.num_kv_heads, lay.head_dim)
        return rng.standard_normal(shape, dtype=np.float32)


def route(seed: int) -> tuple[RandomKV, list[int]]:
    n = CHUNK * CHUNKS_PER_ROUTE
    tokens = np.random.default_rng(seed).integers(0, MODEL.vocab_size, n).tolist()
    return RandomKV(MODEL.layout, n, seed), tokens


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Sampler:
    """Samples the Checkpointer's pending write-behind bytes and the process RSS until stopped."""

    def __init__(self, cp: Checkpointer) -> None:
        self._cp = cp
        self._proc = psutil.Process()
        self.rss_before = self._proc.memory_info().rss
        self.max_pending = 0
        self.max_rss = self.rss_before
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.max_pending = max(self.max_pending, self._cp.write_behind_pending_bytes)
            self.max_rss = max(self.max_rss, self._proc.memory_info().rss)
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def replicas(cat: Catalog) -> dict[str, set[str]]:
    """blob key -> the tiers of its durable replicas."""
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT blob_key, tier FROM replicas WHERE state = 'durable'")
        ).all()
    out: dict[str, set[str]] = {}
    for key, tier in rows:
        out.setdefault(key, set()).add(tier)
    return out


@pytest.fixture
def proxied(s3_server: S3Server) -> Iterator[tuple[FaultProxy, ChunkStore, ChunkStore]]:
    """A proxy in front of the S3 server, a store through it and one straight to the server."""
    srv = s3_server
    if not srv.endpoint_url.startswith("http://"):
        pytest.skip(f"the fault proxy speaks plain HTTP; the S3 endpoint is {srv.endpoint_url}")
    session = boto3.session.Session(
        aws_access_key_id=srv.access_key, aws_secret_access_key=srv.secret_key
    )
    prefix = f"wb-{uuid.uuid4().hex[:12]}"
    # One attempt and a read timeout far past the test: a held PUT is neither
    # timed out nor sent twice.
    tuning = f"region={srv.region}&max_attempts=1&connect_timeout=5&read_timeout=300"
    with FaultProxy(srv.endpoint_url) as proxy:
        through = open_store(
            f"s3://{srv.bucket}/{prefix}?endpoint_url={proxy.url}&{tuning}", session=session
        )
        direct = open_store(
            f"s3://{srv.bucket}/{prefix}?endpoint_url={srv.endpoint_url}&{tuning}",
            session=session,
        )
        try:
            yield proxy, through, direct
        finally:
            proxy.release()
            through.close()
            direct.close()


def test_a_hung_object_store_holds_at_most_the_budget(
    proxied: tuple[FaultProxy, ChunkStore, ChunkStore], tmp_path: Path
) -> None:
    proxy, s3, direct = proxied
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    local = open_store(f"file://{tmp_path / 'local'}")
    proxy.inject("hold", method="PUT", times=None)
    cp = Checkpointer(cat, local, chunk_size=CHUNK, write_behind=s3, write_behind_bytes=BUDGET)
    sampler = Sampler(cp)
    try:
        # Speculative captures, one at a time: every local put goes through, the
        # uploads fill the budget and every one past it is dropped, counted.
        for seed in range(ROUTES):
            snap, tokens = route(seed)
            fut = cp.submit_snapshot(snap, tokens, MODEL.fingerprint)
            assert fut is not None
            assert fut.result(timeout=60).new_chunks == CHUNKS_PER_ROUTE
        wait_for(lambda: proxy.held() == 2, "both upload threads to be held at the proxy")
        blob = max(local.stat(k).size for k in local.keys())
        total = ROUTES * CHUNKS_PER_ROUTE
        full = cp.write_behind_pending_bytes
        assert BUDGET - blob < full <= BUDGET  # full: no further blob fits
        admitted = total - cp.dropped["write_behind_budget"]
        assert cp.dropped == {"write_behind_budget": total - admitted} and admitted >= 2
        # Every chunk is catalogued with its local replica; nothing has an object one yet.
        assert cat.stats()["chunks"] == total
        assert all(t == {"local"} for t in replicas(cat).values())

        # An explicit checkpoint waits for room; none comes in time: refused, nothing stored.
        stored = sorted(local.keys())
        cp.write_behind_wait_s = 0.2
        snap, tokens = route(1000)
        with pytest.raises(CheckpointBusyError, match="write-behind uploads busy"):
            cp.checkpoint_snapshot(snap, tokens, MODEL.fingerprint, name="explicit")
        assert sorted(local.keys()) == stored and cat.stats()["chunks"] == total
        assert cp.write_behind_pending_bytes == full

        # With a longer wait it goes through once the store moves again.
        cp.write_behind_wait_s = 120
        outcome: list[object] = []

        def explicit() -> None:
            try:
                outcome.append(cp.checkpoint_snapshot(snap, tokens, MODEL.fingerprint, name="x"))
            except BaseException as exc:  # reported to the test thread
                outcome.append(exc)

        waiter = threading.Thread(target=explicit)
        waiter.start()
        assert cp.write_behind_pending_bytes == full
        proxy.release()
        waiter.join(120)
        assert not waiter.is_alive() and len(outcome) == 1, outcome
        assert getattr(outcome[0], "new_chunks", None) == CHUNKS_PER_ROUTE, outcome
        cp.close()  # drains the uploads
    finally:
        sampler.stop()
        proxy.release()
        cp.close()
    assert cp.write_behind_pending_bytes == 0
    assert sampler.max_pending <= BUDGET and sampler.samples > 0
    # Every admitted upload (and the explicit checkpoint's) landed and is catalogued.
    reps = replicas(cat)
    uploaded = {k for k, tiers in reps.items() if tiers == {"local", "object"}}
    assert len(reps) == ROUTES * CHUNKS_PER_ROUTE + CHUNKS_PER_ROUTE
    assert len(uploaded) == admitted + CHUNKS_PER_ROUTE
    assert all(direct.exists(k) for k in uploaded)
    assert cp.dropped == {"write_behind_budget": ROUTES * CHUNKS_PER_ROUTE - admitted}
    growth = sampler.max_rss - sampler.rss_before
    print(
        f"\nwrite-behind budget {BUDGET / MiB:.0f} MiB, {ROUTES * CHUNKS_PER_ROUTE} blobs of "
        f"{blob / MiB:.2f} MiB: max pending {sampler.max_pending / MiB:.2f} MiB, "
        f"RSS grew {growth / MiB:.1f} MiB ({sampler.samples} samples)"
    )
    assert growth < BUDGET + RSS_SLACK
    local.close()
    cat.close()


# -- every path gives its room back (a wrapped local store; no server needed) ---------


class Held(Delegating):
    """A store whose puts wait for `gate`, then fail when `fail` is set."""

    def __init__(self, inner: ChunkStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.fail = False

    def put(self, key: str, data: Any) -> Receipt:
        assert self.gate.wait(60), "never opened"
        if self.fail:
            raise StoreUnavailableError("the object store went away")
        return super().put(key, data)


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Catalog, ChunkStore, Held]]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    local = open_store(f"file://{tmp_path / 'local'}")
    remote = Held(open_store(f"file://{tmp_path / 'remote'}?tier=object"))
    yield cat, local, remote
    remote.gate.set()
    local.close()
    cat.close()


def test_failed_uploads_give_their_room_back(small: tuple[Catalog, ChunkStore, Held]) -> None:
    cat, local, remote = small
    remote.fail = True
    cp = Checkpointer(cat, local, chunk_size=CHUNK, write_behind=remote, write_behind_bytes=BUDGET)
    snap, tokens = route(1)
    cp.checkpoint_snapshot(snap, tokens, MODEL.fingerprint)
    assert 0 < cp.write_behind_pending_bytes <= BUDGET
    remote.gate.set()
    cp.close()
    assert cp.write_behind_pending_bytes == 0
    assert cp.dropped == {"write_behind_failed": CHUNKS_PER_ROUTE}


def test_an_explicit_checkpoint_refused_mid_publish_gives_its_room_back(
    small: tuple[Catalog, ChunkStore, Held],
) -> None:
    cat, local, remote = small
    # Room for two of the four blobs: the third waits, then the publish is refused.
    blob = CHUNK * MODEL.layout.bytes_per_token + 4096
    cp = Checkpointer(
        cat,
        local,
        chunk_size=CHUNK,
        write_behind=remote,
        write_behind_bytes=2 * blob,
        write_behind_wait_s=0.2,
    )
    snap, tokens = route(2)
    with pytest.raises(CheckpointBusyError):
        cp.checkpoint_snapshot(snap, tokens, MODEL.fingerprint)
    assert len(list(local.keys())) == 2 and cat.stats()["chunks"] == 0
    remote.gate.set()
    cp.close()
    assert cp.write_behind_pending_bytes == 0
    # The two uploads that went up are orphans of a failed publish, for GC.
    assert cp.dropped == {"write_behind_unpublished": 2}


def test_a_blob_larger_than_the_budget_goes_alone(small: tuple[Catalog, ChunkStore, Held]) -> None:
    cat, local, remote = small
    cp = Checkpointer(cat, local, chunk_size=CHUNK, write_behind=remote, write_behind_bytes=1)
    snap, tokens = route(3)
    fut = cp.submit_snapshot(snap, tokens, MODEL.fingerprint)
    assert fut is not None and fut.result(timeout=60).new_chunks == CHUNKS_PER_ROUTE
    assert cp.dropped == {"write_behind_budget": CHUNKS_PER_ROUTE - 1}
    remote.gate.set()
    cp.close()
    assert cp.write_behind_pending_bytes == 0
    assert sorted(replicas(cat).values(), key=len) == [{"local"}] * 3 + [{"local", "object"}]


def test_the_daemon_takes_its_budget_from_the_settings(
    small: tuple[Catalog, ChunkStore, Held], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvc.daemon import Daemon
    from kvc.settings import load

    monkeypatch.setenv("KVC_WRITE_BEHIND_BYTES", str(3 * MiB))
    assert load().write_behind_bytes == 3 * MiB
    cat, local, remote = small
    remote.gate.set()
    d = Daemon(
        cat,
        [local, remote],
        worker_id="wb",
        invalidation_interval=0,
        write_behind_bytes=load().write_behind_bytes,
    )
    try:
        assert d._checkpointer.write_behind_bytes == 3 * MiB
        assert d.stats()["write_behind_pending_bytes"] == 0
    finally:
        d.close()
