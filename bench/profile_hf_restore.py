"""Where `HFAdapter.restore`'s time goes against bench_hf's floor: the bound it cannot pass here.

Usage (repository root, venv with `.[test,bench]`):

    python bench/profile_hf_restore.py [--tokens 1024] [--dtype bfloat16] [--reps 40]

The model, prompt, chunk size and floor are bench_hf's (Qwen2-0.5B's KV shape, random KV
of all but the last prompt token stored in a local store, warm page cache). It prints,
medians of `--reps`:

1. The restore beside the floor, interleaved in shuffled order, with the fixed work of
   each restore timed inside it (the catalog lookup, the destination's `reserve`, the
   `commit` that builds the DynamicCache): the floor has none of it, so "bound" is the
   ratio the floor would reach with it added.
2. The work per chunk on one thread, without lookup or commit: the floor's loop (open,
   mmap, blake3, one copy) against kvc's (the restorer's read and verify of a chunk, its
   header known from an earlier restore, then the destination's write), interleaved.
3. What the Python between those big memory operations costs: one small fixed piece of
   Python (a dict of 200 ints) timed warm, and right after hashing and after copying a
   blob's bytes.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hf import CHUNK, QWEN2_05B, floor_restore, random_cache
from bench_restore import interleaved
from scratch import scratch_dir

from catalog.catalog import Catalog
from chunkstore import open_store
from chunkstore.record import read_header
from restore.engines.hf import HFAdapter, load_model, save_random_model
from restore.engines.hf.cache import CacheDestination, HostBuffers
from restore.engines.torch_kv import numpy_view, torch_dtype
from restore.restore import RestoreReport


def timed(owner: Any, name: str, into: dict[str, list[float]]) -> None:
    """Wrap `owner.name` to append each call's seconds to `into[name]`."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t0)

    setattr(owner, name, run)


def python_after(big: Callable[[], object], reps: int) -> float:
    """Median seconds of a small fixed piece of Python run right after `big`."""

    def small() -> int:
        d = {i: 2 * i for i in range(200)}
        return sum(d.values())

    ts = []
    for _ in range(reps):
        big()
        t0 = time.perf_counter()
        small()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    n, reps = args.tokens, args.reps
    tmp = scratch_dir("kvc-profile-hf-")
    model_dir = save_random_model(tmp / "model", "qwen2", seed=0, **QWEN2_05B)
    model = load_model(model_dir, args.dtype)
    prompt = np.random.default_rng(n).integers(1, QWEN2_05B["vocab_size"], n).tolist()
    cat = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{tmp / 'blobs'}")
    with HFAdapter(model, cat, [local], "bench", CHUNK) as kv:
        kv.checkpoint(prompt, random_cache(model, kv.layout, n - 1))
        paths = [local.path_of(k) for k in local.keys()]  # type: ignore[attr-defined]
        buffers = HostBuffers(kv.restore_buffers.keep_bytes)
        floor = floor_restore(paths, kv.layout, n - 1, buffers)

        # 1. The restore, its fixed work inside it, and the floor.
        parts: dict[str, list[float]] = {}
        timed(cat, "lookup", parts)
        for name in ("reserve", "commit"):
            timed(CacheDestination, name, parts)
        times = interleaved({"kvc": lambda: kv.restore(prompt), "floor": floor}, reps)
        fixed = {name: statistics.median(ts) for name, ts in parts.items()}
        assert kv.last_restore is not None
        lanes = kv.last_restore.report.lanes["local"]  # as the restorer chose them
        total = sum(fixed.values())
        print(f"{n} tokens {args.dtype}, {len(paths)} chunks, {lanes} lanes, median of {reps}")
        print(f"  restore  {times['kvc'] * 1e3:7.3f} ms")
        print(
            f"  floor    {times['floor'] * 1e3:7.3f} ms   ratio {times['floor'] / times['kvc']:.2f}"
        )
        for name, s in fixed.items():
            print(f"  {name:8} {s * 1e3:7.3f} ms   (inside the restore)")
        bound = times["floor"] / (times["floor"] + total)
        print(f"  fixed    {total * 1e3:7.3f} ms   bound {bound:.2f}")

        # 2. Per chunk, one thread: the floor's loop against kvc's.
        lay = kv.layout
        tok = np.asarray(prompt, np.uint32)
        match = cat.lookup("bench", kv.fingerprint.hex, tok)
        shard = match.shard
        assert shard is not None
        restorer = kv.restorer
        shape = (lay.num_layers, 2, n - 1, lay.num_kv_heads, lay.head_dim)
        offsets = {}
        for c in match.chunks:
            data = local.path_of(c.blob_key).read_bytes()  # type: ignore[attr-defined]
            offsets[c.blob_key] = len(data) - read_header(data).payload_size

        # bench_hf's floor on the calling thread, as kvc's loop below runs. Its
        # `floor_restore` with one pool worker took 7-8% longer than kvc's loop, where
        # this loop takes 3-4% less.
        def floor_one_thread() -> object:
            view = numpy_view(buf := buffers.tensor(shape, torch_dtype(lay.dtype)))
            for c in match.chunks:
                path = local.path_of(c.blob_key)  # type: ignore[attr-defined]
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    blake3.blake3(m).digest()
                    payload = np.frombuffer(m, lay.numpy_dtype, offset=offsets[c.blob_key])
                    payload = payload.reshape(lay.num_layers, 2, c.token_count, *shape[3:])
                    view[:, :, c.token_start : c.token_start + c.tokens_used] = payload[
                        :, :, : c.tokens_used
                    ]
                    del payload
            return buf

        def kvc_one_thread() -> object:
            dest = kv._caches.destination()
            dest.reserve(match.matched_tokens)
            report = RestoreReport()
            for c in match.chunks:
                decoded, _, _ = restorer._fetch_verified(
                    c, tok, match.fingerprint, shard, lay, report, 1, 1
                )
                dest.write(decoded.kv, c.token_start, c.tokens_used)
                del decoded
            dest.abort()
            return None

        one = interleaved({"kvc": kvc_one_thread, "floor": floor_one_thread}, reps)
        k = len(match.chunks)
        print("per chunk, one thread (read, verify, copy; no lookup, no commit)")
        print(f"  kvc      {one['kvc'] / k * 1e6:7.0f} us")
        print(
            f"  floor    {one['floor'] / k * 1e6:7.0f} us   ratio {one['floor'] / one['kvc']:.2f}"
        )

        # 3. The Python between the big memory operations.
        blob = paths[0].read_bytes()
        src = np.frombuffer(blob, np.uint8)
        dst = np.empty_like(src)
        warm = python_after(lambda: None, 300)
        after_hash = python_after(lambda: blake3.blake3(blob).digest(), 300)
        after_copy = python_after(lambda: np.copyto(dst, src), 300)
        print(f"a small piece of Python ({len(blob) >> 20} MiB blob)")
        print(f"  warm          {warm * 1e6:6.1f} us")
        print(f"  after a hash  {after_hash * 1e6:6.1f} us   x{after_hash / warm:.1f}")
        print(f"  after a copy  {after_copy * 1e6:6.1f} us   x{after_copy / warm:.1f}")
    cat.close()


if __name__ == "__main__":
    main()
