"""transformers through kvc into GPU memory: `HFAdapter.restore` into CUDA tensors beside a
pinned-memory host-to-device copy floor of the same bytes, in the same run.

Usage (repository root; `bench/gpu_check/run.py` runs it on a GPU machine):

    python bench/bench_hf_cuda.py [--tokens 1024,4096,16384] [--dtypes bfloat16,float32]
                                  [--reps 5] [--model qwen2-0.5b|demo] [--device cuda]
                                  [--json-out FILE]

The model (random weights, built once under the temp directory) is shaped like
Qwen2-0.5B, or kvc's small demo Llama with `--model demo`. For each dtype and prompt
length, medians of `--reps` runs:

- restore: kvc's restore of all but the last prompt token from a local store (warm page
  cache) into a DynamicCache on the device, synchronized: read, verify, one copy into
  pinned host memory, one host-to-device copy;
- floor: the same number of bytes copied from a pinned host buffer to a device buffer,
  both allocated before timing (the transfer alone);
- exact: the restored K/V equal, bit for bit, the K/V the model computed on the device;
- TTFT: recompute (prefill of the whole prompt) vs kvc (restore, then the last token).

`--device cpu` runs everything but the GPU (the floor is then a host-to-host copy): the
tests use it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_hf import CHUNK, QWEN2_05B
from bench_restore import median_s
from scratch import scratch_dir

from catalog.catalog import Catalog
from chunkstore import open_store
from restore.engines.hf import DEMO_MODEL, HFAdapter, greedy, load_model, save_random_model
from tests.restore.engines.hf_worker import cache_digests

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-0.5b": ("qwen2", QWEN2_05B),
    "demo": ("llama", DEMO_MODEL),
}
# No CUDA device: what run.py and this script exit with.
EXIT_NO_GPU = 3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_floor(nbytes: int, device: torch.device) -> Callable[[], None]:
    """Copy `nbytes` from a pinned host buffer into a device buffer, both allocated here, once
    (a plain host buffer and a host copy when `device` is the CPU)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.fill_(1)  # touched: its pages exist before the timed copies
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run() -> None:
        target.copy_(host, non_blocking=True)
        synchronize(device)

    return run


def bench(
    model_dir: Path, dtype: str, n: int, reps: int, device: torch.device, vocab: int, tmp: Path
) -> dict[str, Any]:
    model = load_model(model_dir, dtype).to(device)
    prompt = np.random.default_rng(n).integers(1, vocab, n).tolist()
    work = Path(tempfile.mkdtemp(dir=tmp))
    cat = Catalog.open(f"sqlite:///{work / 'catalog.db'}", upgrade=True)
    local = open_store(f"file://{work / 'blobs'}")
    out: dict[str, Any] = {"dtype": dtype, "tokens": n, "device": str(device)}
    with HFAdapter(model, cat, [local], "bench", CHUNK) as kv:
        computed = kv.new_cache()
        greedy(model, prompt[:-1], computed, 0, 0)  # all but the last token, on the device
        kv.checkpoint(prompt, computed)
        kv_bytes = (n - 1) * kv.layout.bytes_per_token
        out["kv_mb"] = kv_bytes / 1e6

        def restore() -> Any:
            cache, got = kv.restore(prompt)
            synchronize(device)
            assert got == n - 1, got
            return cache

        restored = restore()
        out["on_device"] = all(layer.keys.device == model.device for layer in restored.layers)
        out["exact"] = cache_digests(restored) == cache_digests(computed)  # bit for bit
        del restored
        out["restore_s"] = median_s(restore, reps)
        out["floor_s"] = median_s(copy_floor(kv_bytes, device), reps)

        def recompute() -> None:
            greedy(model, prompt, kv.new_cache(), 0, 1)
            synchronize(device)

        def ttft_kvc() -> None:
            cache, got = kv.restore(prompt)
            greedy(model, prompt, cache, got, 1)
            synchronize(device)

        out["recompute_s"] = median_s(recompute, reps)
        out["ttft_kvc_s"] = median_s(ttft_kvc, reps)
    local.close()
    cat.close()
    gb = kv_bytes / 1e9
    out["restore_gbs"] = gb / out["restore_s"]
    out["floor_gbs"] = gb / out["floor_s"]
    out["ratio_to_floor"] = out["floor_s"] / out["restore_s"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'dtype':<9}{'tokens':>7}{'KV MB':>8}{'restore ms':>12}{'GB/s':>7}{'floor GB/s':>12}"
        f"{'ratio':>7}{'exact':>7}{'recompute ms':>14}{'kvc TTFT ms':>13}"
    ]
    for r in rows:
        lines.append(
            f"{r['dtype']:<9}{r['tokens']:>7}{r['kv_mb']:>8.1f}{r['restore_s'] * 1e3:>12.2f}"
            f"{r['restore_gbs']:>7.2f}{r['floor_gbs']:>12.2f}{r['ratio_to_floor']:>7.2f}"
            f"{'yes' if r['exact'] and r['on_device'] else 'NO':>7}"
            f"{r['recompute_s'] * 1e3:>14.1f}{r['ttft_kvc_s'] * 1e3:>13.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"bench_hf_cuda: no CUDA device (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}): nothing measured",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    model_type, config = MODELS[args.model]
    tmp = scratch_dir("kvc-bench-hf-cuda-")
    model_dir = save_random_model(tmp / args.model, model_type, seed=0, **config)
    rows = []
    for dtype in args.dtypes.split(","):
        for n in (int(x) for x in args.tokens.split(",")):
            row = bench(model_dir, dtype, n, args.reps, device, config["vocab_size"], tmp)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    where = (
        f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
        if device.type == "cuda"
        else "CPU"
    )
    print(f"kvc restore into {where}, {args.model}-shaped model, torch {torch.__version__}")
    print(table(rows))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["exact"] and r["on_device"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
