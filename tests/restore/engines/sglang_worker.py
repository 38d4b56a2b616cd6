"""SGLang's side of the kvc HiCache backend in tests: a host pool like SGLang's, and a process that reads pages back.

`HostPool` is a faithful minimal `MHATokenToKVPoolHost`: the attributes and
kv_buffer shapes of sglang 0.5.23's `pool_host/mha.py` for the `layer_first`
and `page_first` layouts. The real class cannot be built here: importing
`sglang.srt.mem_cache.pool_host` pulls in `sglang.srt.configs`, which imports
torchvision (a CUDA-matched build pinned to SGLang's torch).

`hit_query` and `page_transfer` call the backend with the arguments sglang
0.5.23's cache controllers send when a request prefetches from storage
(SGLang's own controllers cannot be imported here: `sglang.srt.managers.cache_controller`
pulls in its quantization layers, which import gguf and more of its pinned set).
The anchor is the deepest node of SGLang's radix tree already on the host; the
scheduler passes `get_prefix_hash_values(anchor)`: the keys of the anchor's
ancestors, *without* the anchor's own pages, `[]` when the anchor is the root or
a child of it.

Run as a script (a new process): open the backend from a JSON config through
SGLang's own factory, ask for the pages as SGLang does after a restart, load
them, print their bytes as hex.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory

from restore.engines.sglang import KvcHiCacheStorage


class HostPool:
    """The parts of SGLang's MHA host pool a storage backend reads (kv_buffer and its geometry)."""

    def __init__(
        self,
        layout: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        layers: int = 2,
        heads: int = 2,
        head_dim: int = 8,
        page_size: int = 8,
        pages: int = 16,
    ) -> None:
        self.layout, self.dtype, self.page_size = layout, dtype, page_size
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            layers,
            heads,
            head_dim,
            head_dim,
        )
        self.size = pages * page_size
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
        }.get(layout, (2, pages, heads, page_size, layers, head_dim))
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()


def storage_config(
    extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, **kw: Any
) -> HiCacheStorageConfig:
    fields: dict[str, Any] = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "test/tiny-model",
        "extra_config": dict(extra),
    }
    fields.update(kw)
    return HiCacheStorageConfig(**fields)


def open_backend(extra: dict[str, Any], pool: HostPool, **kw: Any) -> KvcHiCacheStorage:
    """The backend as SGLang builds it: the dynamic factory, then the host pool registered."""
    config = storage_config(
        {
            "backend_name": "kvc",
            "module_path": "restore.engines.sglang",
            "class_name": "KvcHiCacheStorage",
            **extra,
        },
        **kw,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, KvcHiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def hit_query(backend: KvcHiCacheStorage, prefix_keys: list[str], keys: list[str]) -> int:
    """How many pages of `keys` storage holds, asked as `HybridCacheController._storage_hit_query`
    asks (mem_cache/hybrid_cache/hybrid_cache_controller.py): one `batch_exists` over every
    key, `prefix_keys` copied when non-empty and None otherwise, so None at the root."""
    info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys.copy() if prefix_keys else None)
    return backend.batch_exists(keys, info)


def page_transfer(
    backend: KvcHiCacheStorage, prefix_keys: list[str], keys: list[str], host_indices: torch.Tensor
) -> list[bool]:
    """Load `keys` as `CacheController._page_transfer` does (managers/cache_controller.py):
    `batch_get_v1` per STORAGE_BATCH_SIZE keys with the operation's `prefix_keys` (the same
    list the hit query had, `[]` at the root), extended by each batch; a short batch ends it."""
    page = len(host_indices) // max(1, len(keys))
    out: list[bool] = []
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        idx = host_indices[i * page : (i + len(batch)) * page]
        got = backend.batch_get_v1(batch, idx, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
        out.extend(got)
        if not all(got):
            break
        prefix_keys = prefix_keys + batch
    return out + [False] * (len(keys) - len(out))


def main() -> None:
    args = json.loads(sys.argv[1])
    pool = HostPool(args["layout"])
    backend = open_backend(args["extra"], pool)
    keys, prefix = args["keys"], args.get("prefix", [])
    hits = hit_query(backend, prefix, keys)
    loaded = page_transfer(backend, prefix, keys[:hits], torch.arange(hits * pool.page_size))
    pages = [
        pool.get_data_page(i * pool.page_size).view(torch.uint8).numpy().tobytes().hex()
        for i in range(hits)
    ]
    backend.close()
    print(json.dumps({"hits": hits, "loaded": loaded, "pages": pages}))


if __name__ == "__main__":
    main()
