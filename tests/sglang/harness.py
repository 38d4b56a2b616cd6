"""SGLang 0.5.23's own HiCache objects on CPU, with kvc as their storage backend.

`SGLangRank` builds what SGLang's scheduler builds for one tensor-parallel rank of
an MHA model with a storage backend (`hybrid_pool_assembler.build_kv_only_stack`):
a device `MHATokenToKVPool`, the real host pool `MHATokenToKVPoolHost` over it
(in the host layout asked for) as the anchor of a `HostPoolGroup`, and the real
`HybridCacheController`, whose storage backend is attached the way
`storage_attachment` does it: the `--hicache-storage-backend-extra-config` string
parsed by SGLang's own `parse_storage_backend_extra_config` (inline JSON or
`@file`), then `attach_storage_backend("dynamic", ...)` with every host pool.

`backup` and `prefetch` then do what `UnifiedRadixCache` does around the
controller's own threads: a write-through backup of a tree node is
`write_storage(host_value, token_ids, hash_value, prefix_keys)` with the node's
page keys (SGLang's `get_storage_hash_str`) and, as `build_storage_backup_spec`
passes them, the keys of the node's ancestors; a prefetch is
`prefetch(handle, key, last_hash, prefix_keys)` with the anchor's last key and,
as the scheduler passes them, `get_prefix_hash_values(anchor)` (the anchor's
ancestors, without the anchor's own pages); the hit the controller's prefetch
thread queries is given host pages (`allocate_storage_hit`) and handed to its IO
thread, whose acknowledgements end the operation. Everything between is SGLang's.
"""

from __future__ import annotations

import itertools
import json
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    _mha_host_inputs,
    build_pool_entry,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from restore.engines.sglang import KvcHiCacheStorage

PAGE = 8
LAYERS, HEADS, DIM = 2, 2, 8
HOST_BUDGET = 1 << 30  # bytes of host memory a test rank may claim
DEADLINE = 60.0  # seconds to wait for a controller thread's answer
_rids = itertools.count()


def single_rank_group(init_file: str) -> Any:
    """The world of one rank SGLang's controller reduces hit counts over (gloo, in-process),
    and the parallel topology SGLang's runtime context reports (one rank; the launcher
    publishes it in a server)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    return dist.group.WORLD


def kvc_extra_config(kvc: dict[str, Any]) -> dict[str, Any]:
    """What an operator passes as `--hicache-storage-backend-extra-config` for kvc (docs/engines.md)."""
    return {
        "backend_name": "kvc",
        "module_path": "restore.engines.sglang",
        "class_name": "KvcHiCacheStorage",
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
        "prefetch_threshold": PAGE,
        **kvc,
    }


def page_keys(tokens: list[int], last_hash: str | None = None) -> list[str]:
    """SGLang's storage keys of `tokens`' pages after a node whose last key is `last_hash`."""
    keys: list[str] = get_storage_hash_str(RadixKey(tokens), last_hash, page_size=PAGE)
    return keys


@dataclass
class Prefetched:
    """What a prefetch from storage brought: the pages the hit query counted, the tokens the
    IO thread loaded, and where (host slots, a page each)."""

    hit_tokens: int
    loaded_tokens: int
    host_indices: torch.Tensor


def host_pool(
    layout: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = PAGE,
    device_tokens: int = 512,
) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    """SGLang's device KV pool on CPU and its real host pool in `layout`, built as
    `build_kv_host_pool` builds them (`hicache_ratio` 2: twice the device tokens)."""
    device_pool = MHATokenToKVPool(
        size=device_tokens,
        page_size=page_size,
        dtype=dtype,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host_cls, info, kwargs = _mha_host_inputs(device_pool)
    # SGLang checks a pool against the machine's free memory less a 10 GiB reserve, which a
    # shared test machine may not have; these pools take kilobytes, booked against a fixed
    # allowance the way SGLang books a rank's pools against one snapshot.
    with host_memory_budget_scope(HOST_BUDGET):
        host = host_cls(info, 2.0, 0, page_size, layout, pin_memory=False, **kwargs)
    return device_pool, host


def fill(host: MHATokenToKVPoolHost, tokens: int, seed: int) -> torch.Tensor:
    """Host slots for `tokens` tokens (SGLang's own allocator), holding random finite KV
    as after a device->host copy."""
    indices = host.alloc(tokens)
    assert indices is not None, "host pool full"
    g = torch.Generator().manual_seed(seed)
    for first in indices[:: host.page_size].tolist():
        page = host.get_data_page(first, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
    return indices


def page_bytes(host: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[bytes]:
    """The KV of each page at `indices` (SGLang's own page accessor), as bytes in one order
    whatever the host layout: [K/V, layer, position, head, dim]."""
    out = []
    for first in indices[:: host.page_size].tolist():
        page = host.get_data_page(first, flat=False)
        if host.layout == "page_first":  # [2, P, L, H, D]
            page = page.permute(0, 2, 1, 3, 4)
        out.append(page.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def open_backend(
    kvc: dict[str, Any], host: MHATokenToKVPoolHost, **config: Any
) -> KvcHiCacheStorage:
    """kvc's backend alone, as SGLang's dynamic factory builds it for `host` from the extra
    config `kvc_extra_config(kvc)` (parsed by SGLang), with the config fields
    `_generate_storage_config` fills (one rank unless `config` says otherwise), and the
    host pool registered."""
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        config_arg(kvc_extra_config(kvc))
    )
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": host.layout == "page_first",
        "model_name": "test/tiny-model",
        "extra_config": extra,
        **config,
    }
    backend = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(**fields), host)
    assert isinstance(backend, KvcHiCacheStorage)
    backend.register_mem_pool_host(host)
    return backend


class SGLangRank:
    """SGLang's pools and cache controller for one rank, with kvc attached as storage."""

    def __init__(
        self,
        extra_config_arg: str,
        *,
        layout: str,
        group: Any,
        dtype: torch.dtype = torch.bfloat16,
        device_tokens: int = 512,
        storage_metrics: bool = False,
    ) -> None:
        self.device_pool, self.host = host_pool(layout, dtype=dtype, device_tokens=device_tokens)
        group_of_pools = HostPoolGroup(
            [
                build_pool_entry(
                    name=PoolName.KV,
                    host_pool=self.host,
                    device_pool=self.device_pool,
                    layer_mapping={i: i for i in range(LAYERS)},
                    transfer_layer_id_max=LAYERS,
                    is_anchor=True,
                )
            ]
        )
        extra, threshold, _base, _per_ki, self.pass_prefix_keys = (
            HybridCacheController.parse_storage_backend_extra_config(extra_config_arg)
        )
        self.controller = HybridCacheController(
            _DeviceAllocator(self.device_pool),
            group_of_pools,
            PAGE,
            group,
            load_cache_event=None,  # type: ignore[arg-type]
            transfer_layer_id_max=LAYERS,
            enable_storage_metrics=storage_metrics,
        )
        self.entries = group_of_pools.entries
        self.controller.attach_storage_backend(
            storage_backend="dynamic",
            prefetch_threshold=threshold,
            model_name="test/tiny-model",
            storage_backend_extra_config=extra,
            host_pools=self.entries,
        )

    @property
    def backend(self) -> KvcHiCacheStorage:
        backend = self.controller.storage_backend
        assert isinstance(backend, KvcHiCacheStorage)
        return backend

    def close(self) -> None:
        self.controller.detach_storage_backend()

    def fill(self, tokens: int, seed: int) -> torch.Tensor:
        return fill(self.host, tokens, seed)

    def page_bytes(self, indices: torch.Tensor) -> list[bytes]:
        return page_bytes(self.host, indices)

    # -- what UnifiedRadixCache does around the controller ----------------------------

    def backup(
        self, host_value: torch.Tensor, token_ids: list[int], ancestor_keys: list[str]
    ) -> int:
        """Write-through backup of a node holding `token_ids` at `host_value`, below a node
        whose pages have `ancestor_keys`; the tokens the backup thread stored."""
        last = ancestor_keys[-1] if ancestor_keys else None
        keys = page_keys(token_ids, last)
        op_id = self.controller.write_storage(
            host_value,
            token_ids,
            keys,
            ancestor_keys if self.pass_prefix_keys else None,
        )
        while True:
            op = _get(self.controller.ack_backup_queue, "backup acknowledgement")
            if op.id == op_id:
                return int(op.completed_tokens)

    def hit_query(self, token_ids: list[int], anchor_path: list[list[str]]) -> int:
        """The tokens storage holds of `token_ids` after the anchor node at the end of
        `anchor_path`, asked as `query_storage_hit_length` asks (`prefetch` says the rest)."""
        last, prefix = self._anchor(anchor_path)
        op = PrefetchOperation(
            CacheRequestHandle("__storage_hit_query__", 0),
            RadixKey(token_ids).page_aligned(PAGE),
            last,
            prefix,
        )
        _, hit = self.controller._storage_hit_query(op)
        return int(hit)

    def prefetch(self, token_ids: list[int], anchor_path: list[list[str]]) -> Prefetched:
        """Prefetch `token_ids` from storage after an anchor node: `anchor_path` holds the page
        keys of each node from the root's child to the anchor (`[]`: the anchor is the root)."""
        cc = self.controller
        last, prefix = self._anchor(anchor_path)
        handle = CacheRequestHandle(f"req-{next(_rids)}", 0)
        op = cc.prefetch(handle, RadixKey(token_ids).page_aligned(PAGE), last, prefix)
        hit_op = _get(cc.prefetch_hit_queue, "storage hit")
        assert hit_op is op
        hit = int(op.storage_hit_count)
        if hit == 0:
            return Prefetched(0, 0, torch.empty(0, dtype=torch.int64))
        indices, alloc_len = cc.allocate_storage_hit(
            op, hit, allow_partial=True, min_tokens=PAGE, evict_host=lambda n: 0
        )
        assert indices is not None and alloc_len == hit
        op.host_indices = indices
        cc.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = _get(cc.ack_prefetch_queue, "prefetch acknowledgement")
            if ack.rid != handle.rid:
                continue
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                return Prefetched(hit, loaded, indices)

    def _anchor(self, anchor_path: list[list[str]]) -> tuple[str | None, list[str] | None]:
        """(the anchor's last page key, the prefix keys the scheduler passes): the latter is
        `get_prefix_hash_values(anchor)`, the keys of the anchor's ancestors without the
        anchor's own pages, and None unless `hicache_storage_pass_prefix_keys` is set."""
        last = anchor_path[-1][-1] if anchor_path else None
        ancestors = [key for node in anchor_path[:-1] for key in node]
        return last, ancestors if self.pass_prefix_keys else None


class _DeviceAllocator:
    """The one thing the controller asks of the scheduler's token allocator: its device pool."""

    def __init__(self, pool: MHATokenToKVPool) -> None:
        self._pool = pool

    def get_kvcache(self) -> MHATokenToKVPool:
        return self._pool


def _get(q: queue.Queue[Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            return q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"SGLang's controller sent no {what} in {DEADLINE:.0f} s"
            ) from None


def config_arg(extra: dict[str, Any]) -> str:
    """`extra` as the inline JSON of `--hicache-storage-backend-extra-config`."""
    return json.dumps(extra)
