"""Chunk store throughput beside the physical floors and per-session files, in one run.

Usage (repository root, in the project's venv with the `test` and `bench`
extras; SeaweedFS is started on loopback for the S3 rows):

    python bench/bench_chunkstore.py [--reps 15] [--no-s3]

Prints one table: median milliseconds and GB/s (of KV bytes) per operation,
all on the same 14.7 MB fp16 chunk (28 layers x 4 kv heads x 128 dim x 256
tokens), then the ratio the project targets: local get+verify+decode of a
`raw` record against (file read + blake3) measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scratch import scratch_dir

from chunkstore import ChunkStore, open_store
from chunkstore.codecs import CODECS, DEFAULT_CODEC
from chunkstore.record import EncodedChunk, decode_chunk, encode_chunk

LAYERS, HEADS, DIM, TOKENS = 28, 4, 128, 256
Row = tuple[str, float, str]


def kv_like(seed: int = 0) -> np.ndarray[Any, Any]:
    """fp16 values shaped like real K/V: per-(layer, head) scales and a few outlier channels."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.05, 4.0, size=(LAYERS, 2, 1, HEADS, 1))
    chan = np.ones((1, 1, 1, 1, DIM))
    chan[..., rng.choice(DIM, 6, replace=False)] = 12.0
    return (rng.standard_normal((LAYERS, 2, TOKENS, HEADS, DIM)) * scale * chan).astype(np.float16)


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up: page cache, connection pool, allocator
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def b3(data: Any) -> bytes:
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()


def floors(kv: np.ndarray[Any, Any], tmp: Path, reps: int) -> list[Row]:
    dst = np.empty_like(kv)
    raw = kv.tobytes()
    path = tmp / "raw.bin"
    path.write_bytes(raw)
    buf = bytearray(len(raw))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    def mmap_hash() -> None:
        import mmap

        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            b3(m)

    return [
        ("floor: numpy copy", median_s(lambda: np.copyto(dst, kv), reps), ""),
        ("floor: blake3 (all threads)", median_s(lambda: b3(raw), reps), ""),
        ("floor: file read (page cache)", median_s(read, reps), ""),
        ("floor: file read + blake3", median_s(lambda: (read(), b3(buf)), reps), ""),
        ("floor: mmap + blake3", median_s(mmap_hash, reps), "what a verified local get must do"),
    ]


def alternatives(kv: np.ndarray[Any, Any], tmp: Path, reps: int) -> list[Row]:
    """What a user would do instead: one file per session."""
    npy = tmp / "session.npy"
    rows: list[Row] = [
        ("alt: np.save per session", median_s(lambda: np.save(npy, kv), reps), "no fsync"),
        ("alt: np.load per session", median_s(lambda: np.load(npy), reps), "unverified"),
    ]
    try:
        from safetensors.numpy import load_file, save_file
    except ImportError:
        print("safetensors not installed (pip install -e '.[bench]'): skipping its rows", file=sys.stderr)
        return rows
    st = str(tmp / "session.safetensors")
    rows.append(("alt: safetensors save per session", median_s(lambda: save_file({"kv": kv}, st), reps), "no fsync"))
    rows.append(("alt: safetensors load per session", median_s(lambda: load_file(st), reps), "unverified"))
    return rows


def codecs(kv: np.ndarray[Any, Any], reps: int) -> tuple[list[Row], dict[str, EncodedChunk]]:
    meta: dict[str, Any] = {
        "fingerprint": "ab" * 32,
        "namespace": "bench",
        "prefix_hash": bytes(range(32)),
        "parent_hash": bytes(32),
        "token_start": 0,
        "tokens": list(range(TOKENS)),
        "kv": kv,
    }
    dst = np.empty_like(kv)
    rows: list[Row] = []
    encoded = {}
    for codec in CODECS:
        enc = encoded[codec] = encode_chunk(**meta, codec=codec)
        note = f"record {len(enc.data) / kv.nbytes:.3f}x of KV"
        rows.append((f"encode {codec}", median_s(lambda c=codec: encode_chunk(**meta, codec=c), reps), note))
        rows.append(
            (
                f"verify+decode {codec} (in memory)",
                median_s(lambda e=enc: np.copyto(dst, decode_chunk(e.data, expected_key=e.key).kv), reps),
                "into a preallocated array",
            )
        )
    return rows, encoded


def store_rows(label: str, store: ChunkStore, encoded: dict[str, EncodedChunk], reps: int) -> list[Row]:
    dst = np.empty(encoded["raw"].header.shape, dtype=np.float16)
    rows: list[Row] = []
    for codec, enc in encoded.items():

        def put(e: EncodedChunk = enc) -> None:
            store.delete(e.key)
            store.put(e.key, e.data)

        def get(e: EncodedChunk = enc) -> None:
            data = store.get(e.key)
            if label == "local":
                b3(data)  # mmap is lazy: touch every page, as a verify would
            del data

        def restore(e: EncodedChunk = enc) -> None:
            np.copyto(dst, decode_chunk(store.get(e.key), expected_key=e.key).kv)

        rows.append((f"{label}: put {codec}", median_s(put, reps), "fsync + rename" if label == "local" else ""))
        store.put(enc.key, enc.data)
        if label != "local":
            rows.append((f"{label}: get {codec}", median_s(get, reps), ""))
        rows.append((f"{label}: get+verify+decode {codec}", median_s(restore, reps), "into a preallocated array"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 rows (no SeaweedFS)")
    args = ap.parse_args()
    kv = kv_like()
    tmp = scratch_dir("kvc-bench-chunkstore-")
    rows = floors(kv, tmp, args.reps) + alternatives(kv, tmp, args.reps)
    codec_rows, encoded = codecs(kv, args.reps)
    rows += codec_rows
    with open_store(f"file://{tmp / 'store'}") as local:
        rows += store_rows("local", local, encoded, args.reps)
    if not args.no_s3:
        from tests.services import start_seaweedfs

        with start_seaweedfs() as srv:
            os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
            url = f"s3://{srv.bucket}/bench?endpoint_url={srv.endpoint_url}&region={srv.region}"
            with open_store(url) as s3:
                rows += store_rows("s3/seaweedfs", s3, encoded, args.reps)
                client, key = s3.client, s3.object_key(encoded["raw"].key)  # type: ignore[attr-defined]
                rows.append(
                    (
                        "floor: raw S3 GET (boto3, one request)",
                        median_s(lambda: client.get_object(Bucket=srv.bucket, Key=key)["Body"].read(), args.reps),
                        "same object, no verify",
                    )
                )

    nbytes = kv.nbytes
    print(
        f"\nkvc chunkstore bench: fp16 KV {LAYERS} layers x {HEADS} kv heads x {DIM} dim x {TOKENS} tokens"
        f" = {nbytes / 1e6:.1f} MB per chunk; median of {args.reps}; default codec {DEFAULT_CODEC};"
        f" {os.cpu_count()} cores\n"
    )
    print(f"{'operation':<42} {'median ms':>10} {'GB/s of KV':>11}  note")
    print("-" * 96)
    for name, sec, note in rows:
        print(f"{name:<42} {sec * 1e3:>10.2f} {nbytes / sec / 1e9:>11.2f}  {note}")
    by = {name: sec for name, sec, _ in rows}
    got = by["local: get+verify+decode raw"]
    print(f"\nlocal get+verify+decode raw / (file read + blake3) = {got / by['floor: file read + blake3']:.2f}x"
          "  (target <= 1.5x)")
    print(f"local get+verify+decode raw / (mmap + blake3)      = {got / by['floor: mmap + blake3']:.2f}x")


if __name__ == "__main__":
    main()
