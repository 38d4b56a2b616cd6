"""Faults on the restore path: flipped bits, truncation, unreachable stores, a full disk.

Restore re-reads a blob that fails verification once (bits flipped in transit),
marks a replica corrupt only when it fails twice (bits flipped at rest), then
uses another replica, then stops at the longest verified prefix; nothing
unverified ever reaches a page. A local write that fails leaves nothing
catalogued.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import zstandard

from catalog import Catalog
from catalog.models import ChunkRecord
from chunkstore import ChunkStore, open_store
from chunkstore.errors import StoreUnavailableError
from chunkstore.record import (
    EncodedChunk,
    read_header,
)
from maintenance.fsck import fsck
from maintenance.rebuild_scan import scan_stores
from restore.checkpoint import Checkpointer
from restore.destination import PoolDestination
from restore.engines.reference import ReferenceModel
from restore.errors import PoolExhaustedError
from restore.pool import PagePool
from restore.restore import Restorer
from restore.write_behind import to_replica_receipt
from tests.records import forge
from tests.store_wrappers import Delegating

ROOT = Path(__file__).resolve().parents[2]
MODEL = ReferenceModel.small(seed=0)
TOKENS = np.random.default_rng(4).integers(0, MODEL.vocab_size, 100).tolist()


class Faulty(Delegating):
    """Wraps a store and damages what `get` returns, per key and per mode."""

    def __init__(self, inner: ChunkStore) -> None:
        super().__init__(inner)
        self.modes: dict[str, str] = {}
        self.reads: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            n = self.reads[key] = self.reads.get(key, 0) + 1
        mode = self.modes.get(key)
        data = bytes(self.inner.get(key))
        if mode == "unavailable":
            raise StoreUnavailableError(f"{self.name}: connection reset while reading {key}")
        if mode == "flip_always" or (mode == "flip_first" and n == 1):
            b = bytearray(data)
            b[len(b) // 3] ^= 0x10
            return bytes(b)
        if mode == "truncate":
            return data[: len(data) // 2]
        return data


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Catalog, Faulty, Faulty, list[str]]]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    a = Faulty(open_store(f"file://{tmp_path / 'a'}"))
    b = Faulty(open_store(f"file://{tmp_path / 'b'}"))
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    r = pool.new_route()
    MODEL.prefill(pool, r, TOKENS)
    with Checkpointer(cat, a, chunk_size=32, write_behind=None) as cp:
        cp.checkpoint(pool, r, TOKENS, MODEL.fingerprint)
    keys = [c.blob_key for c in cat.lookup("default", MODEL.fingerprint, TOKENS).chunks]
    yield cat, a, b, keys
    cat.close()


def restore(cat: Catalog, stores: list[ChunkStore]) -> tuple[Any, PagePool]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(cat, stores) as r:
        return r.restore(pool, TOKENS, MODEL.fingerprint), pool


def expected_kv(n: int) -> tuple[np.ndarray, np.ndarray]:
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    r = pool.new_route()
    MODEL.prefill(pool, r, TOKENS)
    return pool.read(r, 0, n)


def assert_exact(res: Any, pool: PagePool) -> None:
    got = pool.read(res.route)
    want = expected_kv(res.restored_tokens)
    assert all(
        np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(got, want, strict=True)
    )


def states(cat: Catalog, key: str) -> list[str]:
    with cat.engine.connect() as conn:
        return list(
            conn.exec_driver_sql("SELECT state FROM replicas WHERE blob_key = ?", (key,)).scalars()
        )


def test_bits_flipped_on_the_first_read_only_are_read_again(setup: Any) -> None:
    cat, a, _, keys = setup
    a.modes[keys[1]] = "flip_first"
    res, pool = restore(cat, [a])
    assert res.restored_tokens == 99 and a.reads[keys[1]] == 2
    assert states(cat, keys[1]) == ["durable"]  # a transient flip does not condemn the replica
    assert_exact(res, pool)


@pytest.mark.parametrize("mode", ["flip_always", "truncate"])
def test_damage_at_rest_uses_another_replica(setup: Any, mode: str) -> None:
    cat, a, b, keys = setup
    for k in keys:  # a second replica of every chunk, in store b
        cat.record_replica(k, to_replica_receipt(b.put(k, a.inner.get(k)), "local"))
    a.modes[keys[2]] = mode
    res, pool = restore(cat, [a, b])
    assert res.restored_tokens == 99
    assert res.report.replicas_used.get(b.name) == 1
    with cat.engine.connect() as conn:
        st = dict(
            conn.exec_driver_sql(
                "SELECT location, state FROM replicas WHERE blob_key = ?", (keys[2],)
            ).all()
        )
    assert st == {a.name: "corrupt", b.name: "durable"}
    assert_exact(res, pool)


def test_no_good_replica_degrades_to_the_verified_prefix(setup: Any) -> None:
    cat, a, _, keys = setup
    a.modes[keys[2]] = "flip_always"
    res, pool = restore(cat, [a])
    assert res.restored_tokens == 64 and res.recompute_from == 64
    assert pool.free_pages == 64 - 4
    assert_exact(res, pool)


def test_unreachable_store_marks_nothing_and_degrades(setup: Any) -> None:
    cat, a, _, keys = setup
    a.modes[keys[0]] = "unavailable"
    res, pool = restore(cat, [a])
    assert res.route is None and pool.free_pages == 64 and pool.routes() == []
    assert states(cat, keys[0]) == ["durable"]


def test_a_failing_local_disk_write_catalogues_nothing(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes writes past a small size fail with EFBIG (SIGXFSZ ignored).
    code = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from catalog import Catalog
from chunkstore import open_store
from restore.checkpoint import Checkpointer
from restore.write_behind import to_replica_receipt
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
args = json.loads(sys.argv[1])
model = ReferenceModel.small(seed=0)
pool = PagePool(model.layout, page_size=16, num_pages=64)
r = pool.new_route()
model.prefill(pool, r, args["tokens"])
cat = Catalog.open(args["catalog"])
store = open_store(args["store"])
cp = Checkpointer(cat, store, chunk_size=32)  # creates the namespace: a catalog write
cat.stats()
# From here on no file may grow past 8 KiB; every blob is 16 KiB.
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
try:
    cp.checkpoint(pool, r, args["tokens"], model.fingerprint, name="x")
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Catalog.open(url, upgrade=True).close()
    args = {"catalog": url, "store": f"file://{tmp_path / 'blobs'}", "tokens": TOKENS}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert "StoreWriteError" in out.stdout
    cat = Catalog.open(url)
    assert cat.stats()["chunks"] == 0 and cat.list_refs("default") == []
    cat.close()
    assert list(open_store(f"file://{tmp_path / 'blobs'}").keys()) == []


@pytest.mark.parametrize("mode", ["flip_always", "truncate"])
def test_damage_after_a_restore_kept_the_headers_is_still_found(setup: Any, mode: str) -> None:
    """A restorer that verified a chunk before takes its header as known, but only for bytes
    that hash to its key again: damage done since is caught as on a first read."""
    cat, a, b, keys = setup
    for k in keys:
        cat.record_replica(k, to_replica_receipt(b.put(k, a.inner.get(k)), "local"))
    with Restorer(cat, [a, b]) as r:
        first = r.restore(
            PagePool(MODEL.layout, page_size=16, num_pages=64), TOKENS, MODEL.fingerprint
        )
        assert first.restored_tokens == 99 and first.report.replicas_used == {a.name: 4}
        a.modes[keys[2]] = mode
        pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
        res = r.restore(pool, TOKENS, MODEL.fingerprint)
    assert res.restored_tokens == 99 and res.report.replicas_used == {a.name: 3, b.name: 1}
    assert sorted(states(cat, keys[2])) == ["corrupt", "durable"]
    assert_exact(res, pool)


def rle_zstd_frame(size: int) -> bytes:
    """A valid zstd frame of `size` zero bytes made of RLE blocks: 4 bytes per 128 KiB."""
    frame = bytearray(b"\x28\xb5\x2f\xfd\xe0" + size.to_bytes(8, "little"))  # single segment
    left = size
    while left:
        n = min(left, 1 << 17)
        left -= n
        frame += ((left == 0) | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\x00"
    return bytes(frame)


def record(header: Any, payload: bytes) -> EncodedChunk:
    """A record of `header` (whatever it says) over `payload`, under its own key."""
    data = forge(header.to_json(), payload)
    return EncodedChunk(key=blake3.blake3(data).hexdigest(), data=data, header=header)


def forged_record(real: bytes, head_dim: int) -> EncodedChunk:
    """`real`'s header with a head dim of `head_dim`, over a zstd bomb that decodes to it."""
    h = read_header(real)
    shape = (*h.shape[:4], head_dim)
    payload = rle_zstd_frame(math.prod(shape) * h.numpy_dtype.itemsize)
    header = dataclasses.replace(
        h,
        shape=shape,
        codec="zstd",
        payload_size=len(payload),
        stored_blake3=blake3.blake3(payload).hexdigest(),
        payload_blake3="0" * 64,  # whatever: the decoder would allocate before checking it
    )
    return record(header, payload)


def test_rle_zstd_frame_is_a_real_frame() -> None:
    """The bomb below is a frame zstd decodes, so only the header check stands in its way."""
    frame = rle_zstd_frame(3 << 17)
    assert len(frame) == 13 + 3 * 4
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes(3 << 17)


def plant(
    cat: Catalog, a: Any, tmp_path: Path, blobs: dict[int, tuple[str, bytes]]
) -> Catalog:
    """A catalog (of its own) of `cat`'s chunks of TOKENS, chunk i catalogued over the blob
    `blobs[i]` (key, bytes: stored beside the real chunks) where given."""
    planted = Catalog.open(f"sqlite:///{tmp_path / 'planted.db'}", upgrade=True)
    planted.ensure_namespace("default", chunk_size=32)
    planted.register_fingerprint(MODEL.fingerprint)
    match = cat.lookup("default", MODEL.fingerprint, TOKENS)
    records = []
    for i, c in enumerate(match.chunks):
        key, data = blobs.get(i) or (c.blob_key, bytes(a.inner.get(c.blob_key)))
        records.append(
            ChunkRecord(
                namespace="default",
                fingerprint=MODEL.fingerprint,
                prefix_hash=c.prefix_hash,
                parent_hash=c.parent_hash,
                token_start=c.token_start,
                tokens=TOKENS[c.token_start : c.token_start + c.token_count],
                shard=match.shard,
                blob_key=key,
                codec=read_header(data).codec,
                stored_bytes=len(data),
                kv_bytes=c.kv_bytes,
                receipts=[to_replica_receipt(a.inner.put(key, data), "local")],
            )
        )
    planted.record_chunks(records)
    return planted


def plant_bomb(
    cat: Catalog, a: Any, keys: list[str], tmp_path: Path
) -> tuple[Catalog, EncodedChunk]:
    """A catalog (of its own) whose chunk 1 is a ~8 KiB record declaring a 256 MiB payload,
    stored under its own key beside the real chunks."""
    real = bytes(a.inner.get(keys[1]))
    bomb = forged_record(real, head_dim=1 << 18)  # 4 x 2 x 32 x 2 x 262144 fp16 = 256 MiB
    assert len(bomb.data) < 16 << 10 and bomb.header.raw_size == 256 << 20
    return plant(cat, a, tmp_path, {1: (bomb.key, bomb.data)}), bomb


@pytest.mark.parametrize("header_cache", [0, Restorer.DEFAULT_HEADER_CACHE])
def test_a_blob_catalogued_as_another_chunk_is_refused(
    setup: Any, tmp_path: Path, header_cache: int
) -> None:
    """A catalog row for chunk 2 over chunk 1's blob: bytes that hash to their key, but not
    the chunk promised. The restore stops before chunk 2, whether chunk 1's header is parsed
    again or known from the chunk before (one lane: chunk 1 is verified first)."""
    cat, a, _, keys = setup
    planted = plant(cat, a, tmp_path, {2: (keys[1], bytes(a.inner.get(keys[1])))})
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    with Restorer(planted, [a], max_parallel=1, header_cache=header_cache) as r:
        res = r.restore(pool, TOKENS, MODEL.fingerprint)
    assert res.restored_tokens == 64 and res.recompute_from == 64
    assert any(
        "disagrees with the catalog: prefix or parent hash, token range" in f
        for f in res.report.failures
    ), res.report.failures
    assert_exact(res, pool)
    planted.close()


FORGERIES: dict[str, Any] = {  # what a planted header changes, by the problem it shows
    "token ids": lambda h: {"tokens": (h.tokens[0] + 1, *h.tokens[1:])},
    "token range": lambda h: {"token_start": h.token_start + 32},
    "shard": lambda h: {"layers": (h.layers[0] + 1, h.layers[1] + 1)},
    "fingerprint": lambda h: {"fingerprint": "f" * 64},
}


@pytest.mark.parametrize("problem", sorted(FORGERIES))
def test_a_blob_whose_header_is_not_the_chunk_promised_is_refused_known_or_not(
    setup: Any, tmp_path: Path, problem: str
) -> None:
    """Chunk 2's header with one field changed, over chunk 2's payload, catalogued as chunk 2:
    bytes that hash to their key, declaring another chunk than the one promised. Refused on
    the first read, and again once its header is known (the replica marked usable again by
    hand in between), naming what disagrees."""
    cat, a, _, keys = setup
    real = bytes(a.inner.get(keys[2]))
    h = read_header(real)
    header = dataclasses.replace(h, **FORGERIES[problem](h))
    forged = record(header, real[len(real) - h.payload_size :])
    assert read_header(forged.data) == header  # a well-formed record
    planted = plant(cat, a, tmp_path, {2: (forged.key, forged.data)})
    with Restorer(planted, [a]) as r:
        for _ in range(2):
            pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
            res = r.restore(pool, TOKENS, MODEL.fingerprint)
            assert res.restored_tokens == 64 and res.recompute_from == 64
            assert any(
                f"disagrees with the catalog: {problem}" in f for f in res.report.failures
            ), res.report.failures
            assert_exact(res, pool)
            assert states(planted, forged.key) == ["corrupt"]
            planted.mark_replica(forged.key, a.name, "durable", reason="put back by hand")
    planted.close()


def test_a_planted_blob_declaring_a_huge_payload_is_refused_from_its_header(
    setup: Any, tmp_path: Path
) -> None:
    """A tenant plants a ~8 KiB record under its own key whose header declares a 256 MiB
    payload (a zstd frame of RLE blocks, the 32768x a frame can honestly expand) and
    catalogues it as chunk 1. The restore refuses it from the header, against the
    fingerprint's layout, before decoding: no 256 MiB allocation, the replica is marked
    corrupt and the caller recomputes from chunk 1."""
    cat, a, _, keys = setup
    planted, bomb = plant_bomb(cat, a, keys, tmp_path)
    tracemalloc.start()
    try:
        res, pool = restore(planted, [a])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"the restore allocated {peak} bytes for a planted record"
    assert res.restored_tokens == 32 and res.recompute_from == 32
    assert_exact(res, pool)
    assert states(planted, bomb.key) == ["corrupt"]
    assert any("declares shape" in f for f in res.report.failures), res.report.failures
    planted.close()


def test_fsck_and_rebuild_refuse_a_planted_blob_from_its_header(
    setup: Any, tmp_path: Path
) -> None:
    """The maintenance jobs that read whole blobs (`fsck --read-data`, a verifying rebuild)
    check a header against its fingerprint's layout before decoding too."""
    cat, a, _, keys = setup
    planted, bomb = plant_bomb(cat, a, keys, tmp_path)
    tracemalloc.start()
    try:
        report = fsck(planted, [a.inner], read_data=True, repair=False)
        scan = scan_stores(
            [a.inner],
            verify=True,
            layout_of=lambda h: MODEL.layout if h == MODEL.fingerprint.hex else None,
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"fsck or rebuild allocated {peak} bytes for a planted record"
    assert [p.blob_key for p in report.corrupt] == [bomb.key]
    assert "declares shape" in report.corrupt[0].reason
    assert report.ok == report.checked - 1
    assert list(scan.damaged) == [bomb.key] and bomb.key not in scan.blobs
    assert set(scan.blobs) >= {k for k in keys if k != keys[1]}
    planted.close()


class Recording(PoolDestination):
    """A pool destination that records the order of the calls a restore makes into it."""

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self.calls: list[str] = []
        self._calls_lock = threading.Lock()

    def _note(self, call: str) -> None:
        with self._calls_lock:
            self.calls.append(call)

    def reserve(self, tokens: int) -> None:
        self._note("reserve")
        super().reserve(tokens)

    def write(self, kv: Any, start: int, count: int) -> None:
        self._note("write")
        super().write(kv, start, count)

    def commit(self, tokens: int) -> None:
        self._note("commit")
        super().commit(tokens)

    def abort(self) -> None:
        self._note("abort")
        super().abort()


@pytest.mark.parametrize("width", [1, 4])
def test_the_destination_is_reserved_once_before_any_write(setup: Any, width: int) -> None:
    """One reserve, before every write, then one commit; with nothing verified, reserve then
    abort (the `Destination` protocol, whatever the number of lanes)."""
    cat, a, _, keys = setup
    with Restorer(cat, [a], max_parallel=width) as r:
        dest = Recording(PagePool(MODEL.layout, page_size=16, num_pages=64))
        res = r.restore_into(dest, TOKENS, MODEL.fingerprint)
        assert res.restored_tokens == 99
        assert dest.calls == ["reserve", *["write"] * len(keys), "commit"]
        a.modes[keys[0]] = "flip_always"  # the first chunk: nothing verified
        dest = Recording(PagePool(MODEL.layout, page_size=16, num_pages=64))
        res = r.restore_into(dest, TOKENS, MODEL.fingerprint)
        # Other lanes may have written later chunks before the first one failed.
        assert res.restored_tokens == 0 and dest.calls[0] == "reserve"
        assert set(dest.calls[1:-1]) <= {"write"} and dest.calls[-1] == "abort"
        assert width > 1 or dest.calls == ["reserve", "abort"]
        assert dest.pool.free_pages == 64


@pytest.mark.parametrize("width", [1, 4])
def test_a_destination_without_room_gets_the_error_and_no_write(setup: Any, width: int) -> None:
    """The pool cannot hold the prefix: the restore raises the pool's error, writes nothing,
    aborts nothing it did not reserve, and the restorer goes on working."""
    cat, a, _, keys = setup
    with Restorer(cat, [a], max_parallel=width) as r:
        small = Recording(PagePool(MODEL.layout, page_size=16, num_pages=3))
        with pytest.raises(PoolExhaustedError, match="shortfall 4"):
            r.restore_into(small, TOKENS, MODEL.fingerprint)
        assert small.calls == ["reserve"] and small.pool.free_pages == 3
        assert small.route is None
        pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
        res = r.restore(pool, TOKENS, MODEL.fingerprint)
    assert res.restored_tokens == 99
    assert_exact(res, pool)
    assert all(states(cat, k) == ["durable"] for k in keys)
