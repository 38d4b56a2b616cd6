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
   Each row also says how many cores it kept busy (CPU seconds over wall
   seconds; for S3 the SeaweedFS server's CPU counts too): a floor that keeps
   both cores busy leaves no core for kvc's verify and copy.
2. Storage for 10 sessions sharing a 2k-token system prompt.
3. Time to first token with the reference decoder: restore vs recompute.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from catalog import AttentionLayout, Fingerprint
from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.record import decode_chunk
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer
from restore.write_behind import to_replica_receipt

LAYOUT = AttentionLayout(28, 4, 128, "float16")
FP = Fingerprint.create(
    weights="bench-7b-like", architecture="llama", config={}, attention_layout=LAYOUT
)
PAGE = 16
CHUNK = 256


def median_s(
    fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, before: Callable[[], object] | None = None
) -> dict[str, float]:
    """Median seconds of each fn, all run once per repetition in a new shuffled order (fixed
    seed), so that the machine's noise, and whatever the one before leaves behind (freed
    memory, cold caches), falls on all of them alike (a rotation would give each the same
    predecessor every time); `before` runs untimed before every call."""
    for fn in fns.values():
        if before is not None:
            before()
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    order = random.Random(0)
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metered(
    fns: dict[str, Callable[[], object]], pids: Iterable[int] = ()
) -> tuple[dict[str, Callable[[], object]], dict[str, list[float]]]:
    """`fns` wrapped to add up their wall and CPU seconds (this process, plus `pids`, such as
    the S3 server's): `busy[name]` = [cpu, wall], so cpu / wall is how many cores a row kept
    busy. A floor that keeps every core busy leaves kvc's extra work nowhere to run."""
    busy = {name: [0.0, 0.0] for name in fns}
    others = list(pids)

    def cpu() -> float:
        return time.process_time() + sum(process_cpu_s(p) for p in others)

    def wrap(name: str, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            c0, t0 = cpu(), time.perf_counter()
            out = fn()
            busy[name][0] += cpu() - c0
            busy[name][1] += time.perf_counter() - t0
            return out

        return run

    return {name: wrap(name, fn) for name, fn in fns.items()}, busy


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


@dataclass
class Blob:
    """One stored chunk as the floors see it: its file, where its payload starts, its positions."""

    path: Path
    offset: int
    start: int
    count: int


def in_restore_pages(
    dst: PagePool, n_pages: int, fill: Callable[[list[int]], object]
) -> Callable[[], None]:
    """`fill` run on `n_pages` pages reserved for the run and freed after it: the pages kvc's
    restore of the same prefix gets (both take them from the top of the pool's free stack,
    and freed pages go back in their old order), so every row writes into the same memory.
    (Floors writing into pages of their own measured memory kvc's rows did not touch: on this
    VM, pages left untouched while other rows ran for seconds cost more to write again.)"""

    def run() -> None:
        pages = dst.reserve_pages(n_pages)
        try:
            fill(pages)
        finally:
            dst.free_reserved(pages)

    return run


def check_same_pages(
    dst: PagePool, restorer: Restorer, toks: np.ndarray[Any, Any], n_pages: int
) -> None:
    """Assert that `in_restore_pages` hands out the very pages a kvc restore of `toks` gets."""
    res = restorer.restore(dst, toks, FP)
    assert res.route is not None
    restored = list(dst.page_table(res.route))
    dst.release(res.route)
    reserved = dst.reserve_pages(n_pages)
    dst.free_reserved(reserved)
    assert restored == reserved, "the floors would write into other pages than kvc"


def floor_ops(
    blobs: list[Blob], dst: PagePool, n_pages: int, threads: int
) -> dict[str, Callable[[], object]]:
    """The floors done by hand as well as a careful engineer would: the same blob files hashed
    whole with blake3 and their payloads copied page by page into the pool pages kvc restores
    into (`in_restore_pages`), the work split by chunk over `threads` threads (every core)."""
    ex = ThreadPoolExecutor(threads)
    shape = (LAYOUT.num_layers, 2, CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim)

    def mmap_hash_copy(b: Blob, pages: list[int], hash_threads: int) -> None:
        with open(b.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            blake3.blake3(m, max_threads=hash_threads).digest()
            arr = np.frombuffer(m, np.float16, math.prod(shape), b.offset).reshape(shape)
            dst.write_pages(pages, b.start, arr[:, :, : b.count])
            del arr

    buffers = threading.local()

    def read_hash_copy(b: Blob, pages: list[int]) -> None:
        size = b.path.stat().st_size
        buf = getattr(buffers, "buf", None)
        if buf is None or len(buf) < size:
            buf = buffers.buf = bytearray(size)
        view = memoryview(buf)[:size]
        with open(b.path, "rb", buffering=0) as f:
            f.readinto(view)
        blake3.blake3(view).digest()
        arr = np.frombuffer(view, np.float16, math.prod(shape), b.offset).reshape(shape)
        dst.write_pages(pages, b.start, arr[:, :, : b.count])

    def each_blob(op: Callable[[Blob, list[int]], None]) -> Callable[[], None]:
        return in_restore_pages(
            dst, n_pages, lambda pages: list(ex.map(lambda b: op(b, pages), blobs))
        )

    tag = f", {threads} at a time"
    return {
        "mmap+blake3+copy, hash 1 thread" + tag: each_blob(lambda b, p: mmap_hash_copy(b, p, 1)),
        "mmap+blake3+copy, hash all threads" + tag: each_blob(
            lambda b, p: mmap_hash_copy(b, p, blake3.blake3.AUTO)
        ),
        "read+blake3+copy" + tag: each_blob(read_hash_copy),
    }


def restore_section(n: int, reps: int, use_s3: bool, parallel: int, tmp: Path) -> list[str]:
    """Restore `n` tokens: kvc and the floors, interleaved, warm then cold; then S3."""
    tmp = tmp / f"restore-{n}"
    tmp.mkdir()
    k, v = kv_like(n + 1)
    toks = np.random.default_rng(1).integers(0, 50_000, n + 1).astype(np.uint32)
    src = PagePool(LAYOUT, page_size=PAGE, num_pages=(n + 1) // PAGE + 2)
    route = src.new_route()
    src.append(route, k, v)
    del k, v
    kv_bytes = n * LAYOUT.bytes_per_token
    cat = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{tmp / 'blobs'}")
    with Checkpointer(cat, local, chunk_size=CHUNK) as cp:
        cp.checkpoint(src, route, toks[:n], FP)
    match = cat.lookup("default", FP.hex, toks)
    blobs = []
    for c in match.chunks:
        path = local.path_of(c.blob_key)  # type: ignore[attr-defined]
        data = path.read_bytes()
        offset = (
            np.asarray(decode_chunk(data).kv).__array_interface__["data"][0]
            - np.frombuffer(data, np.uint8).__array_interface__["data"][0]
        )
        blobs.append(Blob(path, int(offset), c.token_start, c.tokens_used))
    blob_paths = [b.path for b in blobs]
    dst = PagePool(LAYOUT, page_size=PAGE, num_pages=n // PAGE + 2)
    n_pages = n // PAGE
    threads = os.cpu_count() or 1

    def kvc_restore(stores: list[ChunkStore]) -> Callable[[], None]:
        r = Restorer(cat, stores, max_parallel=parallel)

        def run() -> None:
            res = r.restore(dst, toks, FP)
            assert res.restored_tokens == n, res.restored_tokens
            assert res.route is not None
            dst.release(res.route)

        return run

    kvc_local = kvc_restore([local])
    check_same_pages(dst, Restorer(cat, [local]), toks, n_pages)
    # What a user would do instead: one file per session, loaded then copied in.
    k_, v_ = src.read(route, 0, n)
    payload = np.stack([k_, v_], axis=1)
    del k_, v_
    alts: dict[str, Callable[[], object]] = {}
    try:
        from safetensors.numpy import load_file, save_file

        st = tmp / "session.safetensors"
        save_file({"kv": payload}, str(st))
        alts["safetensors load + copy (unverified)"] = in_restore_pages(
            dst, n_pages, lambda pages: dst.write_pages(pages, 0, load_file(str(st))["kv"])
        )
    except ImportError:
        print("safetensors missing: pip install -e '.[bench]'", file=sys.stderr)
    npy = tmp / "session.npy"
    np.save(npy, payload)
    del payload
    alts["np.load + copy (unverified)"] = in_restore_pages(
        dst, n_pages, lambda pages: dst.write_pages(pages, 0, np.load(npy))
    )

    # Every core, twice as many in flight (for reads that wait on the disk), and as many as kvc keeps.
    widths = sorted({threads, 2 * threads, parallel})
    floors: dict[str, Callable[[], object]] = {}
    for width in widths:
        floors |= floor_ops(blobs, dst, n_pages, width)
    warm_fns, warm_busy = metered({**floors, "kvc": kvc_local, **alts})
    warm = interleaved(warm_fns, reps)
    cold_fns, cold_busy = metered({**floors, "kvc": kvc_local})
    cold = interleaved(cold_fns, max(3, reps // 2), lambda: drop_cache(blob_paths))
    gb = kv_bytes / 1e9
    lines = [
        f"{n} tokens, {gb * 1e3:,.0f} MB of KV, {len(blobs)} chunks; floors on {' and '.join(map(str, widths))} threads, "
        f"kvc Restorer(max_parallel={parallel}; as many local lanes as cores while reads keep them busy)"
    ]

    def table(
        title: str,
        times: dict[str, float],
        floor_names: Iterable[str],
        busy: dict[str, list[float]],
    ) -> None:
        floor_name = min(floor_names, key=lambda name: times[name])
        floor = times[floor_name]
        lines.append(f"  {title}")
        for name, sec in sorted(times.items(), key=lambda kv: kv[1]):
            mark = "  <- floor" if name == floor_name else ""
            cores = busy[name][0] / busy[name][1]
            lines.append(
                f"    {name:<50} {sec * 1e3:9.1f} ms {gb / sec:6.2f} GB/s  {floor / sec:5.2f} of floor"
                f"  {cores:4.2f} cores busy{mark}"
            )

    table("warm local (page cache holds the blobs)", warm, floors, warm_busy)
    table("cold local (page cache dropped before each run)", cold, floors, cold_busy)

    if use_s3:
        import boto3
        import botocore.config

        from tests.services import start_seaweedfs

        with start_seaweedfs() as srv:
            os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
            s3 = open_store(
                f"s3://{srv.bucket}/bench?endpoint_url={srv.endpoint_url}&region={srv.region}"
            )
            for c in match.chunks:
                rcpt = s3.put(c.blob_key, local.get(c.blob_key))
                cat.record_replica(c.blob_key, to_replica_receipt(rcpt, "object"))
            bucket = s3.bucket  # type: ignore[attr-defined]
            keys = [s3.object_key(c.blob_key) for c in match.chunks]  # type: ignore[attr-defined]
            # As many GETs in flight as kvc keeps chunks, as kvc's store keeps ranged GETs, and
            # the local floors' widths: the fastest is the floor.
            s3_widths = sorted({*widths, s3.max_concurrency})  # type: ignore[attr-defined]
            # The fastest plain boto3: no response checksum to compute (kvc's ranged GETs get
            # none either; it verifies blake3 instead), a connection per thread.
            client = boto3.client(
                "s3",
                endpoint_url=srv.endpoint_url,
                region_name=srv.region,
                config=botocore.config.Config(
                    response_checksum_validation="when_required",
                    max_pool_connections=max(s3_widths),
                ),
            )

            def raw_gets(width: int) -> Callable[[], None]:
                gets = ThreadPoolExecutor(width)

                def run() -> None:
                    list(
                        gets.map(
                            lambda x: client.get_object(Bucket=bucket, Key=x)["Body"].read(), keys
                        )
                    )

                return run

            s3_floors = {f"raw GETs, {w} at a time, no verify": raw_gets(w) for w in s3_widths}
            server = [srv.proc.pid] if srv.proc is not None else []  # none for an outside server
            s3_fns, s3_busy = metered({**s3_floors, "kvc": kvc_restore([s3])}, server)
            s3_times = interleaved(s3_fns, max(3, reps // 2))
            table(
                "S3 (SeaweedFS on loopback; cores busy include SeaweedFS)",
                s3_times,
                s3_floors,
                s3_busy,
            )
            s3.close()
    cat.close()
    return lines


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
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="4096,32768", help="comma-separated prefix lengths")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--parallel", type=int, default=Restorer.DEFAULT_PARALLEL, help="kvc's max_parallel"
    )
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument(
        "--only-restore", action="store_true", help="skip the storage and TTFT sections"
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-restore-"))
    print(
        f"kvc restore bench: fp16 KV, {LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} kv heads x "
        f"{LAYOUT.head_dim} dim, page {PAGE}, chunk {CHUNK}, medians of {args.reps} interleaved runs "
        f"(cold and S3: of {max(3, args.reps // 2)}), {os.cpu_count()} cores"
    )
    try:
        for n in (int(x) for x in args.tokens.split(",")):
            print()
            for line in restore_section(n, args.reps, not args.no_s3, args.parallel, tmp):
                print(line, flush=True)
        if args.only_restore:
            return
        print("\nStorage, 10 sessions sharing a 2k-token system prompt:")
        for line in storage_section(tmp):
            print("  " + line)
        print("\nTime to first token:")
        for line in ttft_section(tmp, args.reps):
            print("  " + line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
