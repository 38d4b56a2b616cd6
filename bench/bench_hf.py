"""transformers through kvc on the CPU: time to first token (restore vs recompute) and restore
throughput beside its same-run floor and beside what a user would do instead.

Usage (repository root, venv with `.[test,bench]`; SeaweedFS is started on loopback
for the S3 rows):

    python bench/bench_hf.py [--tokens 1024,4096,16384] [--dtypes bfloat16,float32]
                             [--reps 7] [--no-s3] [--no-recompute] [--json]
                             [--parallel N] [--cold]

The model is shaped like Qwen2-0.5B (24 layers, 14 heads, 2 kv heads, head dim 64,
hidden 896, vocab 151936) with random weights, built once under the temp directory.
For each dtype and prompt length it prints, medians of `--reps` runs:

- TTFT: recompute (prefill of the whole prompt, logits of the last position) vs kvc
  (restore the stored prefix of all but the last token, then prefill that one token);
  `--no-recompute` skips both and stores random KV of the model's shape instead of a
  prefill's (a 16k-token prefill takes minutes on this CPU; the restore does not care
  what the KV holds);
- restore: kvc's `HFAdapter.restore` into a DynamicCache from a local store (warm page
  cache), in GB/s of KV, beside the floor done by hand (issue 29): every blob mmapped,
  blake3-hashed and its payload copied once into a buffer laid out like the payload,
  the blobs over two threads (the cores), into the same kind of memory kvc restores
  into (a `HostBuffers` of the adapter's `restore_buffer_bytes`: memory of the previous
  run, recycled, when it fits, fresh huge pages otherwise); kvc and the floor are run
  in a new shuffled order every repetition; beside the ratio of their medians, the ratio
  of the CPU seconds they used (every thread; on a loaded machine the wall clock
  mostly measures the share of the cores a run got) and the median of kvc's catalog
  lookup (the floor has none: "bound" is the ratio the floor would reach with it);
  `--parallel N` sets kvc's `max_parallel` (its most lanes for local chunks: it
  takes as many as the cores while reads keep them busy), `--cold` drops
  the blobs from the page cache before every kvc and floor run;
- S3: kvc's restore from SeaweedFS beside the S3 floor of issue 14 (raw boto3 GETs of
  the same blobs, 2, 4 and 8 at a time, no verify; the fastest), in the same run;
  "S3 bound" is issue 14's bound: SeaweedFS runs on the same cores and the GET floor
  keeps them busy, so the verify and copy (the local floor's time) come on top of it;
- safetensors: one safetensors file per session (load, no verification);
- copies: full copies of the KV between the stored blob and the cache's tensors.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_restore import drop_cache, interleaved, median_s, metered
from scratch import scratch_dir

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.record import read_header
from restore.engines.hf import HFAdapter, greedy, load_model, save_random_model
from restore.engines.hf.cache import HostBuffers
from restore.engines.torch_kv import numpy_view, torch_dtype
from restore.restore import Restorer

QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": True,
}
CHUNK = 256
CORES = os.cpu_count() or 1


def floor_restore(
    paths: list[Path], layout: Any, n: int, buffers: HostBuffers
) -> Callable[[], torch.Tensor]:
    """By hand: mmap each blob, blake3 it, copy its payload once into a buffer laid out like
    the payload ([L, 2, T, H, D]: one plain copy) from `buffers` (the kind of memory kvc
    restores into), the blobs over two threads (the cores)."""
    items = []
    for p in paths:
        data = p.read_bytes()
        h = read_header(data)
        items.append((p, h.token_start, len(h.tokens), len(data) - h.payload_size))
    items.sort(key=lambda x: x[1])
    dtype = torch_dtype(layout.dtype)
    np_dtype = layout.numpy_dtype
    shape = (layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
    pool = ThreadPoolExecutor(CORES)

    def run() -> torch.Tensor:
        buf = buffers.tensor(shape, dtype)  # back to `buffers` when the caller drops it
        view = numpy_view(buf)

        def one(item: tuple[Path, int, int, int]) -> None:
            path, start, count, offset = item
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                blake3.blake3(m).digest()
                payload = np.frombuffer(m, dtype=np_dtype, offset=offset).reshape(
                    layout.num_layers, 2, count, layout.num_kv_heads, layout.head_dim
                )
                used = min(count, n - start)
                view[:, :, start : start + used] = payload[:, :, :used]
                del payload

        list(pool.map(one, items))
        return buf

    return run


def s3_floor(srv: Any, s3: Any, blob_keys: list[str]) -> dict[str, Callable[[], object]]:
    """Issue 14's S3 floor: raw boto3 GETs of the same blobs, 2, 4 and 8 (the store's
    max_concurrency) at a time, no response checksum, no verify."""
    import boto3
    import botocore.config

    widths = sorted({CORES, 2 * CORES, s3.max_concurrency})
    client = boto3.client(
        "s3",
        endpoint_url=srv.endpoint_url,
        region_name=srv.region,
        config=botocore.config.Config(
            response_checksum_validation="when_required", max_pool_connections=max(widths)
        ),
    )
    keys = [s3.object_key(k) for k in blob_keys]

    def gets(width: int) -> Callable[[], object]:
        workers = ThreadPoolExecutor(width)
        return lambda: list(
            workers.map(lambda k: client.get_object(Bucket=s3.bucket, Key=k)["Body"].read(), keys)
        )

    return {f"s3 floor {w}": gets(w) for w in widths}


def random_cache(model: Any, layout: Any, n: int) -> Any:
    """A DynamicCache of n positions of random KV shaped like the model's."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(n)
    for i in range(layout.num_layers):
        k, v = (
            torch.randn(1, layout.num_kv_heads, n, layout.head_dim, generator=gen).to(
                torch_dtype(layout.dtype)
            )
            for _ in "kv"
        )
        cache.update(k, v, i)
    return cache


def safetensors_alt(tmp: Path, cache: Any) -> Callable[[], object]:
    from safetensors.torch import load_file, save_file

    path = tmp / "session.safetensors"
    save_file(
        {
            f"{i}.{kv}": getattr(layer, kv).contiguous()
            for i, layer in enumerate(cache.layers)
            for kv in ("keys", "values")
        },
        str(path),
    )
    # What a user gets from kvc is KV in memory: load, then materialise each tensor (one copy).
    return lambda: [t.clone() for t in load_file(str(path)).values()]


def bench(
    model_dir: Path,
    dtype: str,
    n: int,
    reps: int,
    s3_srv: Any,
    s3: ChunkStore | None,
    tmp: Path,
    recompute: bool,
    parallel: int = Restorer.DEFAULT_PARALLEL,
    cold: bool = False,
) -> dict[str, Any]:
    model = load_model(model_dir, dtype)
    vocab = QWEN2_05B["vocab_size"]
    prompt = np.random.default_rng(n).integers(1, vocab, n).tolist()
    work = Path(tempfile.mkdtemp(dir=tmp))
    cat = Catalog.open(f"sqlite:///{work / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{work / 'blobs'}")
    out: dict[str, Any] = {"dtype": dtype, "tokens": n, "load_before": os.getloadavg()[0]}

    with HFAdapter(model, cat, [local], "bench", CHUNK, max_parallel=parallel) as kv:
        out["fingerprint_s"] = kv.fingerprint_seconds
        if recompute:
            # Recompute: what the engine does without kvc (the whole prompt, then the first token).
            rec = []
            for _ in range(3 if n <= 4096 else 1):  # 16k tokens take minutes on a CPU
                t0 = time.perf_counter()
                greedy(model, prompt, kv.new_cache(), 0, 1)
                rec.append(time.perf_counter() - t0)
            out["recompute_s"] = statistics.median(rec)
            cache = kv.new_cache()
            greedy(model, prompt[:-1], cache, 0, 0)  # the cache to store: all but the last token
        else:
            cache = random_cache(model, kv.layout, n - 1)
        result = kv.checkpoint(prompt, cache)
        out["checkpoint_s"] = result.seconds["total"]
        kv_bytes = (n - 1) * kv.layout.bytes_per_token
        out["kv_mb"] = kv_bytes / 1e6
        lookups: list[float] = []

        def restore_local() -> Any:
            c, got = kv.restore(prompt)
            assert got == n - 1, got
            assert kv.last_restore is not None
            lookups.append(kv.last_restore.report.seconds["lookup"])
            return c

        paths = [local.path_of(k) for k in local.keys()]  # type: ignore[attr-defined]
        floor = floor_restore(paths, kv.layout, n - 1, HostBuffers(kv.restore_buffers.keep_bytes))
        fns, busy = metered({"kvc": restore_local, "floor": floor})
        times = interleaved(fns, reps, (lambda: drop_cache(paths)) if cold else None)
        out["restore_local_s"], out["floor_s"] = times["kvc"], times["floor"]
        # CPU seconds per run (every thread): what a loaded machine's noise does not change.
        out["cpu_ratio"] = busy["floor"][0] / busy["kvc"][0]
        out["lookup_s"] = statistics.median(lookups)
        if recompute:

            def ttft_kvc() -> Any:
                c, got = kv.restore(prompt)
                return greedy(model, prompt, c, got, 1)

            out["ttft_kvc_s"] = median_s(ttft_kvc, reps)
        try:
            out["safetensors_s"] = median_s(safetensors_alt(work, cache), reps)
        except ImportError:
            print("safetensors missing: pip install -e '.[bench]'", file=sys.stderr)
    if s3 is not None:
        with HFAdapter(model, cat, [s3], "bench-s3", CHUNK) as kv3:
            kv3.checkpoint(prompt, cache)
            match = cat.lookup("bench-s3", kv3.fingerprint, prompt)

            def restore_s3() -> Any:
                c, got = kv3.restore(prompt)
                assert got == n - 1, got
                return c

            floors = s3_floor(s3_srv, s3, [c.blob_key for c in match.chunks])
            s3_times = interleaved({"kvc": restore_s3, **floors}, max(3, reps // 2))
            out["restore_s3_s"] = s3_times.pop("kvc")
            out["s3_floor_s"] = min(s3_times.values())
    local.close()
    cat.close()
    out["load_after"] = os.getloadavg()[0]
    gb = kv_bytes / 1e9
    out["restore_local_gbs"] = gb / out["restore_local_s"]
    out["floor_gbs"] = gb / out["floor_s"]
    out["ratio_to_floor"] = out["floor_s"] / out["restore_local_s"]
    # What the floor would reach with kvc's lookup added: the best ratio kvc can have.
    out["lookup_bound"] = out["floor_s"] / (out["floor_s"] + out["lookup_s"])
    if recompute:
        out["ttft_speedup"] = out["recompute_s"] / out["ttft_kvc_s"]
    if "restore_s3_s" in out:
        out["restore_s3_gbs"] = gb / out["restore_s3_s"]
        out["s3_ratio"] = out["s3_floor_s"] / out["restore_s3_s"]
        # Issue 14's S3 bound: SeaweedFS shares the two cores with the client and the GET
        # floor keeps them busy, so kvc's verify and copy of the same blobs (the local
        # floor's work, on both cores) come on top of the GETs: the best ratio kvc can have.
        out["s3_bound"] = out["s3_floor_s"] / (out["s3_floor_s"] + out["floor_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--parallel", type=int, default=Restorer.DEFAULT_PARALLEL, help="kvc's max_parallel"
    )
    ap.add_argument("--cold", action="store_true", help="page cache dropped before each run")
    args = ap.parse_args()
    tmp = scratch_dir("kvc-bench-hf-")
    model_dir = save_random_model(tmp / "qwen2-0.5b-shaped", "qwen2", seed=0, **QWEN2_05B)
    rows: list[dict[str, Any]] = []

    def run_all(srv: Any, s3: ChunkStore | None) -> None:
        recompute = not args.no_recompute
        for dtype in args.dtypes.split(","):
            for n in (int(x) for x in args.tokens.split(",")):
                row = bench(
                    model_dir,
                    dtype,
                    n,
                    args.reps,
                    srv,
                    s3,
                    tmp,
                    recompute,
                    parallel=args.parallel,
                    cold=args.cold,
                )
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)

    if args.no_s3:
        run_all(None, None)
    else:
        from tests.services import start_seaweedfs

        with start_seaweedfs() as srv:
            os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
            s3 = open_store(
                f"s3://{srv.bucket}/bench-hf?endpoint_url={srv.endpoint_url}&region={srv.region}"
            )
            run_all(srv, s3)
            s3.close()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    nan = float("nan")
    print(
        f"transformers Qwen2-0.5B-shaped model, random weights, CPU ({CORES} cores), torch "
        f"{torch.__version__}, kvc max_parallel={args.parallel}, "
        f"{'cold' if args.cold else 'warm'} page cache"
    )
    print(
        f"{'dtype':<9}{'tokens':>7}{'KV MB':>7}{'recompute s':>12}{'kvc TTFT s':>11}{'speedup':>8}"
        f"{'restore GB/s':>13}{'floor GB/s':>11}{'ratio':>6}{'CPU ratio':>10}{'lookup ms':>10}{'bound':>6}"
        f"{'S3 GB/s':>8}{'S3 ratio':>9}{'S3 bound':>9}{'safetensors GB/s':>17}{'load':>10}"
    )
    for r in rows:
        st = r["kv_mb"] / 1e3 / r["safetensors_s"] if "safetensors_s" in r else nan
        speedup = f"{r['ttft_speedup']:>7.1f}x" if "ttft_speedup" in r else f"{'-':>8}"
        print(
            f"{r['dtype']:<9}{r['tokens']:>7}{r['kv_mb']:>7.0f}{r.get('recompute_s', nan):>12.2f}"
            f"{r.get('ttft_kvc_s', nan):>11.3f}{speedup}{r['restore_local_gbs']:>13.2f}"
            f"{r['floor_gbs']:>11.2f}{r['ratio_to_floor']:>6.2f}{r['cpu_ratio']:>10.2f}{r['lookup_s'] * 1e3:>10.2f}"
            f"{r['lookup_bound']:>6.2f}{r.get('restore_s3_gbs', nan):>8.2f}{r.get('s3_ratio', nan):>9.2f}"
            f"{r.get('s3_bound', nan):>9.2f}"
            f"{st:>17.2f}{r['load_before']:>5.1f}-{r['load_after']:<4.1f}"
        )
    print(
        "copies of the KV between a stored blob and the cache's tensors: 1 (the copy into the "
        "cache buffer; the blob is mmapped, hashed in place, and the layers' tensors are views "
        "of that buffer); a checkpoint: 1 (the cache's tensors into the record buffer)"
    )


if __name__ == "__main__":
    main()
