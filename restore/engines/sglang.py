"""The SGLang engine adapter: a HiCache storage backend (L3) that keeps SGLang's KV pages as verified kvc chunks.

SGLang loads it through its dynamic backend factory (docs/engines.md, "SGLang")::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvc", "module_path": "restore.engines.sglang",
      "class_name": "KvcHiCacheStorage", "interface_v1": 1,
      "hicache_storage_pass_prefix_keys": true,
      "catalog": "postgresql://...", "stores": ["file:///...", "s3://..."],
      "namespace": "sglang"}'

Identity. SGLang hands a storage backend page keys, never token ids: a key is
SGLang's sha256 chain hash (hex) over the page's tokens and the previous page's
key, so it already commits to the whole prefix. kvc's chain hash commits to its
parent and to a sequence of 32-bit symbols. A page becomes one kvc chunk
(namespace chunk size = SGLang page size) whose symbols are **the page key
itself**: its 32 bytes as 8 big-endian uint32 words, then zeros up to the page
size (`page_symbols`). These are not token ids and kvc never treats them as
such: nothing looks such a chain up by a prompt, and the catalog's
`prefixes.tokens_be` of an SGLang page starts with the exact 32 bytes of its
SGLang key, so SQL finds a page by its key (docs/engines.md). Distinct keys give
distinct symbols, so kvc's identity is as collision-free as SGLang's; the page
size must be at least 8 to hold the whole key (a smaller one is refused).

Lineage. A page's parent is the previous page of the same sequence, so a page's
kvc prefix hash is the chain over the symbols of every page from the sequence
start. Writes take those preceding keys from `extra_info.prefix_keys`, which
SGLang's backup passes (the node's ancestors, `[]` at the root) when
`hicache_storage_pass_prefix_keys` is true; a write without them cannot be placed
and is refused, never stored at a made-up position. Reads find a page from its
key alone: a key commits to its whole prefix, so the catalog's node whose own
symbols are that key (`prefixes_with_tokens`, one indexed query in the namespace)
and its lineage give the keys before it. `prefix_keys` is only a hint there, as
SGLang 0.5.23 sends it: None for a lookup at the root (every lookup after a
restart), and for a deeper anchor the anchor's ancestors without the anchor's own
pages. The single-key calls (`get`, `set`, `exists`, `batch_get`, `batch_set`)
carry no context: reads find their page the same way, a `set` serves keys whose
place this backend learned from an earlier call (`_places`, bounded).

Everything else is kvc's own pipeline: a write is `Checkpointer.checkpoint_snapshot`
over the host pool's pages (bytes durable, then catalogued; pages already
catalogued are skipped; a page whose parent is not catalogued is refused), a
read is `Restorer.restore_into` into the host pool's pages (every blob verified:
blake3 equals its key, header matches the catalog; a corrupt or missing replica
is marked and the read truncated to the verified pages). GC, fsck, quarantine
and SQL see ordinary chunks.

Supported: MHA host pools (`MHATokenToKVPoolHost`) in the `layer_first` and
`page_first` layouts, float16/bfloat16/float32 KV, tensor parallelism (a rank's
kv heads are its shard). Refused by name (`UnsupportedModelError`): MLA (K-only
latent cache), other layouts, quantized KV, pipeline, context and decode-context
parallelism, heterogeneous-TP head splitting, page sizes below 8, and hybrid
models: any host pool SGLang registers besides the KV pool (Mamba, SWA, indexer,
draft) and the v2 calls that serve them. `get_stats` reports SGLang's storage
metrics (`StorageMetrics`: pages and GB/s per call) when SGLang enables them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np
import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from catalog import AttentionLayout, Fingerprint
from catalog.connect import connect
from catalog.errors import CatalogError, NotFoundError
from catalog.identity import is_hex64
from catalog.lru import LRU
from catalog.models import Match, Shard
from chunkstore import open_store
from restore.checkpoint import Checkpointer
from restore.engines.identity import engine_fingerprint, weights_identity
from restore.engines.sglang_pages import LAYOUTS, HostPages
from restore.engines.torch_kv import DTYPES
from restore.errors import InputError, RestoreError, UnsupportedModelError
from restore.restore import Restorer
from restore.session import Session

__all__ = ["KvcHiCacheStorage", "page_symbols"]

log = logging.getLogger(__name__)

KEY_WORDS = 8  # a 32-byte SGLang page key as uint32 words
# Lineages of one page key tried per call: a key commits to its prefix, so there is one
# unless a writer placed the page with a truncated `prefix_keys`.
MAX_LINEAGES = 4


def _page_key(symbols: tuple[int, ...]) -> str:
    """The SGLang page key a page's chain symbols hold (`page_symbols`' inverse for one page)."""
    return np.asarray(symbols[:KEY_WORDS], dtype=">u4").tobytes().hex()


def page_symbols(keys: list[str], page_size: int) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """The symbols `keys` (one sequence's pages, in order) contribute to kvc's chain.

    Per page: the key's 32 bytes as 8 big-endian uint32 words, then zeros up to
    `page_size`. `InputError` for a key that is not 64 lowercase hex characters.
    """
    out = np.zeros((len(keys), page_size), dtype="<u4")
    for i, key in enumerate(keys):
        if not is_hex64(key):
            raise InputError(f"SGLang page key {key!r:.80} is not 64 lowercase hex characters")
        out[i, :KEY_WORDS] = np.frombuffer(bytes.fromhex(key), dtype=">u4")
    return out.reshape(-1)


class KvcHiCacheStorage(HiCacheStorage):
    """SGLang's L3 KV storage in kvc: pages as chunks with lineage, every read verified.

    Built by SGLang's dynamic backend factory as `KvcHiCacheStorage(storage_config,
    kwargs)`; `storage_config.extra_config` holds `catalog` (a SQLAlchemy URL),
    `stores` (store URLs: the first receives every page, the first object store
    after it a write-behind copy, all are read), and optionally `namespace`
    (default "sglang"; its chunk size is the page size), `weights_id` (an
    immutable revision of the weights; without it the model must be a local
    directory, whose weight files are hashed: a hub name alone is refused, as it
    does not pin the numbers) and `execution_variant` (what else changes the KV numbers: attention
    backend, GPU). The fingerprint is fixed when SGLang registers its host pool.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        cfg = storage_config
        unsupported = {
            "an MLA model (its host pool holds a K-only latent cache)": cfg.is_mla_model,
            f"pipeline parallelism (pp_size={cfg.pp_size})": cfg.pp_size > 1,
            f"attention context parallelism (attn_cp_size={cfg.attn_cp_size})": cfg.attn_cp_size
            > 1,
            f"decode context parallelism (dcp_size={cfg.dcp_size})": cfg.dcp_size > 1,
            "heterogeneous-TP head splitting (tp_lcm_size)": cfg.should_split_heads,
        }
        refused = [what for what, is_set in unsupported.items() if is_set]
        if refused:
            raise UnsupportedModelError(f"kvc's SGLang backend does not support {refused[0]}")
        extra = dict(cfg.extra_config or {})
        catalog_url, store_urls = extra.get("catalog"), extra.get("stores")
        if not isinstance(catalog_url, str) or not catalog_url:
            raise InputError('kvc needs "catalog" (a database URL) in the extra config')
        if not isinstance(store_urls, list) or not store_urls:
            raise InputError('kvc needs "stores" (a list of store URLs) in the extra config')
        self.config = cfg
        self.namespace = str(extra.get("namespace", "sglang"))
        self.weights = weights_identity(cfg.model_name or "", extra.get("weights_id"))
        self.variant = str(extra.get("execution_variant", "default"))
        self.actor = f"sglang:tp{cfg.tp_rank}"
        self.catalog = connect(catalog_url, token=extra.get("token"), namespace=self.namespace)
        self.stores = [open_store(u) for u in store_urls]
        self._places: LRU[str, str] = LRU(1 << 20)  # page key -> previous page key ("" first)
        self.fingerprint: Fingerprint | None = None
        self.session: Session | None = None  # opened when SGLang registers its host pool
        self._checkpointer: Checkpointer | None = None
        self._restorer: Restorer | None = None
        self._metrics_on = bool(cfg.enable_storage_metrics)
        self._metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()

    # -- setup -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: check it, fix the fingerprint and shard, open the pipelines."""
        host_layout = getattr(mem_pool_host, "layout", None)
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if host_layout not in LAYOUTS or not isinstance(buffer, torch.Tensor):
            raise UnsupportedModelError(
                f"host pool {type(mem_pool_host).__name__} with layout {host_layout!r}: "
                f"kvc supports MHA host pools in the {' or '.join(LAYOUTS)} layout"
            )
        if buffer.dtype not in DTYPES:
            raise UnsupportedModelError(
                f"host KV dtype {buffer.dtype}: kvc stores float16, bfloat16 and float32 exactly"
            )
        p = int(mem_pool_host.page_size)
        if p < KEY_WORDS:
            raise UnsupportedModelError(
                f"page size {p}: kvc needs at least {KEY_WORDS} positions per page "
                "to hold the 32-byte page key in the chain (use --page-size 8 or more)"
            )
        layers, heads, dim = mem_pool_host.layer_num, mem_pool_host.head_num, mem_pool_host.head_dim
        if getattr(mem_pool_host, "v_head_dim", dim) != dim:
            raise UnsupportedModelError("K and V of different head dims are not supported")
        want = (2, layers, buffer.shape[2], heads, dim)
        if host_layout == "page_first":
            want = (2, buffer.shape[1], layers, heads, dim)
        if tuple(buffer.shape) != want or buffer.device.type != "cpu":
            raise UnsupportedModelError(
                f"host kv_buffer is {tuple(buffer.shape)} on {buffer.device}, "
                f"expected {want} on cpu for layout {host_layout}"
            )
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.config
        kv_dtype = DTYPES[buffer.dtype]
        full = AttentionLayout(layers, heads * cfg.tp_size, dim, kv_dtype)
        shard = Shard(0, layers, heads * cfg.tp_rank, heads * (cfg.tp_rank + 1))
        self.fingerprint = engine_fingerprint(
            engine="sglang",
            weights=self.weights,
            architecture="sglang",
            config={"model_name": cfg.model_name, "tp_size": cfg.tp_size},
            layout=full,
            execution={
                "sglang": sglang.__version__,
                "torch": torch.__version__,
                "kv": kv_dtype,
                "variant": self.variant,
            },
        )
        self.host_layout: str = host_layout
        self.page_size = p
        self.layout = AttentionLayout(layers, heads, dim, kv_dtype)
        self.shard = shard
        self.session = Session(
            self.catalog, self.stores, self.namespace, p, shard=shard, actor=self.actor
        )
        self._checkpointer = self.session.checkpointer
        self._restorer = self.session.restorer
        log.info(
            "kvc HiCache storage: namespace %s, fingerprint %s, shard %s",
            self.namespace,
            self.fingerprint.hex[:12],
            shard,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool of its group here: the KV pool is the one
        `register_mem_pool_host` took; any other (a hybrid model's Mamba or SWA state,
        an indexer, a draft pool) is refused by name, so such a server does not start
        with kvc instead of storing half of what a request needs."""
        name = str(host_pool_name)
        if name != PoolName.KV.value:
            raise UnsupportedModelError(
                f"SGLang host pool {name!r} ({type(host_pool).__name__}): kvc's SGLang backend "
                "stores the KV pool of full-attention MHA models only, not the extra pools of "
                "hybrid (Mamba, SWA), sparse-indexer or draft models"
            )
        if host_pool is not getattr(self, "mem_pool_host", None):
            raise UnsupportedModelError(
                "SGLang registered a KV host pool other than the one it gave "
                "register_mem_pool_host: kvc stores one KV pool per rank"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _refuse_v2(self, call: str, transfers: list[PoolTransfer] | None) -> UnsupportedModelError:
        pools = sorted({str(t.name) for t in transfers or []}) or ["none"]
        return UnsupportedModelError(
            f"SGLang called {call} (pools: {', '.join(pools)}): kvc's SGLang backend serves "
            "the v1 interface for the KV pool only; hybrid Mamba/SWA and other multi-pool "
            "models are not supported"
        )

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        raise self._refuse_v2("batch_exists_v2", pool_transfers)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        raise self._refuse_v2("batch_get_v2", transfers)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        raise self._refuse_v2("batch_set_v2", transfers)

    def get_stats(self) -> StorageMetrics | None:
        """SGLang's storage metrics hook (asked with `--enable-metrics`): pages
        and GB/s of each prefetch and backup call since the last call, then reset."""
        if not self._metrics_on:
            return None
        with self._metrics_lock:
            out, self._metrics = self._metrics, StorageMetrics()
        return out

    def _observe(self, kind: str, pages: int, seconds: float) -> None:
        if not self._metrics_on or pages == 0:
            return
        gb = pages * self.page_size * self.layout.bytes_per_token / 1e9
        with self._metrics_lock:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(gb / max(seconds, 1e-9))

    # -- the v1 interface SGLang calls (interface_v1, hicache_storage_pass_prefix_keys) ----

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading `keys` are catalogued with a readable replica (not marked corrupt).

        Found from the keys alone (`_resolve`): `prefix_keys` is a hint, and SGLang passes
        None at the root and only the anchor's ancestors below it."""
        return self._resolve(keys, extra_info)[2] if keys else 0

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the leading verified pages of `keys` into the host pool at `host_indices`."""
        started = time.perf_counter()
        loaded = self._load(
            keys, extra_info, self._host_buffer(), self._page_starts(keys, host_indices)
        )
        self._observe("prefetch", sum(loaded), time.perf_counter() - started)
        return loaded

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages of `keys` from the host pool; all of them, or (on any failure) none."""
        started = time.perf_counter()
        starts = self._page_starts(keys, host_indices)
        stored = self._store(keys, extra_info, self._host_buffer(), starts)
        self._observe("backup", len(keys) if stored else 0, time.perf_counter() - started)
        return [stored] * len(keys)

    # -- the single-page interface (keys whose place this backend has learned) --

    def get(
        self,
        key: str,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        """Load one page into `target_location` (a flat page of the host pool); None on a miss."""
        target = self._flat_page(target_location, "target_location")
        prefix = self._learned_prefix(key)
        if prefix is None:
            return None
        info = HiCacheStorageExtraInfo(prefix_keys=prefix)
        loaded = self._load([key], info, self._one_page(target), [0])
        return target_location if loaded[0] else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise InputError("batch_get needs one target location per key")
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat page; False when its place in a sequence is unknown or it fails."""
        page = self._flat_page(value, "value")
        prefix = self._learned_prefix(key)
        if prefix is None:
            log.error("kvc cannot place page %s: no call told its sequence; not stored", key[:16])
            return False
        info = HiCacheStorageExtraInfo(prefix_keys=prefix)
        return self._store([key], info, self._one_page(page), [0])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise InputError("batch_set needs one value per key")
        return all([self.set(k, v) for k, v in zip(keys, values, strict=True)])

    def exists(self, key: str) -> bool:
        prefix = self._learned_prefix(key)
        if prefix is None:
            return False
        return self.batch_exists([key], HiCacheStorageExtraInfo(prefix_keys=prefix)) == 1

    def close(self) -> None:
        """Finish write-behind uploads, stop the workers, release the stores and the catalog."""
        try:
            if self.session is not None:
                self.session.close()
        finally:
            for store in self.stores:
                store.close()
            self.catalog.close()

    # -- internals -----------------------------------------------------------------

    def _ready(self) -> tuple[Restorer, Fingerprint]:
        if self._restorer is None or self.fingerprint is None:
            raise RestoreError("kvc HiCache storage: SGLang has not registered its host pool")
        return self._restorer, self.fingerprint

    def _chain(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None
    ) -> tuple[np.ndarray[Any, np.dtype[np.uint32]], int] | None:
        """For a write: the chain symbols of the call's sequence and how many pages precede
        `keys`, from `prefix_keys`, or None (logged) when SGLang did not pass them."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None:
            log.error(
                "kvc needs the keys of the pages before each write: set "
                '"hicache_storage_pass_prefix_keys": true in the extra config (not stored)'
            )
            return None
        chain = [*prefix, *keys]
        symbols = page_symbols(chain, self.page_size)  # validates every key first
        for i, key in enumerate(chain):
            self._places.put(key, chain[i - 1] if i else "")
        return symbols, len(prefix)

    def _resolve(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None
    ) -> tuple[tuple[np.ndarray[Any, np.dtype[np.uint32]], int] | None, Match | None, int]:
        """Where `keys` are stored: (their sequence's chain symbols and how many pages precede
        `keys`, the catalog's match of it, how many leading `keys` are readable).

        A page key commits to its whole prefix, so the page of `keys[0]` is found from its
        key alone (`prefixes_with_tokens`) and the keys before it are read from its lineage.
        `prefix_keys` is only a hint: SGLang passes None for a lookup at the root, and for
        a deeper anchor the anchor's ancestors without the anchor's own pages. Where a page
        is stored under more than one lineage, one that agrees with the hint is tried first.
        """
        hint = extra_info.prefix_keys if extra_info is not None else None
        p = self.page_size
        page_symbols([*(hint or []), *keys], p)  # validates every key first
        restorer, fp = self._ready()
        best: tuple[Any, Match | None, int] = (None, None, 0)
        for ancestors in self._stored_ancestors(keys[0], hint)[:MAX_LINEAGES]:
            chain = [*ancestors, *keys]
            symbols, base = page_symbols(chain, p), len(ancestors)
            match = self.catalog.lookup(
                self.namespace, fp, np.append(symbols, np.uint32(0)), shard=self.shard
            )
            readable = restorer.readable_prefix(match)[0]
            hits = max(0, min(len(keys), readable // p - base))
            if hits > best[2]:
                best = ((symbols, base), match, hits)
                for i, key in enumerate(chain[: base + hits]):
                    self._places.put(key, chain[i - 1] if i else "")
            if hits == len(keys):
                break
        return best

    def _stored_ancestors(self, key: str, hint: list[str] | None = None) -> list[list[str]]:
        """The keys before `key` in each sequence the catalog holds its page in (usually one),
        those that agree with `hint` (a prefix of them, as SGLang passes) first."""
        found: list[list[str]] = []
        for node in self.catalog.prefixes_with_tokens(
            self.namespace, page_symbols([key], self.page_size), limit=MAX_LINEAGES
        ):
            try:
                line = self.catalog.lineage(self.namespace, node.prefix_hash)
            except NotFoundError:  # removed since (GC, purge): not a place any more
                continue
            found.append([_page_key(n.tokens) for n in line[:-1]])
        if hint:
            found.sort(key=lambda a: a[: len(hint)] != hint)
        return found

    def _learned_prefix(self, key: str) -> list[str] | None:
        """The keys before `key` in its sequence, as learned from earlier calls, or None."""
        if not is_hex64(key):
            raise InputError(f"SGLang page key {key!r:.80} is not 64 lowercase hex characters")
        prefix: list[str] = []
        parent = self._places.get(key)
        while parent:
            prefix.append(parent)
            parent = self._places.get(parent)
        if parent is None:  # never seen, or an ancestor was forgotten: the catalog knows
            stored = self._stored_ancestors(key)
            return stored[0] if stored else None
        return prefix[::-1]

    def _pages(self, buffer: torch.Tensor, base: int, starts: list[int]) -> HostPages:
        return HostPages(buffer, self.host_layout, self.layout, self.page_size, base, starts)

    def _load(
        self,
        keys: list[str],
        extra_info: HiCacheStorageExtraInfo | None,
        buffer: torch.Tensor,
        starts: list[int],
    ) -> list[bool]:
        """Restore the leading verified pages of `keys` into `buffer` at `starts`."""
        if not keys:
            return []
        restorer, fp = self._ready()
        chain, match, hits = self._resolve(keys, extra_info)
        if chain is None or match is None or not hits:
            return [False] * len(keys)
        symbols, base = chain
        pages = self._pages(buffer, base, starts)
        p = self.page_size
        # Only the call's pages are read: the preceding ones are in SGLang's host memory.
        ours = dataclasses.replace(match, chunks=match.chunks[base : base + hits])
        restorer.restore_into(pages, symbols, fp, self.shard, match=ours)
        loaded = max(0, min(len(keys), pages.committed // p - base))
        return [True] * loaded + [False] * (len(keys) - loaded)

    def _store(
        self,
        keys: list[str],
        extra_info: HiCacheStorageExtraInfo | None,
        buffer: torch.Tensor,
        starts: list[int],
    ) -> bool:
        """Publish the pages of `keys` from `buffer` at `starts`: all of them or none."""
        chain = self._chain(keys, extra_info)
        if chain is None:
            return False
        if not keys:
            return True
        symbols, base = chain
        _, fp = self._ready()
        assert self._checkpointer is not None
        try:
            self._checkpointer.checkpoint_snapshot(self._pages(buffer, base, starts), symbols, fp)
        except (RestoreError, CatalogError, ValueError, OSError) as exc:
            log.error("kvc did not store %d pages after %d: %s", len(keys), base, exc)
            return False
        return True

    def _host_buffer(self) -> torch.Tensor:
        self._ready()
        buffer: torch.Tensor = self.mem_pool_host.kv_buffer
        return buffer

    def _page_starts(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        """The first host slot of each page; `InputError` unless each page is P consecutive slots."""
        self._ready()
        p = self.page_size
        idx = torch.as_tensor(host_indices).reshape(-1).to(torch.int64)
        if idx.numel() != len(keys) * p:
            raise InputError(
                f"{len(keys)} pages of {p} positions need {len(keys) * p} host indices, "
                f"got {idx.numel()}"
            )
        if not keys:
            return []
        rows = idx.view(len(keys), p)
        if not torch.equal(rows - rows[:, :1], torch.arange(p).expand(len(keys), p)):
            raise InputError("host indices of a page must be consecutive slots")
        size = self._host_buffer().shape[2 if self.host_layout == "layer_first" else 1]
        if int(idx.min()) < 0 or int(idx.max()) >= size:
            raise InputError(f"host indices must be in [0, {size})")
        return rows[:, 0].tolist()

    def _flat_page(self, page: Any, what: str) -> torch.Tensor:
        """`page` checked to be one flat page of the host pool (its dtype and size, on cpu)."""
        buffer = self._host_buffer()
        numel = self.layout.bytes_per_token * self.page_size // buffer.element_size()
        if (
            not isinstance(page, torch.Tensor)
            or page.dtype != buffer.dtype
            or page.numel() != numel
            or page.device.type != "cpu"
            or not page.is_contiguous()
        ):
            got = (
                f"{page.dtype} x {page.numel()} on {page.device}"
                if isinstance(page, torch.Tensor)
                else type(page).__name__
            )
            raise InputError(
                f"{what} must be a contiguous cpu tensor of {numel} {buffer.dtype} "
                f"(one flat page of the host pool), got {got}"
            )
        return page

    def _one_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page viewed as a one-page buffer in the host pool's layout."""
        lay, p = self.layout, self.page_size
        shape = (2, lay.num_layers, p, lay.num_kv_heads, lay.head_dim)
        if self.host_layout == "page_first":
            shape = (2, p, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        return flat.view(shape)
