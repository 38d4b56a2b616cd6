"""Checkpoint throughput beside its floors and beside per-session files; copies of the KV.

Usage (repository root, venv with `.[test,bench]`; SeaweedFS is started on
loopback for the S3 rows):

    python bench/bench_checkpoint.py [--tokens 4096 32768] [--reps 5] [--no-s3]

For each token count, fp16 KV shaped like a 7B-class model (28 layers x 4 kv
heads x 128 dim, 14.7 MB per 256-token chunk, pages of 16 tokens) sits in a
page pool and is checkpointed:

- kvc: `Checkpointer.checkpoint` (catalog on SQLite) to a local store (temp
  file, fsync, rename, directory fsync) and, separately, to S3 (SeaweedFS).
  Every rep checkpoints new token ids, so every chunk is really written.
- local floor: a careful hand-written version of the same work, all cores:
  one task per chunk on a ThreadPoolExecutor of os.cpu_count() threads, each
  gathering the pages into a per-thread buffer with the record header in front
  (the same record bytes, checked once), blake3 of the payload and of the
  record, then os.write / fsync / rename / directory fsync. No NaN/Inf check,
  no catalog, no content-address re-check.
- S3 floor: the same record bytes, built beforehand (not timed), sent with
  boto3 put_object on as many threads as kvc's checkpointer uses.
- what a user would do instead: gather the session's KV out of the pool into
  one array and write one file (safetensors save_file / np.save), with and
  without an fsync.

Reps are interleaved (kvc, floor, alternatives, kvc, ...) so that noise from
other work on the machine hits all alike; the ratios are what to read, of
the medians and of the best reps (noise only ever adds time). Each
timed step starts after an os.sync() (not timed), so that none pays for the
writeback of the step before it.

"copies" counts full copies of the KV in user space between the pool and the
bytes handed to the kernel or the HTTP client (tests/restore/test_checkpoint_copies.py
pins kvc's one): kvc 1 (pages -> the record buffer, which is hashed, written
and sent in place); the floors 1 (the same gather); np.save 1 (the gather;
it writes from the array); safetensors 2 (the gather, then save_file's
serialised buffer built from `tobytes()`, a third transient copy inside).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_restore import FP, LAYOUT, kv_like  # the same KV as the restore bench
from catalog import chain_root, prefix_hashes
from catalog.catalog import Catalog
from chunkstore import open_store
from chunkstore.record import FORMAT_VERSION, MAGIC, PAYLOAD_ALIGNMENT, ChunkHeader, decode_chunk
from restore.checkpoint import Checkpointer
from restore.pages import copy_out_into
from restore.pool import PagePool

PAGE = 16
CHUNK = 256
NAMESPACE = "default"
WORKERS = os.cpu_count() or 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the floor's record builder: hand-written, the same bytes as kvc's records ----------


class FloorBuilder:
    """Builds chunk records from pool pages into per-thread buffers, as a careful engineer would."""

    def __init__(self, pool: PagePool, pages: tuple[int, ...]) -> None:
        self.pool = pool
        self.pages = pages
        self._local = threading.local()

    def _buffer(self, size: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = bytearray(size + (1 << 20))
        return memoryview(buf)[:size]

    def build(self, tok: np.ndarray[Any, Any], hashes: list[bytes], i: int) -> tuple[str, memoryview]:
        start, end = i * CHUNK, min(len(tok), (i + 1) * CHUNK)
        shape = (LAYOUT.num_layers, 2, end - start, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        raw = int(np.prod(shape)) * 2
        parent = hashes[i - 1] if i else chain_root(NAMESPACE)

        def header(digest: str) -> bytes:
            return ChunkHeader(
                fingerprint=FP.hex, namespace=NAMESPACE, prefix_hash=hashes[i], parent_hash=parent,
                token_start=start, tokens=tuple(tok[start:end].tolist()),
                layers=(0, LAYOUT.num_layers), kv_heads=(0, LAYOUT.num_kv_heads), dtype="float16",
                shape=shape, codec="raw", payload_blake3=digest, stored_blake3=digest, payload_size=raw,
            ).to_json()

        hlen = len(header("0" * 64))
        off = 44 + hlen + (-(44 + hlen) % PAYLOAD_ALIGNMENT)
        view = self._buffer(off + raw)
        payload = np.frombuffer(view, np.float16, raw // 2, off).reshape(shape)
        copy_out_into(payload, self.pool.kv, self.pages, start, end, PAGE)
        digest = blake3.blake3(view[off:]).hexdigest()
        hb = header(digest)
        fixed = struct.pack("<4sHHI", MAGIC, FORMAT_VERSION, 0, hlen)
        view[:12] = fixed
        view[12:44] = blake3.blake3(fixed + hb).digest()
        view[44 : 44 + hlen] = hb
        view[44 + hlen : off] = bytes(off - 44 - hlen)
        return blake3.blake3(view).hexdigest(), view


def floor_local(builder: FloorBuilder, tok: np.ndarray[Any, Any], out: Path, ex: ThreadPoolExecutor) -> None:
    hashes = prefix_hashes(NAMESPACE, tok, CHUNK)

    def one(i: int) -> None:
        key, view = builder.build(tok, hashes, i)
        tmp = out / f".tmp-{key}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, out / key)
        fsync_dir(out)

    list(ex.map(one, range(len(hashes))))


# -- a run ------------------------------------------------------------------------------


class Runner:
    """Interleaved reps of named steps; each step may prepare (untimed) and clean up (untimed)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.stages: dict[str, list[dict[str, float]]] = defaultdict(list)

    def time(self, name: str, fn: Callable[[], object], record: bool) -> None:
        # Start from a clean page cache: without it a step pays for the writeback of
        # the one before (ext4 commits other files' dirty data with an fsync).
        os.sync()
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        if record:
            self.times[name].append(dt)
            seconds = getattr(res, "seconds", None)
            if isinstance(seconds, dict):
                self.stages[name].append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])


def clear_dir(path: Path) -> None:
    """Delete the blobs (not the store's directories, nor its meta/ documents): a store in use."""
    for dirpath, dirnames, filenames in os.walk(path):
        if Path(dirpath) == path and "meta" in dirnames:
            dirnames.remove("meta")
        for f in filenames:
            os.unlink(os.path.join(dirpath, f))


def tokens_for(rep: int, n: int, salt: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(1000 * salt + rep).integers(0, 50_000, n).astype(np.uint32)


def run_section(n: int, reps: int, use_s3: bool, tmp: Path) -> tuple[list[tuple[str, float, str, str]], dict[str, Any]]:
    k, v = kv_like(n)
    pool = PagePool(LAYOUT, page_size=PAGE, num_pages=n // PAGE + 2)
    route = pool.new_route()
    pool.append(route, k, v)
    del k, v
    kv_bytes = n * LAYOUT.bytes_per_token
    lease = pool.lease(route)
    builder = FloorBuilder(pool, lease.pages)
    r = Runner()
    cat = Catalog.open(f"sqlite:///{tmp / f'catalog-{n}.db'}", upgrade=True)
    local_dir = tmp / f"kvc-{n}"
    local = open_store(f"file://{local_dir}")
    floor_dir = tmp / f"floor-{n}"
    floor_dir.mkdir()
    alt_dir = tmp / f"alt-{n}"
    alt_dir.mkdir()
    ex = ThreadPoolExecutor(WORKERS)
    cp = Checkpointer(cat, local, chunk_size=CHUNK)

    # The floor writes kvc's record bytes: check one record once.
    tok0 = tokens_for(0, n, 9)
    key, view = builder.build(tok0, prefix_hashes(NAMESPACE, tok0, CHUNK), 0)
    assert decode_chunk(bytes(view), expected_key=key).header.tokens == tuple(tok0[:CHUNK].tolist())

    def gather() -> np.ndarray[Any, Any]:
        return lease.read_kv(0, n)  # what a user holding the session's KV would write

    def st_save(sync: bool) -> Callable[[], None]:
        from safetensors.numpy import save_file

        def run() -> None:
            path = alt_dir / "session.safetensors"
            save_file({"kv": gather()}, str(path))
            if sync:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

        return run

    def np_save(sync: bool) -> Callable[[], None]:
        def run() -> None:
            with open(alt_dir / "session.npy", "wb") as f:
                np.save(f, gather())
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

        return run

    s3ctx: Any = None
    s3_cp = None
    if use_s3:
        from tests.services import start_seaweedfs

        s3ctx = start_seaweedfs()
        srv = s3ctx.__enter__()
        os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
        s3 = open_store(f"s3://{srv.bucket}/kvc-{n}?endpoint_url={srv.endpoint_url}&region={srv.region}")
        s3_cat = Catalog.open(f"sqlite:///{tmp / f'catalog-s3-{n}.db'}", upgrade=True)
        s3_cp = Checkpointer(s3_cat, s3, chunk_size=CHUNK)
        client, bucket = s3.client, s3.bucket  # type: ignore[attr-defined]

        def s3_clear(prefix: str) -> None:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            keys = [o["Key"] for p in pages for o in p.get("Contents", []) if "/meta/" not in o["Key"]]
            for i in range(0, len(keys), 1000):
                client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": x} for x in keys[i : i + 1000]]})

    for rep in range(reps + 1):  # rep 0 warms up and is not counted
        rec = rep > 0
        tok1, tok2 = tokens_for(rep, n, 1), tokens_for(rep, n, 2)
        local_steps: list[tuple[str, Callable[[], object]]] = [
            ("kvc checkpoint, local", lambda t=tok1: cp.checkpoint(pool, route, t, FP)),
            ("floor, local", lambda t=tok2: floor_local(builder, t, floor_dir, ex)),
        ]
        for name, step in local_steps[:: 1 if rep % 2 else -1]:  # who goes first alternates
            r.time(name, step, rec)
            clear_dir(local_dir)
            clear_dir(floor_dir)
        for sync in (True, False):
            tag = "fsync" if sync else "no fsync"
            r.time(f"alt: safetensors save_file ({tag})", st_save(sync), rec)
            r.time(f"alt: np.save ({tag})", np_save(sync), rec)
            clear_dir(alt_dir)
        if s3_cp is not None:
            tok = tokens_for(rep, n, 4)
            hashes = prefix_hashes(NAMESPACE, tok, CHUNK)
            records = []
            for i in range(len(hashes)):  # the floor's record bytes, built before the clock starts
                key, view = builder.build(tok, hashes, i)
                records.append((f"floor-{n}/{key}", bytes(view)))
            kvc_tok = tokens_for(rep, n, 3)

            def put_all(records: list[tuple[str, bytes]] = records) -> None:
                list(ex.map(lambda kb: client.put_object(Bucket=bucket, Key=kb[0], Body=kb[1]), records))

            def kvc_s3(t: np.ndarray[Any, Any] = kvc_tok, c: Checkpointer = s3_cp) -> object:
                return c.checkpoint(pool, route, t, FP)

            s3_steps = [("kvc checkpoint, S3", kvc_s3), ("floor, S3: parallel put_object", put_all)]
            for name, step in s3_steps[:: 1 if rep % 2 else -1]:
                r.time(name, step, rec)
            records.clear()
            s3_clear(f"kvc-{n}/")
            s3_clear(f"floor-{n}/")
        print(f"  {n} tokens: rep {rep} done", file=sys.stderr)

    ex.shutdown()
    cp.close()
    cat.close()
    if s3_cp is not None:
        s3_cp.close()
        s3ctx.__exit__(None, None, None)
    lease.close()

    rows: list[tuple[str, float, float, str, str, str]] = []
    floors = {"local": r.median("floor, local")}
    floors_min = {"local": min(r.times["floor, local"])}
    if use_s3:
        floors["S3"] = r.median("floor, S3: parallel put_object")
        floors_min["S3"] = min(r.times["floor, S3: parallel put_object"])
    copies = {"kvc": "1", "floor": "1", "alt: safetensors": "2", "alt: np.save": "1"}
    for name in r.times:
        sec = r.median(name)
        where = "S3" if "S3" in name else "local"
        best = min(r.times[name])
        ratio = f"{floors[where] / sec:.2f}" if where in floors else ""
        ratio_min = f"{floors_min[where] / best:.2f}" if where in floors else ""
        cp_n = next(c for prefix, c in copies.items() if name.startswith(prefix))
        rows.append((name, sec, best, ratio, ratio_min, cp_n))
        print(f"  {name}: reps " + " ".join(f"{x * 1e3:.0f}" for x in r.times[name]) + " ms", file=sys.stderr)
    stages = {
        name: {s: statistics.median(x[s] for x in runs) for s in runs[0]} for name, runs in r.stages.items()
    }
    return rows, {"kv_bytes": kv_bytes, "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-checkpoint-"))
    try:
        for n in args.tokens:
            rows, info = run_section(n, args.reps, not args.no_s3, tmp)
            kv_bytes = info["kv_bytes"]
            print(f"\nkvc checkpoint bench: {n} tokens of fp16 KV = {kv_bytes / 1e6:.0f} MB, "
                  f"{LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} kv heads x {LAYOUT.head_dim} dim, "
                  f"page {PAGE}, chunk {CHUNK}, median of {args.reps} interleaved reps, "
                  f"{os.cpu_count()} cores, {WORKERS} threads\n")
            print(f"{'path':<42} {'median ms':>10} {'GB/s':>6} {'vs floor':>9} "
                  f"{'min ms':>8} {'vs floor':>9} {'copies':>7}")
            print("-" * 97)
            for name, sec, best, ratio, ratio_min, copies in rows:
                print(f"{name:<42} {sec * 1e3:>10.1f} {kv_bytes / sec / 1e9:>6.2f} {ratio:>9} "
                      f"{best * 1e3:>8.1f} {ratio_min:>9} {copies:>7}")
            print("\nkvc stage seconds (median; capture/encode/store summed over the chunk threads):")
            for name, st in info["stages"].items():
                print(f"  {name}: " + ", ".join(f"{s} {x * 1e3:.0f} ms" for s, x in st.items()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
