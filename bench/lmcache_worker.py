"""The LMCache side of bench_lmcache.py: runs in LMCache's own virtual environment (it pins
numpy <= 2.2.6, kvc needs >= 2.3), driven by the bench over stdin/stdout, one JSON object a line.

Not meant to be run by hand: bench_lmcache.py starts it as

    $LMCACHE_PYTHON bench/lmcache_worker.py --kv-dir DIR --disk DIR [--torch-threads N]

It builds two LMCache 0.5.6 engines over the same KV layout (Qwen2-0.5B's: 24 layers, 2 kv
heads, head dim 64, bf16, chunk 256): one local-disk engine (`local_cpu=False`, so every
retrieve reads its files) and one CPU-tier engine (no disk). The KV comes from the bench's
`kv_{tokens}.npy` files (bf16 bits as int16, laid out [layers, 2, tokens, kv heads, head
dim]), the same bytes kvc stores. Each timing is taken here, around the LMCache call
alone, so the pipe to the bench costs nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Count every fsync/fdatasync made through the os module from here on: installed before
# LMCache is imported, so even a `from os import fsync` in its modules gets the counter.
SYNC_CALLS: Counter[str] = Counter()


def _counting(name: str) -> Any:
    real = getattr(os, name)

    def call(fd: Any) -> None:
        SYNC_CALLS[name] += 1
        real(fd)

    return call


for _name in ("fsync", "fdatasync"):
    setattr(os, _name, _counting(_name))

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from damage import damage_file  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 24, 2, 64, 256
ON_DISK_DEADLINE_S = 120.0


class CPUTensorConnector(GPUConnectorInterface):
    """Copies between a CPU KV tensor [layers, 2, tokens, kv heads, head dim] (passed as
    `kvcaches=`) and LMCache's memory objects ([2, layers, tokens, kv heads * head dim],
    its KV_2LTD format): one strided copy per chunk each way, as its GPU connectors do from
    paged memory. None of LMCache's shipped connectors copies CPU tensors (the mock one
    copies nothing)."""

    @staticmethod
    def _chunk(memory_obj: Any, start: int, end: int) -> torch.Tensor:
        return memory_obj.tensor.view(2, LAYERS, end - start, KV_HEADS, HEAD_DIM).transpose(0, 1)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._chunk(memory_obj, start, end).copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(self._chunk(memory_obj, start, end))

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, KV_HEADS * HEAD_DIM])


def build_engine(name: str, config: LMCacheEngineConfig) -> LMCacheEngine:
    metadata = LMCacheMetadata(
        model_name="kvc-bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, CPUTensorConnector(), None, None
    )
    engine.post_init()
    return engine


def tokens_of(n: int, variant: int) -> torch.Tensor:
    """The bench's token ids (same rule as bench_lmcache.tokens_of)."""
    ids = np.random.default_rng(n).integers(1, 150_000, n)
    ids[0] = 150_000 + variant  # a new first token: every chunk hash changes
    return torch.from_numpy(ids.astype(np.int64))


class Worker:
    def __init__(self, kv_dir: Path, disk: Path) -> None:
        self.kv_dir = kv_dir
        disk_cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,  # no hot copy in memory: every retrieve reads the files
            max_local_cpu_size=2.0,  # staging buffers for the asynchronous writes
            local_disk=f"file://{disk}/",
            max_local_disk_size=40.0,
        )
        cpu_cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=2.0
        )
        self.disk = build_engine("kvc-bench-disk", disk_cfg)
        self.cpu = build_engine("kvc-bench-cpu", cpu_cfg)
        backends = self.disk.storage_manager.storage_backends.values()
        self.disk_backend = next(b for b in backends if isinstance(b, LocalDiskBackend))
        self.kv: dict[int, torch.Tensor] = {}
        self.out: dict[int, torch.Tensor] = {}

    def load(self, n: int) -> dict[str, Any]:
        bits = np.load(self.kv_dir / f"kv_{n}.npy")
        self.kv[n] = torch.from_numpy(bits).view(torch.bfloat16)
        self.out[n] = torch.zeros_like(self.kv[n])  # the destination, allocated once
        stored = self.store(n, 0)
        self.cpu.store(tokens_of(n, 0), kvcaches=self.kv[n])
        return stored

    def store(self, n: int, variant: int, kv: torch.Tensor | None = None) -> dict[str, Any]:
        """Store `kv` (default: the bench's KV) into the disk engine; the time `store` takes
        to return, and until every chunk is on disk (its disk backend's index has it: a
        retrieve before that misses)."""
        tokens = tokens_of(n, variant)
        before = SYNC_CALLS.total()
        t0 = time.perf_counter()
        self.disk.store(tokens, kvcaches=self.kv[n] if kv is None else kv)
        returned = time.perf_counter() - t0
        deadline = t0 + ON_DISK_DEADLINE_S
        while self.disk.lookup(tokens, search_range=["LocalDiskBackend"]) < n:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{n} tokens not on disk after {ON_DISK_DEADLINE_S} s")
            time.sleep(0.0002)
        on_disk = time.perf_counter() - t0
        return {"returned_s": returned, "on_disk_s": on_disk, "fsyncs": SYNC_CALLS.total() - before}

    def retrieve(
        self, n: int, tier: str, variant: int = 0, kv: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Retrieve into the preallocated destination; `equal`: a full hit equal to `kv`
        (default: the bench's KV)."""
        engine = self.disk if tier == "disk" else self.cpu
        out = self.out[n]
        t0 = time.perf_counter()
        mask = engine.retrieve(tokens_of(n, variant), kvcaches=out)
        seconds = time.perf_counter() - t0
        hit = int(mask.sum())
        expected = self.kv[n] if kv is None else kv
        return {"s": seconds, "hit": hit, "equal": hit == n and torch.equal(out, expected)}

    def chunk_path(self, n: int, variant: int, index: int) -> Path:
        keys = [key for _, _, key in self.disk.token_database.process_tokens(tokens_of(n, variant))]
        return Path(self.disk_backend._key_to_path(keys[index]))

    def damaged(self, n: int, variant: int, damage: str) -> dict[str, Any]:
        """Store a new sequence, damage its second chunk's file on disk, retrieve it: did
        LMCache serve the damaged file (a full hit) or detect it (a shorter hit or an error)?
        Another sequence is retrieved in between, as in any cache's life. The sequence's KV is the bench's negated,
        so bytes left over from the bench's own sequences cannot pass for it."""
        kv = -self.kv[n]
        self.store(n, variant, kv)
        path = self.chunk_path(n, variant, 1)
        damage_file(path, damage)
        self.retrieve(n, "disk")  # another request in between, as in any cache's life
        self.out[n].zero_()
        try:
            got = self.retrieve(n, "disk", variant, kv)
        except Exception as e:  # an error is detection too
            return {"verdict": "detected", "detail": f"{type(e).__name__}: {e}"}
        if got["hit"] < n:
            return {"verdict": "detected", "detail": f"hit {got['hit']} of {n} tokens"}
        diff = (self.out[n].view(torch.int16) != kv.view(torch.int16)).sum().item()
        return {"verdict": "served", "detail": f"full hit, {diff} values differ from the KV stored"}

    def probe(self, n: int) -> dict[str, Any]:
        """A process started after the one that stored: does the disk engine find the KV?"""
        bits = np.load(self.kv_dir / f"kv_{n}.npy")
        self.kv[n] = torch.from_numpy(bits).view(torch.bfloat16)
        self.out[n] = torch.zeros_like(self.kv[n])
        got = self.retrieve(n, "disk")
        # Whether its chunk files are there under the names this process computes: a miss
        # with every file present is the index (in memory only), not the hashing.
        chunks = n // CHUNK
        present = sum(self.chunk_path(n, 0, i).exists() for i in range(chunks))
        return {
            "verdict": "hit" if got["hit"] == n else "miss",
            "hit": got["hit"],
            "detail": f"hit {got['hit']} of {n} tokens; {present} of {chunks} chunk files on disk",
        }

    def fsync_in_source(self) -> bool:
        """Does the disk backend's source mention fsync/fdatasync at all (beside the count)?"""
        source = inspect.getsource(sys.modules[LocalDiskBackend.__module__])
        return "fsync" in source or "fdatasync" in source

    def close(self) -> None:
        for name in ("kvc-bench-disk", "kvc-bench-cpu"):
            LMCacheEngineBuilder.destroy(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kv-dir", type=Path, required=True)
    ap.add_argument("--disk", type=Path, required=True)
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    # The protocol owns the real stdout; anything LMCache prints goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    worker = Worker(args.kv_dir, args.disk)
    ops = {
        "load": lambda a: worker.load(a["n"]),
        "store": lambda a: worker.store(a["n"], a["variant"]),
        "retrieve": lambda a: worker.retrieve(a["n"], a["tier"]),
        "damaged": lambda a: worker.damaged(a["n"], a["variant"], a["damage"]),
        "probe": lambda a: worker.probe(a["n"]),
        "fsync_in_source": lambda a: {"found": worker.fsync_in_source()},
    }
    channel.write(json.dumps({"ready": True, "lmcache": _version()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "close":
            break
        channel.write(json.dumps(ops[request["op"]](request)) + "\n")
    worker.close()
    channel.write(json.dumps({"closed": True}) + "\n")


def _version() -> str:
    from importlib.metadata import version

    return version("lmcache")


if __name__ == "__main__":
    main()
