"""transformers through kvc on the CPU: time to first token (restore vs recompute) and restore
throughput beside its same-run floor and beside what a user would do instead.

Usage (repository root, venv with `.[test,bench]`; SeaweedFS is started on loopback
for the S3 rows):

    python bench/bench_hf.py [--tokens 1024,4096,16384] [--dtypes bfloat16,float32]
                             [--reps 5] [--no-s3] [--json]

The model is shaped like Qwen2-0.5B (24 layers, 14 heads, 2 kv heads, head dim 64,
hidden 896, vocab 151936) with random weights, built once under the temp directory.
For each dtype and prompt length it prints, medians of `--reps` runs:

- TTFT: recompute (prefill of the whole prompt, logits of the last position) vs kvc
  (restore the stored prefix of all but the last token, then prefill that one token);
- restore: kvc's restore into a DynamicCache from a local store (warm page cache) and
  from S3, in GB/s of KV, beside the floor done by hand in the same run (every blob
  mmapped, blake3-hashed and copied once into the cache buffer, blobs split over all
  cores), and beside one safetensors file per session (load, no verification);
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

from bench_restore import median_s

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.record import read_header
from restore.engines.hf import HFAdapter, greedy, load_model, save_random_model

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


def floor_restore(paths: list[Path], layout: Any, n: int) -> Callable[[], torch.Tensor]:
    """By hand: mmap each blob, blake3 it, copy its payload once into a cache buffer laid
    out like the payload ([L, 2, T, H, D]: one plain copy), fresh memory in huge pages;
    blobs are split over every core."""
    headers = []
    for p in paths:
        data = p.read_bytes()
        h = read_header(data)
        headers.append((p, h.token_start, len(h.tokens), len(data) - h.payload_size))
    headers.sort(key=lambda x: x[1])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[layout.dtype]
    np_dtype = layout.numpy_dtype
    shape = (layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)
    pool = ThreadPoolExecutor(CORES)
    nbytes = int(np.prod(shape)) * np_dtype.itemsize

    def run() -> torch.Tensor:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)  # fresh memory faults in 3x faster in huge pages
        buf = torch.frombuffer(memory, dtype=dtype).view(shape)
        view = (buf.view(torch.int16) if dtype == torch.bfloat16 else buf).numpy()

        def one(item: tuple[Path, int, int, int]) -> None:
            path, start, count, offset = item
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                blake3.blake3(m).digest()
                payload = np.frombuffer(m, dtype=np_dtype, offset=offset).reshape(
                    layout.num_layers, 2, count, layout.num_kv_heads, layout.head_dim
                )
                used = min(count, n - start)
                view[:, :, start : start + used] = payload[:, :, :used].view(view.dtype)
                del payload

        list(pool.map(one, headers))
        return buf

    return run


def safetensors_alt(tmp: Path, cache: Any) -> Callable[[], object]:
    from safetensors.torch import load_file, save_file

    path = tmp / "session.safetensors"
    save_file(
        {f"{i}.{kv}": getattr(layer, kv).contiguous() for i, layer in enumerate(cache.layers) for kv in ("keys", "values")},
        str(path),
    )
    # What a user gets from kvc is KV in memory: load, then materialise each tensor (one copy).
    return lambda: [t.clone() for t in load_file(str(path)).values()]


def bench(model_dir: Path, dtype: str, n: int, reps: int, s3: ChunkStore | None, tmp: Path) -> dict[str, Any]:
    model = load_model(model_dir, dtype)
    vocab = QWEN2_05B["vocab_size"]
    prompt = np.random.default_rng(n).integers(1, vocab, n).tolist()
    work = Path(tempfile.mkdtemp(dir=tmp))
    cat = Catalog.open(f"sqlite:///{work / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{work / 'blobs'}")
    out: dict[str, Any] = {"dtype": dtype, "tokens": n}

    with HFAdapter(model, cat, [local], "bench", CHUNK) as kv:
        out["fingerprint_s"] = kv.fingerprint_seconds

        # Recompute: what the engine does without kvc (the whole prompt, then the first token).
        def recompute() -> Any:
            return greedy(model, prompt, kv.new_cache(), 0, 1)

        rec = []
        for _ in range(3 if n <= 4096 else 1):  # 16k tokens take minutes on a CPU
            t0 = time.perf_counter()
            recompute()
            rec.append(time.perf_counter() - t0)
        out["recompute_s"] = statistics.median(rec)
        cache = kv.new_cache()
        greedy(model, prompt[:-1], cache, 0, 0)  # the cache to store: all but the last token
        result = kv.checkpoint(prompt, cache)
        out["checkpoint_s"] = result.seconds["total"]
        kv_bytes = (n - 1) * kv.layout.bytes_per_token
        out["kv_mb"] = kv_bytes / 1e6

        def restore_local() -> Any:
            c, got = kv.restore(prompt)
            assert got == n - 1, got
            return c

        def ttft_kvc() -> Any:
            c, got = kv.restore(prompt)
            return greedy(model, prompt, c, got, 1)

        out["restore_local_s"] = median_s(restore_local, reps)
        out["ttft_kvc_s"] = median_s(ttft_kvc, reps)
        paths = [local.path_of(k) for k in local.keys()]  # type: ignore[attr-defined]
        out["floor_s"] = median_s(floor_restore(paths, kv.layout, n - 1), reps)
        try:
            out["safetensors_s"] = median_s(safetensors_alt(work, cache), reps)
        except ImportError:
            print("safetensors missing: pip install -e '.[bench]'", file=sys.stderr)
    if s3 is not None:
        with HFAdapter(model, cat, [s3], "bench-s3", CHUNK) as kv3:
            kv3.checkpoint(prompt, cache)

            def restore_s3() -> Any:
                c, got = kv3.restore(prompt)
                assert got == n - 1, got
                return c

            out["restore_s3_s"] = median_s(restore_s3, reps)
    local.close()
    cat.close()
    gb = kv_bytes / 1e9
    out["restore_local_gbs"] = gb / out["restore_local_s"]
    out["floor_gbs"] = gb / out["floor_s"]
    out["ratio_to_floor"] = out["floor_s"] / out["restore_local_s"]
    out["ttft_speedup"] = out["recompute_s"] / out["ttft_kvc_s"]
    if "restore_s3_s" in out:
        out["restore_s3_gbs"] = gb / out["restore_s3_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-hf-"))
    model_dir = save_random_model(tmp / "qwen2-0.5b-shaped", "qwen2", seed=0, **QWEN2_05B)
    rows: list[dict[str, Any]] = []

    def run_all(s3: ChunkStore | None) -> None:
        for dtype in args.dtypes.split(","):
            for n in (int(x) for x in args.tokens.split(",")):
                row = bench(model_dir, dtype, n, args.reps, s3, tmp)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)

    if args.no_s3:
        run_all(None)
    else:
        from tests.services import start_seaweedfs

        with start_seaweedfs() as srv:
            os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
            s3 = open_store(f"s3://{srv.bucket}/bench-hf?endpoint_url={srv.endpoint_url}&region={srv.region}")
            run_all(s3)
            s3.close()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"transformers Qwen2-0.5B-shaped model, random weights, CPU ({CORES} cores), torch {torch.__version__}")
    print(
        f"{'dtype':<9}{'tokens':>7}{'KV MB':>8}{'recompute s':>13}{'kvc TTFT s':>12}{'speedup':>9}"
        f"{'restore GB/s':>14}{'floor GB/s':>12}{'ratio':>7}{'S3 GB/s':>9}{'safetensors GB/s':>18}"
    )
    for r in rows:
        st = r["kv_mb"] / 1e3 / r["safetensors_s"] if "safetensors_s" in r else float("nan")
        print(
            f"{r['dtype']:<9}{r['tokens']:>7}{r['kv_mb']:>8.0f}{r['recompute_s']:>13.2f}{r['ttft_kvc_s']:>12.3f}"
            f"{r['ttft_speedup']:>8.1f}x{r['restore_local_gbs']:>14.2f}{r['floor_gbs']:>12.2f}"
            f"{r['ratio_to_floor']:>7.2f}{r.get('restore_s3_gbs', float('nan')):>9.2f}{st:>18.2f}"
        )
    print("copies of the KV between a stored blob and the cache's tensors: 1 (the copy into the cache buffer; the blob is mmapped, hashed in place, and the layers' tensors are views of that buffer)")


if __name__ == "__main__":
    main()
