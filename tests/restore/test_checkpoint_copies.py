"""A checkpoint copies the KV once: from the pool's pages into the record buffer the store writes from.

Issue 14: the scan for NaN/Inf reads the pages in place, the capture fills the
record's payload directly, and the store is handed that very buffer (hashed
in place, not joined into new bytes). Memory use follows: one record buffer
per chunk worker, reused by the next checkpoint, whatever the route's length.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog import AttentionLayout, Catalog, Fingerprint
from chunkstore import Receipt, open_store
from chunkstore.record import decode_chunk
from restore.checkpoint import Checkpointer
from restore.lease import Lease
from restore.pool import PagePool
from tests.store_wrappers import Delegating

LAYOUT = AttentionLayout(8, 4, 128, "float16")  # 16 KiB of KV per token
FP = Fingerprint.create(weights="copies", architecture="llama", config={}, attention_layout=LAYOUT)
CHUNK = 256  # a 4 MiB record, far above the interpreter's own allocations
MiB = 1 << 20


def address_range(obj: Any) -> tuple[int, int]:
    arr = np.frombuffer(obj, dtype=np.uint8)
    start = int(arr.ctypes.data)
    return start, start + arr.nbytes


class Watched:
    """A lease's snapshot that notes where its capture copies to and whether anything copies more."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.filled: list[tuple[int, int]] = []
        self.copies_made = 0
        self.scanned = 0

    @property
    def layout(self) -> AttentionLayout:
        return self.lease.layout

    @property
    def length(self) -> int:
        return self.lease.length

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        self.copies_made += 1  # a fresh array: a copy besides the record's
        return self.lease.read_kv(start, end)

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        self.filled.append(address_range(out))
        self.lease.read_kv_into(out, start, end)

    def check_finite(self, start: int, end: int) -> None:
        self.scanned += end - start
        self.lease.check_finite(start, end)


class Recording(Delegating):
    """Notes the memory every blob is written from."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.written: list[tuple[int, int]] = []

    def put(self, key: str, data: Any) -> Receipt:
        self.written.append(address_range(data))
        return self.inner.put(key, data)

    def put_hashed(self, key: str, data: Any) -> Receipt:
        self.written.append(address_range(data))
        return self.inner.put_hashed(key, data)


def filled_pool(tokens: int, seed: int) -> tuple[PagePool, int]:
    pool = PagePool(LAYOUT, page_size=16, num_pages=tokens // 16 + 2)
    rng = np.random.default_rng(seed)
    shape = (LAYOUT.num_layers, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    route = pool.new_route()
    pool.append(
        route, *(rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in "kv")
    )
    return pool, route


@pytest.fixture
def cat(tmp_path: Path) -> Any:
    c = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    yield c
    c.close()


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_store_writes_from_the_buffer_the_capture_filled(
    tmp_path: Path, cat: Catalog, parallel: int
) -> None:
    n = 3 * CHUNK + 40  # three whole chunks and a partial one
    pool, route = filled_pool(n, seed=1)
    tokens = np.random.default_rng(2).integers(0, 50_000, n).tolist()
    store = Recording(open_store(f"file://{tmp_path / 'blobs'}"))
    with (
        pool.lease(route) as lease,
        Checkpointer(cat, store, chunk_size=CHUNK, parallel=parallel) as cp,
    ):
        snap = Watched(lease)
        result = cp.checkpoint_snapshot(snap, tokens, FP)
        expected = lease.read_kv(0, n)
    assert result.new_chunks == 4
    assert snap.copies_made == 0  # no intermediate array of the KV
    assert snap.scanned == n  # NaN/Inf checked on the pages themselves
    assert len(snap.filled) == len(store.written) == 4
    # Each blob is written from the memory its payload was gathered into, just behind the header.
    for lo, hi in snap.filled:
        assert any(wlo < lo and hi == whi for wlo, whi in store.written)
    # ... and what landed is the pool's KV, in records that check themselves.
    got = []
    for key in store.inner.keys():
        chunk = decode_chunk(bytes(store.inner.get(key)), expected_key=key)
        got.append((chunk.header.token_start, chunk.kv))
    kv = np.concatenate([c for _, c in sorted(got, key=lambda x: x[0])], axis=2)
    assert np.array_equal(kv.view(np.uint16), expected.view(np.uint16))


def test_a_checkpoint_holds_one_record_buffer_per_worker_and_reuses_it(
    tmp_path: Path, cat: Catalog
) -> None:
    n = 6 * CHUNK
    pool, route = filled_pool(n, seed=3)
    record = LAYOUT.bytes_per_token * CHUNK  # 4 MiB of KV per chunk
    store = open_store(f"file://{tmp_path / 'blobs'}")
    with Checkpointer(cat, store, chunk_size=CHUNK, parallel=1) as warm:
        warm.checkpoint(
            pool, route, list(range(n)), FP
        )  # the interpreter's and catalog's first use
    with Checkpointer(cat, store, chunk_size=CHUNK, parallel=1) as cp:
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            cp.checkpoint(pool, route, list(range(1, n + 1)), FP)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            at, _ = tracemalloc.get_traced_memory()
            cp.checkpoint(pool, route, list(range(2, n + 2)), FP)
            _, peak_again = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Six new chunks went through; at no time was more than one KV-sized buffer alive
    # (the old way held the captured array and the joined record at once: 2x).
    assert record <= peak - before < record + 2 * MiB
    # The next checkpoint builds its records in the same buffer: nothing KV-sized is allocated.
    assert peak_again - at < MiB


def test_a_transformers_checkpoint_copies_the_cache_once(
    tmp_path: Path, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HFAdapter.checkpoint: the cache's tensors are read in place (scan and capture) and
    copied once, into the record buffer each blob is written from; no KV-sized array
    besides the record buffers of the chunk workers is made."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from restore.engines.hf import HFAdapter
    from restore.engines.hf.cache import CacheSnapshot
    from tests.restore.engines.hf_worker import prefill

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,  # 16 KiB of float32 KV per position: a 4 MiB record per chunk
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    n = 2 * CHUNK + 40
    ids = np.random.default_rng(4).integers(1, 127, n + 1).tolist()
    cache = prefill(model, ids[:n])
    record = 16 * 1024 * CHUNK
    filled: list[tuple[int, int]] = []
    read_into = CacheSnapshot.read_kv_into

    def noted(self: CacheSnapshot, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        filled.append(address_range(out))
        read_into(self, out, start, end)

    def copied(self: CacheSnapshot, start: int, end: int) -> np.ndarray[Any, Any]:
        raise AssertionError("the checkpoint made an intermediate copy of the KV (read_kv)")

    monkeypatch.setattr(CacheSnapshot, "read_kv_into", noted)
    monkeypatch.setattr(CacheSnapshot, "read_kv", copied)
    store = Recording(open_store(f"file://{tmp_path / 'blobs'}"))
    with HFAdapter(model, cat, [store], chunk_size=CHUNK, weights_id="copies") as kv:
        other = [t + 1 for t in ids[: CHUNK + 1]]
        kv.checkpoint(other, prefill(model, other[:CHUNK]))  # first use of everything
        store.written.clear()
        filled.clear()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            result = kv.checkpoint(ids, cache)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        restored, got = kv.restore(ids)
    assert result.new_chunks == 3 and got == n
    assert len(filled) == len(store.written) == 3
    for lo, hi in filled:  # each blob written from the memory the cache was copied into
        assert any(wlo < lo and hi == whi for wlo, whi in store.written)
    workers = min(2, os.cpu_count() or 1)
    assert peak - before < workers * record + 2 * MiB  # nothing KV-sized besides the records
    for a, b in zip(cache.layers, restored.layers, strict=True):
        assert torch.equal(a.keys.view(torch.int32), b.keys.view(torch.int32))
        assert torch.equal(a.values.view(torch.int32), b.values.view(torch.int32))
