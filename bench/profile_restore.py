"""Where a warm restore's time goes: kvc at 1, 2 and 4 workers beside the floor at 1, 2 and 4,
the restore report's stage times (summed over worker threads), and one chunk's Python parts.

Usage (repository root, project venv):

    python bench/profile_restore.py [--tokens 32768] [--reps 7]

Builds the same prefix as bench_restore (fp16, 7B-class layout, 14.7 MB chunks) in a local
store, then runs, interleaved, `--reps` times each:

- floor N: bench_restore's mmap + blake3 (one thread per chunk) + copy, N chunks at a time;
- kvc N: `Restorer(max_parallel=N).restore`, end to end (each chunk's header known from
  the restorer's earlier runs, as for a hot prefix);
- kvc 4, headers parsed: `header_cache=0`, every header parsed, as on a prefix's first restore.

Stage times are thread-seconds: on two cores, fetch+verify + copy over the worker count
shows how much slower each chunk's hash and copy get when they share the memory bus.
Then one chunk's parts on one thread (open + mmap, header parse and checks, the plan
checks, the copy into the pool): what runs under the GIL between the hash and the copy.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_restore as br
from scratch import scratch_dir

from catalog.catalog import Catalog
from chunkstore import open_store
from chunkstore.local import LocalStore
from chunkstore.record import _byte_view, _parse, decode_chunk
from restore.checkpoint import Checkpointer
from restore.pool import PagePool
from restore.restore import Restorer, RestoreReport, _KnownHeader


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    n = args.tokens
    tmp = scratch_dir("kvc-profile-restore-")
    k, v = br.kv_like(n + 1)
    toks = np.random.default_rng(1).integers(0, 50_000, n + 1).astype(np.uint32)
    src = PagePool(br.LAYOUT, page_size=br.PAGE, num_pages=(n + 1) // br.PAGE + 2)
    route = src.new_route()
    src.append(route, k, v)
    del k, v
    cat = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{tmp / 'blobs'}")
    assert isinstance(local, LocalStore)
    with Checkpointer(cat, local, chunk_size=br.CHUNK) as cp:
        cp.checkpoint(src, route, toks[:n], br.FP)
    del src
    match = cat.lookup("default", br.FP.hex, toks)
    dst = PagePool(br.LAYOUT, page_size=br.PAGE, num_pages=n // br.PAGE + 2)
    blobs = []
    for c in match.chunks:
        path = local.path_of(c.blob_key)
        data = path.read_bytes()
        kv_at = np.asarray(decode_chunk(data).kv).__array_interface__["data"][0]
        offset = kv_at - np.frombuffer(data, np.uint8).__array_interface__["data"][0]
        blobs.append(br.Blob(path, int(offset), c.token_start, c.tokens_used))

    reports: dict[str, RestoreReport] = {}

    def kvc(
        name: str, width: int, header_cache: int = Restorer.DEFAULT_HEADER_CACHE
    ) -> Callable[[], None]:
        r = Restorer(cat, [local], max_parallel=width, header_cache=header_cache)

        def run() -> None:
            res = r.restore(dst, toks, br.FP)
            assert res.restored_tokens == n and res.route is not None
            reports[name] = res.report
            dst.release(res.route)

        return run

    fns: dict[str, Callable[[], object]] = {}
    for width in (1, 2, 4):
        fns[f"floor {width}"] = br.floor_ops(blobs, dst, n // br.PAGE, width)[
            f"mmap+blake3+copy, hash 1 thread, {width} at a time"
        ]
    for width in (1, 2, 4):
        fns[f"kvc {width}"] = kvc(f"kvc {width}", width)
    # As on a prefix's first restore: every header parsed.
    fns["kvc 4, headers parsed"] = kvc("kvc 4, headers parsed", 4, header_cache=0)
    times = br.interleaved(fns, args.reps)
    best = min(t for name, t in times.items() if name.startswith("floor"))
    print(f"{n} tokens, {len(match.chunks)} chunks, medians of {args.reps} (warm page cache)")
    for name, sec in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"  {name:22} {sec * 1e3:8.1f} ms  {best / sec:5.2f} of the best floor")
    print("stage thread-seconds of the last kvc run (ms):")
    for name, rep in sorted(reports.items()):
        print(f"  {name}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items()))

    c = match.chunks[len(match.chunks) // 2]
    view = _byte_view(local.get(c.blob_key))
    decoded = decode_chunk(view, expected_key=c.blob_key)
    known = _KnownHeader.of(decoded.header)  # as the restorer keeps it
    restorer = Restorer(cat, [local], max_parallel=1)
    assert match.shard is not None
    shard = match.shard
    pages = dst.reserve_pages(n // br.PAGE)  # kvc's pages, as the floors use them
    parts: dict[str, Callable[[], object]] = {
        "open + mmap (store.get)": lambda: local.get(c.blob_key),
        "header parse and checks": lambda: _parse(view),
        "plan checks (tokens, hashes, shard)": lambda: restorer._check_header(
            decoded, known, c, toks, br.FP.hex, shard
        ),
        "copy into the pool": lambda: dst.write_pages(
            pages, c.token_start, decoded.kv[:, :, : c.tokens_used]
        ),
    }
    print("one chunk on one thread (us):")
    for name, fn in parts.items():
        number = 200
        print(f"  {name:38} {timeit.timeit(fn, number=number) / number * 1e6:9.1f}")
    cat.close()


if __name__ == "__main__":
    main()
