"""Where a checkpoint's time goes: cProfile of kvc checkpoints on one thread, and the floor's parts.

Usage (repository root):

    python bench/profile_checkpoint.py [--tokens 4096] [--reps 3] [--store file|s3]

Runs the chunk work on one thread (`parallel=1`, so cProfile, which sees only
the calling thread, sees all of it), prints the functions with the most own
time, then times each part of the floor on one 256-token chunk (gather from
the pages, NaN/Inf scan, blake3, sha256, write + fsync) so that the profile can
be read against what the work costs at the least. For the threads of a
parallel run, py-spy (`pip install py-spy`; `py-spy record --threads -o
out.svg -- python bench/bench_checkpoint.py --no-s3 --reps 3`) shows the same
split per thread.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_checkpoint import CHUNK, FP, LAYOUT, PAGE, clear_dir, kv_like, tokens_for
from bench.scratch import scratch_dir
from catalog.catalog import Catalog
from chunkstore import open_store
from chunkstore.record import check_finite
from restore.checkpoint import Checkpointer
from restore.pages import copy_out_into
from restore.pool import PagePool


def per_chunk(name: str, fn: Callable[[], object], nbytes: int, reps: int = 10) -> None:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps
    print(f"  {name:<34} {dt * 1e3:7.2f} ms  {nbytes / dt / 1e9:6.2f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--store", choices=["file", "s3"], default="file")
    args = ap.parse_args()
    n = args.tokens
    tmp = scratch_dir("kvc-profile-checkpoint-")
    k, v = kv_like(n)
    pool = PagePool(LAYOUT, page_size=PAGE, num_pages=n // PAGE + 2)
    route = pool.new_route()
    pool.append(route, k, v)
    cat = Catalog.open(f"sqlite:///{tmp / 'c.db'}", upgrade=True)
    ctx = None
    if args.store == "s3":
        from tests.services import start_seaweedfs

        ctx = start_seaweedfs()
        srv = ctx.__enter__()
        os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
        store = open_store(f"s3://{srv.bucket}/p?endpoint_url={srv.endpoint_url}&region={srv.region}")
    else:
        store = open_store(f"file://{tmp / 'blobs'}")
    prof = cProfile.Profile()
    with Checkpointer(cat, store, chunk_size=CHUNK, parallel=1) as cp:
        cp.checkpoint(pool, route, tokens_for(0, n, 7), FP)  # warm-up: buffers, catalog
        total = 0.0
        for rep in range(1, args.reps + 1):
            if args.store == "file":
                clear_dir(tmp / "blobs")
            t0 = time.perf_counter()
            prof.enable()
            res = cp.checkpoint(pool, route, tokens_for(rep, n, 7), FP)
            prof.disable()
            total += time.perf_counter() - t0
    kv_bytes = n * LAYOUT.bytes_per_token
    print(f"\nkvc checkpoint on one thread to {args.store}: {n} tokens, {kv_bytes / 1e6:.0f} MB, "
          f"{total / args.reps * 1e3:.0f} ms per checkpoint ({kv_bytes * args.reps / total / 1e9:.2f} GB/s)")
    print("stages of the last one: " + ", ".join(f"{s} {x * 1e3:.0f} ms" for s, x in res.seconds.items()))
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)

    print(f"The floor's parts, one {CHUNK}-token chunk ({LAYOUT.bytes_per_token * CHUNK / 1e6:.1f} MB), one thread:")
    lease = pool.lease(route)
    out = np.empty((LAYOUT.num_layers, 2, CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    out.fill(0)
    buf = memoryview(out.reshape(-1).view(np.uint8))
    nb = buf.nbytes
    per_chunk("gather pages -> buffer", lambda: copy_out_into(out, pool.kv, lease.pages, 0, CHUNK, PAGE), nb)
    per_chunk("NaN/Inf scan, pages in place", lambda: lease.check_finite(0, CHUNK), nb)
    per_chunk("NaN/Inf scan, contiguous buffer", lambda: check_finite(out, "float16"), nb)
    per_chunk("blake3 (one pass)", lambda: blake3.blake3(buf).digest(), nb)
    per_chunk("sha256 (S3 checksum, one pass)", lambda: hashlib.sha256(buf).digest(), nb)
    path = tmp / "w.bin"

    def write(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, buf)
        if sync:
            os.fsync(fd)
        os.close(fd)

    per_chunk("os.write + fsync", lambda: write(True), nb, reps=5)
    per_chunk("os.write, no fsync", lambda: write(False), nb, reps=5)
    lease.close()
    cat.close()
    if ctx is not None:
        ctx.__exit__(None, None, None)


if __name__ == "__main__":
    main()
