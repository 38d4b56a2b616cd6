"""A publisher SIGKILLed at each step of the ordered publish, on SQLite/PostgreSQL x local/S3.

After each crash: the catalog points only at durable bytes (fsck clean), nothing
half-published is visible, what is catalogued restores exactly, GC keeps young
orphans and reclaims them once past the grace period, and re-running the
publish succeeds and is idempotent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from catalog import Catalog
from chunkstore import ChunkStore, open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ReferenceModel.small(seed=0)
TOKENS = np.random.default_rng(3).integers(0, MODEL.vocab_size, 100).tolist()
STEPS = ["after_encode", "during_put", "after_put", "in_txn"]


@pytest.fixture(
    params=[("sqlite", "local"), ("sqlite", "s3"), ("postgres", "local"), ("postgres", "s3")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    db, kind = request.param
    url = (
        f"sqlite:///{tmp_path / 'c.db'}"
        if db == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    store_url = (
        f"file://{tmp_path / 'blobs'}" if kind == "local" else request.getfixturevalue("s3_url")
    )
    Catalog.open(url, upgrade=True).close()
    yield url, store_url


def crash_at(step: str, url: str, store_url: str, tmp: Path) -> None:
    marker = tmp / f"marker-{step}"
    args = {
        "catalog": url,
        "store": store_url,
        "step": step,
        "marker": str(marker),
        "tokens": TOKENS,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.restore.crash_worker", json.dumps(args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"publisher exited before {step}: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"publisher never reached {step}")
        time.sleep(0.02)
    assert marker.read_text() != "finished"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    if proc.stderr:
        proc.stderr.close()


def catalogued(cat: Catalog) -> list[tuple[str, str, int]]:
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.blob_key, r.location, r.size FROM replicas r JOIN chunks c ON c.blob_key = r.blob_key"
            )
        ).all()
    return [(k, loc, size) for k, loc, size in rows]


def kvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "kvc"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVC_")},
    )


def straight_kv() -> tuple[np.ndarray, np.ndarray]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    r = pool.new_route()
    MODEL.prefill(pool, r, TOKENS)
    return pool.read(r, 0, 99)


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_step(step: str, backend: tuple[str, str], tmp_path: Path) -> None:
    url, store_url = backend
    crash_at(step, url, store_url, tmp_path)
    cat = Catalog.open(url)
    store: ChunkStore = open_store(store_url)
    try:
        # P1: every catalogued replica's bytes are in the store, whole.
        rows = catalogued(cat)
        for key, location, size in rows:
            assert location == store.name and store.stat(key).size == size
        # P3: the batch was one transaction: all four chunks or none (none here: each
        # step is before the commit), and no ref.
        assert rows == []
        assert cat.stats()["chunks"] == 0 and cat.list_refs("default") == []
        # Orphans: young ones survive GC; past the grace period they are reclaimed.
        orphans = set(store.keys())
        # Before the first put nothing is visible (a local put interrupted before its
        # rename leaves only an unlisted temp file); after the puts, all four blobs.
        assert (
            len(orphans) == {"after_encode": 0, "during_put": 0, "after_put": 4, "in_txn": 4}[step]
        )
        young = kvc("gc", "--catalog", url, "--store", store_url, "--json")
        assert young.returncode == 0, young.stderr
        assert set(store.keys()) == orphans
        old = kvc("gc", "--catalog", url, "--store", store_url, "--grace", "0", "--json")
        assert old.returncode == 0, old.stderr
        assert set(store.keys()) == set()
        # Re-running the publish succeeds, then again changes nothing.
        pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
        r = pool.new_route()
        MODEL.prefill(pool, r, TOKENS)
        with Checkpointer(cat, store, chunk_size=32) as cp:
            first = cp.checkpoint(pool, r, TOKENS, MODEL.fingerprint, name="crash")
            again = cp.checkpoint(pool, r, TOKENS, MODEL.fingerprint, name="crash")
        assert (first.new_chunks, again.new_chunks) == (4, 0)
        # What is catalogued restores exactly.
        dst = PagePool(MODEL.layout, page_size=16, num_pages=64)
        with Restorer(cat, [store]) as rs:
            res = rs.restore(dst, TOKENS, MODEL.fingerprint)
        assert res.route is not None and res.restored_tokens == 99
        want = straight_kv()
        got = dst.read(res.route)
        assert all(
            np.array_equal(a.view(np.uint8), b.view(np.uint8))
            for a, b in zip(want, got, strict=True)
        )
        fsck = kvc("fsck", "--catalog", url, "--store", store_url, "--read-data", "--json")
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        store.close()
        cat.close()
