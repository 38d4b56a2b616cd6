"""Restore throughput beside its floors and per-session files; storage and time to first token.

Usage (repository root, venv with `.[test,bench]`; SeaweedFS is started on
loopback for the S3 row):

    python bench/bench_restore.py [--tokens 4096] [--reps 7] [--no-s3]

Sections, all in one run on the same machine:
1. Restoring a 4096-token prefix of fp16 KV shaped like a 7B-class model
   (28 layers x 4 kv heads x 128 dim, 14.7 MB per 256-token chunk) into a page
   pool: kvc from a local store (warm and cold page cache) and from S3, beside
   the floors (blake3 + copy into the pool, raw file read) and beside one
   safetensors or np.save file per session (load, then copy into the pool).
2. Storage for 10 sessions sharing a 2k-token system prompt.
3. Time to first token with the reference decoder: restore vs recompute.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog import AttentionLayout, Fingerprint
from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

LAYOUT = AttentionLayout(28, 4, 128, "float16")
FP = Fingerprint.create(weights="bench-7b-like", architecture="llama", config={}, attention_layout=LAYOUT)
PAGE = 16
CHUNK = 256


def median_s(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kv_like(n: int, seed: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    shape = (LAYOUT.num_layers, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    scale = rng.uniform(0.05, 4.0, size=(LAYOUT.num_layers, 1, LAYOUT.num_kv_heads, 1))
    k = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
    v = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
    return k, v


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_into_pool(pool: PagePool, pages: list[int], kv: np.ndarray[Any, Any]) -> None:
    """What any path must do at the end: put [L, 2, T, H, D] into pool pages."""
    n = kv.shape[2]
    for i, page in enumerate(pages):
        a, b = i * PAGE, min(n, (i + 1) * PAGE)
        pool.kv[:, :, page, : b - a] = kv[:, :, a:b]


def restore_section(n: int, reps: int, use_s3: bool, tmp: Path) -> list[tuple[str, float, str]]:
    k, v = kv_like(n + 1)
    toks = np.random.default_rng(1).integers(0, 50_000, n + 1).astype(np.uint32)
    src = PagePool(LAYOUT, page_size=PAGE, num_pages=(n + 1) // PAGE + 2)
    route = src.new_route()
    src.append(route, k, v)
    kv_bytes = n * LAYOUT.bytes_per_token
    cat = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{tmp / 'blobs'}")
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(src, route, toks[:n], FP)
    blob_paths = [local.path_of(key) for key in local.keys()]  # type: ignore[attr-defined]
    dst = PagePool(LAYOUT, page_size=PAGE, num_pages=n // PAGE + 2)
    rows: list[tuple[str, float, str]] = []

    def restore_from(stores: list[ChunkStore]) -> Callable[[], None]:
        restorer = Restorer(cat, stores, max_parallel=2)

        def run() -> None:
            res = restorer.restore(dst, toks, FP)
            assert res.restored_tokens == n, res.restored_tokens
            assert res.route is not None
            dst.release(res.route)

        return run

    # Floors: the same bytes, hashed and copied into the same pool, no kvc.
    pages = dst.reserve_pages(n // PAGE)
    payload = np.stack([k[:, :n], v[:, :n]], axis=1)
    raw_file = tmp / "raw.bin"
    raw_file.write_bytes(payload.tobytes())

    def floor_hash_copy() -> None:
        with open(raw_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            blake3.blake3(m, max_threads=blake3.blake3.AUTO).digest()
            arr = np.frombuffer(m, dtype=np.float16).reshape(payload.shape)
            copy_into_pool(dst, pages, arr)
            del arr

    buf = bytearray(payload.nbytes)

    def floor_read() -> None:
        with open(raw_file, "rb", buffering=0) as f:
            f.readinto(buf)

    rows.append(("floor: mmap + blake3 + copy into pool", median_s(floor_hash_copy, reps), "warm"))
    rows.append(("floor: file read", median_s(floor_read, reps), "warm"))
    rows.append(("floor: file read", median_s(floor_read, reps, lambda: drop_cache([raw_file])), "cold"))

    # What a user would do instead: one file per session, loaded then copied in.
    try:
        from safetensors.numpy import load_file, save_file

        st = tmp / "session.safetensors"
        save_file({"kv": payload}, str(st))
        rows.append(
            (
                "alt: safetensors load + copy into pool",
                median_s(lambda: copy_into_pool(dst, pages, load_file(str(st))["kv"]), reps),
                "warm, unverified",
            )
        )
    except ImportError:
        print("safetensors missing: pip install -e '.[bench]'", file=sys.stderr)
    npy = tmp / "session.npy"
    np.save(npy, payload)
    rows.append(
        ("alt: np.load + copy into pool", median_s(lambda: copy_into_pool(dst, pages, np.load(npy)), reps),
         "warm, unverified")
    )
    dst.free_reserved(pages)

    rows.append(("kvc restore, local", median_s(restore_from([local]), reps), "warm, verified"))
    rows.append(
        ("kvc restore, local", median_s(restore_from([local]), reps, lambda: drop_cache(blob_paths)), "cold, verified")
    )
    if use_s3:
        from tests.services import start_seaweedfs

        with start_seaweedfs() as srv:
            os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
            s3 = open_store(f"s3://{srv.bucket}/bench?endpoint_url={srv.endpoint_url}&region={srv.region}")
            for key in local.keys():
                rcpt = s3.put(key, local.get(key))
                from restore.write_behind import to_replica_receipt

                cat.record_replica(key, to_replica_receipt(rcpt, "object"))
            rows.append(("kvc restore, S3 (SeaweedFS)", median_s(restore_from([s3]), reps), "verified"))
            client, bucket = s3.client, s3.bucket  # type: ignore[attr-defined]
            keys = [s3.object_key(key) for key in local.keys()]  # type: ignore[attr-defined]
            rows.append(
                (
                    "floor: raw S3 GETs of the same blobs",
                    median_s(lambda: [client.get_object(Bucket=bucket, Key=x)["Body"].read() for x in keys], reps),
                    "sequential, no verify",
                )
            )
            s3.close()
    cat.close()
    print(f"KV restored per run: {n} tokens = {kv_bytes / 1e6:.0f} MB", file=sys.stderr)
    return [(name, sec, note + f" | {kv_bytes / sec / 1e9:.2f} GB/s") for name, sec, note in rows]


def storage_section(tmp: Path) -> list[str]:
    """10 sessions, each a 2048-token shared system prompt plus 256 tokens of its own."""
    cat = Catalog.open(f"sqlite:///{tmp / 'storage.db'}", upgrade=True)
    store = open_store(f"file://{tmp / 'storage-blobs'}")
    system = np.random.default_rng(7).integers(0, 50_000, 2048).astype(np.uint32)
    ks, vs = kv_like(2048 + 256, seed=3)
    per_session_files = 0
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        for s in range(10):
            own = np.random.default_rng(100 + s).integers(0, 50_000, 256).astype(np.uint32)
            toks = np.concatenate([system, own])
            pool = PagePool(LAYOUT, page_size=PAGE, num_pages=(2304 // PAGE) + 1)
            r = pool.new_route()
            ko, vo = kv_like(256, seed=200 + s)
            pool.append(r, ks[:, :2048], vs[:, :2048])
            pool.append(r, ko, vo)
            cp.checkpoint(pool, r, toks, FP)
            per_session_files += len(toks) * LAYOUT.bytes_per_token
    stored = sum(store.stat(key).size for key in store.keys())
    cat.close()
    return [
        f"per-session files (safetensors/np.save): {per_session_files / 1e6:,.0f} MB",
        f"kvc (shared prefix stored once):         {stored / 1e6:,.0f} MB  ({per_session_files / stored:.1f}x less)",
    ]


def ttft_section(tmp: Path, reps: int) -> list[str]:
    model = ReferenceModel.small(seed=0)
    cat = Catalog.open(f"sqlite:///{tmp / 'ttft.db'}", upgrade=True)
    store = open_store(f"file://{tmp / 'ttft-blobs'}")
    system = np.random.default_rng(9).integers(0, model.vocab_size, 2048).tolist()
    pool = PagePool(model.layout, page_size=PAGE, num_pages=4096 // PAGE)
    r = pool.new_route()
    model.prefill(pool, r, system)
    with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
        cp.checkpoint(pool, r, system, model.fingerprint)
    pool.release(r)
    question = np.random.default_rng(10).integers(0, model.vocab_size, 32).tolist()
    prompt = system + question

    def recompute() -> None:
        route = pool.new_route()
        model.prefill(pool, route, prompt)
        pool.release(route)

    restorer = Restorer(cat, [store])

    def restore_then_prefill() -> None:
        res = restorer.restore(pool, prompt, model.fingerprint)
        assert res.route is not None
        model.prefill(pool, res.route, prompt[res.restored_tokens :])
        pool.release(res.route)

    t_re = median_s(recompute, max(1, reps // 3))
    t_rs = median_s(restore_then_prefill, reps)
    cat.close()
    return [
        f"prompt: 2048-token system prompt + 32-token question, reference decoder ({model.layout})",
        f"recompute (prefill 2080 tokens):           {t_re * 1e3:8.1f} ms",
        f"restore 2048 + prefill 32:                 {t_rs * 1e3:8.1f} ms  ({t_re / t_rs:.1f}x faster)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-restore-"))
    rows = restore_section(args.tokens, args.reps, not args.no_s3, tmp)
    print(f"\nkvc restore bench: {args.tokens} tokens of fp16 KV, {LAYOUT.num_layers} layers x "
          f"{LAYOUT.num_kv_heads} kv heads x {LAYOUT.head_dim} dim, page {PAGE}, chunk {CHUNK}, "
          f"median of {args.reps}, {os.cpu_count()} cores\n")
    print(f"{'path':<42} {'median ms':>10}  note")
    print("-" * 90)
    for name, sec, note in rows:
        print(f"{name:<42} {sec * 1e3:>10.1f}  {note}")
    by = {(name, note.split(" |")[0]): sec for name, sec, note in rows}
    warm = by[("kvc restore, local", "warm, verified")]
    floor = by[("floor: mmap + blake3 + copy into pool", "warm")]
    print(f"\nwarm local restore at {floor / warm:.0%} of the floor (mmap + blake3 + copy); target >= 70%")
    st = by.get(("alt: safetensors load + copy into pool", "warm, unverified"))
    if st:
        print(f"kvc restore (verified) vs safetensors load + copy (unverified): {st / warm:.2f}x the speed")
    print("\nStorage, 10 sessions sharing a 2k-token system prompt:")
    for line in storage_section(tmp):
        print("  " + line)
    print("\nTime to first token:")
    for line in ttft_section(tmp, args.reps):
        print("  " + line)


if __name__ == "__main__":
    main()
