"""kvc beside LMCache 0.5.6 on the same KV, in the same run: restore/retrieve, store/checkpoint,
and what each does about durability and damage, established by running both.

Usage (repository root, kvc's venv with `.[hf]`; LMCache in a venv of its own, since it pins
numpy <= 2.2.6 and kvc needs >= 2.3):

    python3.11 -m venv /path/lmcache && /path/lmcache/bin/pip install lmcache==0.5.6
    LMCACHE_PYTHON=/path/lmcache/bin/python python bench/bench_lmcache.py \\
        [--tokens 1024,4096,16384] [--reps 5] [--json]

The KV is shaped like Qwen2-0.5B's (24 layers, 2 kv heads, head dim 64, bfloat16), drawn
from a seeded generator once per size and saved to a .npy file that both sides load: the
same bytes. kvc runs in this process; LMCache runs in `bench/lmcache_worker.py`, started
with $LMCACHE_PYTHON, which times each LMCache call itself. Each repetition runs every
operation once in a new shuffled order (fixed seed, as `bench_restore.interleaved`), so
the machine's noise falls on both alike; the table shows medians of `--reps`.

Per size and system, one table:

- disk read: LMCache's local-disk retrieve (engine with `local_cpu=False`, so the chunk
  files are read; warm page cache) into a preallocated CPU tensor through a small
  connector (`CPUTensorConnector`; none shipped copies CPU tensors), vs kvc's
  `HFAdapter.restore` from a local store (warm page cache) into a new DynamicCache,
  every blob blake3-verified;
- verified floor: what any verified restore of kvc's blobs costs on this machine, by hand,
  in the same run (`bench_hf.floor_restore`: each blob mmapped, blake3-hashed and its
  payload copied once into a recycled buffer, the blobs over two threads); kvc's restore
  cannot be faster, so where it is above LMCache's disk read, so is verification itself;
- CPU tier: LMCache's in-memory tier retrieve (kvc has none: its page pool is another
  path, see "Restore into a page pool");
- store returns / on disk: LMCache's `store` return and the moment every chunk is in its
  disk backend's index (a retrieve before that misses: its writes are asynchronous); kvc's
  `HFAdapter.checkpoint`, which returns when every blob is written, fsynced and
  catalogued (both columns);
- fsyncs: os.fsync/os.fdatasync calls during one store, counted by wrapping both (the
  SQLite catalog's own syncs happen in C and are not counted);
- flipped byte / truncated file: a new sequence stored, one byte of its second chunk's
  file flipped (or the file cut to half), another sequence read, then the damaged one
  read back: "served" (a full hit; the last lines say how many values differ) or
  "detected" (a shorter hit or an error);
- new process: a process started after the storing one closed, asked for the same
  tokens: hit or miss.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_hf import CHUNK, QWEN2_05B, floor_restore
from damage import damage_file

from catalog.catalog import Catalog
from chunkstore import open_store
from chunkstore.local import LocalStore
from chunkstore.record import read_header
from restore.engines.hf import HFAdapter, load_model, save_random_model
from restore.engines.hf.cache import HostBuffers

LAYERS = QWEN2_05B["num_hidden_layers"]
KV_HEADS = QWEN2_05B["num_key_value_heads"]
HEAD_DIM = QWEN2_05B["hidden_size"] // QWEN2_05B["num_attention_heads"]
# Only the KV layout matters here (no forward pass runs): the vocabulary and MLP are shrunk
# so that building and fingerprinting the random-weight model takes a moment.
MODEL = {**QWEN2_05B, "vocab_size": 1024, "intermediate_size": 256}
WORKER = Path(__file__).resolve().parent / "lmcache_worker.py"
FLIP, TRUNCATE = 1_000, 1_001  # token variants kept apart from the timed ones


def tokens_of(n: int, variant: int) -> list[int]:
    """`n` token ids; each `variant` has another first token, so every chunk hash differs
    (lmcache_worker.tokens_of makes the same ids)."""
    ids = np.random.default_rng(n).integers(1, 150_000, n)
    ids[0] = 150_000 + variant
    return [int(t) for t in ids]


def make_kv(n: int, path: Path) -> torch.Tensor:
    """The KV of `n` tokens, [layers, 2, tokens, kv heads, head dim] bf16, seeded; saved as
    its bf16 bits (int16) for the LMCache side."""
    g = torch.Generator().manual_seed(n)
    kv = torch.randn((LAYERS, 2, n, KV_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16)
    np.save(path, kv.view(torch.int16).numpy())
    return kv


def cache_of(kv: torch.Tensor, adapter: HFAdapter) -> DynamicCache:
    """A DynamicCache holding `kv` ([1, kv heads, tokens, head dim] per layer, as a model's
    forward leaves it)."""
    cache = adapter.new_cache()
    for layer in range(LAYERS):
        keys = kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous()
        values = kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(keys, values, layer)
    return cache


def equal_to(cache: DynamicCache, kv: torch.Tensor) -> bool:
    return all(
        torch.equal(layer.keys[0].transpose(0, 1), kv[i, 0])
        and torch.equal(layer.values[0].transpose(0, 1), kv[i, 1])
        for i, layer in enumerate(cache.layers)
    )


@contextmanager
def counting_syncs() -> Iterator[Counter[str]]:
    """Count os.fsync/os.fdatasync calls made inside the block."""
    calls: Counter[str] = Counter()
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync")}

    def counter(name: str) -> Callable[[Any], None]:
        def call(fd: Any) -> None:
            calls[name] += 1
            real[name](fd)

        return call

    for name in real:
        setattr(os, name, counter(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


class LMCacheWorker:
    """bench/lmcache_worker.py in LMCache's venv, one JSON request and answer a line."""

    def __init__(self, python: str, kv_dir: Path, disk: Path, torch_threads: int) -> None:
        # LMCache hashes chunks with Python's hash() when vLLM is absent: PYTHONHASHSEED fixed
        # (as it tells production users to) so that a new process could find its chunks.
        env = {
            **os.environ,
            "LMCACHE_TRACK_USAGE": "false",
            "PYTHONHASHSEED": "0",
            "PYTHONPATH": "",
        }
        self.proc = subprocess.Popen(
            [
                python,
                str(WORKER),
                "--kv-dir",
                str(kv_dir),
                "--disk",
                str(disk),
                "--torch-threads",
                str(torch_threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
            env=env,
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the LMCache worker exited ({self.proc.wait()}); see its stderr above"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self("close")
        self.proc.wait(timeout=60)


def kvc_damaged(
    adapter: HFAdapter, local: LocalStore, kv: torch.Tensor, n: int, variant: int, damage: str
) -> dict[str, Any]:
    """Checkpoint a new sequence (the bench's KV negated), damage the blob of its second
    chunk, restore: served or detected (the same test as lmcache_worker.Worker.damaged)."""
    tokens = tokens_of(n, variant)
    kv = -kv
    before = set(local.keys())
    adapter.checkpoint(tokens, cache_of(kv, adapter))
    blobs = {
        read_header(local.path_of(k).read_bytes()).token_start: local.path_of(k)
        for k in set(local.keys()) - before
    }
    path = blobs[CHUNK]
    damage_file(path, damage)
    adapter.restore([*tokens_of(n, 0), 0])  # another request in between, as on the LMCache side
    try:
        cache, got = adapter.restore([*tokens, 0])
    except Exception as e:
        return {"verdict": "detected", "detail": f"{type(e).__name__}: {e}"}
    if got < n:
        return {"verdict": "detected", "detail": f"restored {got} of {n} tokens"}
    same = "equal to" if equal_to(cache, kv) else "different from"
    return {"verdict": "served", "detail": f"full restore, bytes {same} the KV stored"}


def kvc_probe(model_dir: str, db: str, store_url: str, kv_path: str, n: int) -> dict[str, Any]:
    """In a new process: restore the stored tokens from the same catalog and store."""
    model = load_model(model_dir, "bfloat16")
    kv = torch.from_numpy(np.load(kv_path)).view(torch.bfloat16)
    cat = Catalog.open(db)
    local = open_store(store_url)
    with HFAdapter(model, cat, [local], "bench", CHUNK) as adapter:
        cache, got = adapter.restore([*tokens_of(n, 0), 0])
        verdict = "hit" if got == n and equal_to(cache, kv) else "miss"
    local.close()
    cat.close()
    return {"verdict": verdict, "hit": got, "detail": f"restored {got} of {n} tokens, verified"}


def bench_size(
    adapter: HFAdapter, local: LocalStore, lmc: LMCacheWorker, n: int, reps: int, tmp: Path
) -> list[dict[str, Any]]:
    """One size: the interleaved timings and the damage checks of both systems, two rows."""
    kv = make_kv(n, tmp / f"kv_{n}.npy")
    cache = cache_of(kv, adapter)
    tokens = tokens_of(n, 0)
    adapter.checkpoint(tokens, cache)
    lmc("load", n=n)
    # Same bytes back on both sides before anything is timed.
    restored, got = adapter.restore([*tokens, 0])
    assert got == n and equal_to(restored, kv), "kvc did not restore the KV it stored"
    del restored  # its host buffer goes back to the adapter for the timed restores
    match = adapter.last_restore.match if adapter.last_restore is not None else None
    assert match is not None
    paths = [local.path_of(c.blob_key) for c in match.chunks]
    floor = floor_restore(paths, adapter.layout, n, HostBuffers(adapter.restore_buffers.keep_bytes))
    for tier in ("disk", "cpu"):
        answer = lmc("retrieve", n=n, tier=tier)
        assert answer["equal"], f"LMCache {tier} retrieve did not return the KV: {answer}"

    variant = 1
    times: dict[str, list[float]] = {}

    def kvc_restore() -> None:
        t0 = time.perf_counter()
        _, got = adapter.restore([*tokens, 0])
        times.setdefault("kvc_restore", []).append(time.perf_counter() - t0)
        assert got == n, got

    def kvc_checkpoint() -> None:
        nonlocal variant
        variant += 1
        t0 = time.perf_counter()
        adapter.checkpoint(tokens_of(n, variant), cache)
        times.setdefault("kvc_checkpoint", []).append(time.perf_counter() - t0)

    def verified_floor() -> None:
        t0 = time.perf_counter()
        floor()
        times.setdefault("verified_floor", []).append(time.perf_counter() - t0)

    def lmc_store() -> None:
        nonlocal variant
        variant += 1
        answer = lmc("store", n=n, variant=variant)
        times.setdefault("lmc_store_returns", []).append(answer["returned_s"])
        times.setdefault("lmc_store_on_disk", []).append(answer["on_disk_s"])

    def lmc_retrieve(tier: str) -> Callable[[], None]:
        def run() -> None:
            answer = lmc("retrieve", n=n, tier=tier)
            assert answer["hit"] == n, answer
            times.setdefault(f"lmc_{tier}", []).append(answer["s"])

        return run

    ops = {
        "kvc_restore": kvc_restore,
        "kvc_checkpoint": kvc_checkpoint,
        "verified_floor": verified_floor,
        "lmc_store": lmc_store,
        "lmc_disk": lmc_retrieve("disk"),
        "lmc_cpu": lmc_retrieve("cpu"),
    }
    for fn in ops.values():
        fn()  # warm-up, not kept
    times.clear()
    names = list(ops)
    order = random.Random(0)
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            ops[name]()
    med = {name: statistics.median(ts) for name, ts in times.items()}

    variant += 1
    with counting_syncs() as calls:
        adapter.checkpoint(tokens_of(n, variant), cache)
    kvc_fsyncs = sum(calls.values())
    lmc_fsyncs = lmc("store", n=n, variant=variant + 1)["fsyncs"]
    kv_mb = kv.numel() * kv.element_size() / 1e6
    common = {"tokens": n, "kv_mb": kv_mb, "reps": reps}
    return [
        {
            **common,
            "system": "LMCache",
            "read_s": med["lmc_disk"],
            "cpu_tier_s": med["lmc_cpu"],
            "floor_s": None,
            "store_returns_s": med["lmc_store_returns"],
            "on_disk_s": med["lmc_store_on_disk"],
            "fsyncs": lmc_fsyncs,
            "flipped": lmc("damaged", n=n, variant=FLIP, damage="flip"),
            "truncated": lmc("damaged", n=n, variant=TRUNCATE, damage="truncate"),
        },
        {
            **common,
            "system": "kvc",
            "read_s": med["kvc_restore"],
            "cpu_tier_s": None,
            "floor_s": med["verified_floor"],
            "store_returns_s": med["kvc_checkpoint"],
            "on_disk_s": med["kvc_checkpoint"],
            "fsyncs": kvc_fsyncs,
            "flipped": kvc_damaged(adapter, local, kv, n, FLIP, "flip"),
            "truncated": kvc_damaged(adapter, local, kv, n, TRUNCATE, "truncate"),
        },
    ]


def bench(
    python: str, sizes: list[int], reps: int, torch_threads: int, tmp: Path
) -> list[dict[str, Any]]:
    model_dir = save_random_model(tmp / "qwen2-0.5b-kv-shaped", "qwen2", seed=0, **MODEL)
    model = load_model(model_dir, "bfloat16")
    db = f"sqlite:///{tmp / 'catalog.db'}"
    store_url = f"file://{tmp / 'blobs'}"
    cat = Catalog.open(db, upgrade=True)
    local = open_store(store_url)
    assert isinstance(local, LocalStore)
    lmc = LMCacheWorker(python, tmp, tmp / "lmcache-disk", torch_threads)
    print(f"LMCache {lmc.hello['lmcache']} worker ready", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with HFAdapter(model, cat, [local], "bench", CHUNK) as adapter:
        for n in sizes:
            rows += bench_size(adapter, local, lmc, n, reps, tmp)
            for row in rows[-2:]:
                print(json.dumps(row), file=sys.stderr)
    lmc_source_fsync = lmc("fsync_in_source")["found"]
    lmc.close()
    local.close()
    cat.close()

    # After both storing processes have closed: a new process of each asks for the KV.
    probe = LMCacheWorker(python, tmp, tmp / "lmcache-disk", torch_threads)
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1) as pool:
        for row in rows:
            n = row["tokens"]
            if row["system"] == "LMCache":
                row["new_process"] = probe("probe", n=n)
                row["fsync_in_source"] = lmc_source_fsync
            else:
                row["new_process"] = pool.apply(
                    kvc_probe, (str(model_dir), db, store_url, str(tmp / f"kv_{n}.npy"), n)
                )
    probe.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads on both sides (default 1: on a shared machine, OpenMP's "
        "spinning threads made the connector's 2-thread copy of 1k tokens 155 ms instead of 0.6)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--lmcache-python",
        default=os.environ.get("LMCACHE_PYTHON"),
        help="the python of a venv with lmcache==0.5.6 (default: $LMCACHE_PYTHON)",
    )
    args = ap.parse_args()
    if not args.lmcache_python:
        ap.error(
            "name LMCache's python: --lmcache-python PATH or LMCACHE_PYTHON=PATH (see the usage above)"
        )
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    if args.torch_threads < 1:
        ap.error(f"--torch-threads must be at least 1, got {args.torch_threads}")
    torch.set_num_threads(args.torch_threads)
    sizes = [int(x) for x in args.tokens.split(",")]
    bad = [n for n in sizes if n < 2 * CHUNK or n % CHUNK]
    if bad:
        ap.error(
            f"--tokens must be multiples of {CHUNK} of at least {2 * CHUNK} (the damage checks use the second chunk), got {bad}"
        )
    with tempfile.TemporaryDirectory(prefix="kvc-bench-lmcache-") as tmp:
        rows = bench(args.lmcache_python, sizes, args.reps, args.torch_threads, Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"kvc vs LMCache, Qwen2-0.5B KV shape (24 layers, 2 kv heads, head dim 64, bf16), chunk {CHUNK}, "
        f"CPU ({os.cpu_count()} cores, torch threads {args.torch_threads}), medians of {args.reps} "
        "interleaved reps, warm page cache"
    )
    print(
        f"{'tokens':>6}{'KV MB':>7}  {'system':<8}{'disk read ms':>13}{'verified floor ms':>18}{'CPU tier ms':>12}"
        f"{'store returns ms':>17}{'on disk ms':>11}{'fsyncs':>7}  {'flipped byte':<13}{'truncated file':<15}{'new process':<11}"
    )

    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.1f}"

    for r in rows:
        print(
            f"{r['tokens']:>6}{r['kv_mb']:>7.1f}  {r['system']:<8}{ms(r['read_s']):>13}{ms(r['floor_s']):>18}{ms(r['cpu_tier_s']):>12}"
            f"{ms(r['store_returns_s']):>17}{ms(r['on_disk_s']):>11}{r['fsyncs']:>7}  "
            f"{r['flipped']['verdict']:<13}{r['truncated']['verdict']:<15}{r['new_process']['verdict']:<11}"
        )
    for system in ("LMCache", "kvc"):
        r = next(r for r in rows if r["system"] == system)
        print(
            f"{system} at {r['tokens']} tokens: flipped byte: {r['flipped']['detail']}; truncated file: "
            f"{r['truncated']['detail']}; new process: {r['new_process']['detail']}"
        )
    lmc = next(r for r in rows if r["system"] == "LMCache")
    print(
        "kvc's store returns when durable and catalogued (both columns are its checkpoint); "
        f"LMCache's disk backend source mentions fsync: {'yes' if lmc['fsync_in_source'] else 'no'}"
    )


if __name__ == "__main__":
    main()
