"""kvc as a vLLM v1 KV connector: prefixes restored, verified, from kvc's stores into vLLM's blocks, and saved when a request finishes.

Loaded out of tree::

    KVTransferConfig(
        kv_connector="KvcConnector",
        kv_connector_module_path="restore.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",  # vLLM's default fails a request whose load failed
        kv_connector_extra_config={"catalog": "sqlite:///kvc/catalog.db",
                                   "stores": ["file:///kvc/blobs"], "namespace": "default"},
    )

Scheduler side: `get_num_new_matched_tokens` looks the prompt up in the catalog
and offers vLLM the longest stored prefix beyond what it has computed, in whole
vLLM blocks and never the last prompt token. The loads and the saves of a step
travel to the workers in `KvcConnectorMetadata`.

Worker side: a load is a kvc restore into the request's blocks (every chunk
verified; positions vLLM already holds are not written); the blocks of
positions that could not be restored are reported by
`get_block_ids_with_load_errors`, and vLLM recomputes them. A save is a
background checkpoint of the finished request's computed positions read
straight from its blocks; vLLM frees the blocks once `get_finished` reports
the read done. Prefix identity is kvc's chain hash over token ids, the same in
every process: vLLM's block boundaries are mapped onto kvc chunks here.

Tensor parallelism: each rank loads and saves its own kv heads as a kvc shard; the
scheduler offers a prefix only when every rank's shard holds it, and saves a finished
request unless every rank's shard does. Metrics go through vLLM's connector stats hooks
(restore/engines/vllm_metrics.py).

The per-layer KV tensors are read as vLLM lays them out, checked against the
model's block size, kv heads and head size: `[blocks, kv heads, block size,
2 * head size]` with K and V packed in the last dimension (vLLM >= 0.33's
standard view); any other shape is refused with an error naming it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from catalog import AttentionLayout, Fingerprint
from catalog.base import CatalogAPI
from catalog.models import Shard
from chunkstore.record import check_finite
from restore.checkpoint import Checkpointer
from restore.engines.identity import engine_fingerprint, numeric_config, weights_identity
from restore.engines.torch_kv import DTYPES, numpy_view, torch_dtype
from restore.engines.vllm_metrics import KvcConnectorStats, KvcPromMetrics
from restore.errors import InputError, UnsupportedModelError
from restore.pages import check_payload, check_range, check_span, payload_shape
from restore.restore import Restorer
from restore.session import Session

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from restore.checkpoint import CheckpointResult

__all__ = ["KvcConnector", "KvcConnectorMetadata", "vllm_fingerprint"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class LoadSpec:
    """Restore positions `[start, end)` into `block_ids` (the request's table); `token_ids` are the
    prompt's first `end + 1` (a kvc lookup restores at most all but the last token it is given)."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SaveSpec:
    """Checkpoint positions `[0, len(token_ids))`, held in `block_ids`, of a finished request."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class KvcConnectorMetadata(KVConnectorMetadata):
    """What the workers do this step: restores before the forward, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def skip_reason(request: Request) -> str | None:
    """Why kvc must not share this request's KV, or None when token ids are all that identify it.

    vLLM's own block hashes (`generate_block_hash_extra_keys` in vllm/v1/core/kv_cache_utils.py)
    also cover the LoRA adapter, the multimodal inputs at their placeholders, the cache salt and
    the prompt embeddings; kvc keys token ids only, so such a request neither loads nor saves."""
    if request.lora_request is not None:
        return "lora"
    if request.mm_features:
        return "multimodal"
    if request.cache_salt:
        return "cache_salt"
    if request.prompt_embeds is not None:
        return "prompt_embeds"
    return None


def written_tokens(request: Request) -> int:
    """The positions whose KV a finished step has written: under async scheduling vLLM counts
    the tokens of steps still in flight in `num_computed_tokens` (`num_in_flight_tokens`; the
    same frontier vLLM itself caches and frees blocks on)."""
    in_flight: int = getattr(request, "num_in_flight_tokens", request.num_output_placeholders)
    return max(0, min(request.num_computed_tokens - in_flight, request.num_tokens))


def _config_get(extra: dict[str, Any], key: str, default: Any = None) -> Any:
    value = extra.get(key, default)
    if value is None:
        raise InputError(f"kv_connector_extra_config needs {key!r}")
    return value


def vllm_layout(vllm_config: VllmConfig) -> AttentionLayout:
    """The K/V one token occupies in the whole model (all ranks), or `UnsupportedModelError`."""
    model = vllm_config.model_config
    name = model.model
    if getattr(model, "use_mla", False):
        raise UnsupportedModelError(f"{name} uses MLA (a latent KV): kvc stores K and V per head")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise UnsupportedModelError("pipeline parallelism is not supported by the kvc connector")
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model.dtype if cache_dtype in (None, "auto") else getattr(torch, cache_dtype, cache_dtype)
    if dtype not in DTYPES:
        raise UnsupportedModelError(
            f"KV cache dtype {dtype}: kvc stores float32, float16 and bfloat16 KV exactly "
            "(quantized KV caches are refused)"
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    heads = model.get_total_num_kv_heads()
    if heads % tp:
        raise UnsupportedModelError(
            f"{heads} kv heads do not split evenly over {tp} tensor-parallel ranks "
            "(replicated kv heads are not supported)"
        )
    layers = model.get_num_layers(vllm_config.parallel_config)
    return AttentionLayout(layers, heads, model.get_head_size(), DTYPES[dtype])


def check_full_attention(kv_cache_config: KVCacheConfig) -> None:
    """Refuse, by name, every KV cache but one group of full attention: kvc restores and saves
    every position of every layer (a sliding window's dropped blocks are vLLM's null block)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModelError(
            f"the model has {len(groups)} KV cache groups "
            "(sliding-window, hybrid or linear-attention layers): the kvc connector supports "
            "models whose layers are all full attention"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise UnsupportedModelError(
            f"the model's KV cache is {type(spec).__name__}: the kvc connector supports models "
            "whose layers are all full attention (FullAttentionSpec)"
        )


def rank_shard(layout: AttentionLayout, rank: int, world: int) -> Shard:
    """The kv heads tensor-parallel rank `rank` of `world` holds, as a kvc shard."""
    per = layout.num_kv_heads // world
    return Shard(0, layout.num_layers, rank * per, (rank + 1) * per)


def vllm_fingerprint(vllm_config: VllmConfig, weights_id: str | None = None) -> Fingerprint:
    """The fingerprint of the model vLLM serves: weights, architecture, the numeric config, the
    layout, and how vLLM runs it (vLLM and torch versions, dtypes, attention backend, device)."""
    model = vllm_config.model_config
    layout = vllm_layout(vllm_config)
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    return engine_fingerprint(
        engine="vllm",
        weights=weights_identity(model.model, weights_id),
        architecture=",".join(model.architectures or []) or type(model.hf_config).__name__,
        config=numeric_config(model.hf_text_config.to_dict()),
        layout=layout,
        execution={
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "kv": layout.dtype,
            "attn": str(backend) if backend is not None else "auto",
            "device": vllm_config.device_config.device_type,
            "tp": vllm_config.parallel_config.tensor_parallel_size,
        },
    )


class BlockTable:
    """One request's blocks of vLLM's per-layer KV tensors as kvc's two seams: the `Destination`
    a restore writes (positions before `start` left alone) and the `KVSnapshot` a save reads
    (an `InPlaceSnapshot`: CPU blocks are scanned and copied out in place).

    `abort` and a `commit` of fewer positions leave what was written in the request's blocks:
    vLLM allocated them for this load, reads only the positions `restored` reports, and
    recomputes the rest (`get_block_ids_with_load_errors`)."""

    def __init__(
        self,
        layers: list[torch.Tensor],
        layout: AttentionLayout,
        block_size: int,
        block_ids: Iterable[int],
        *,
        start: int = 0,
        length: int = 0,
    ) -> None:
        self._layers = layers  # each [blocks, 2, block size, heads, head size] (a view)
        self._layout = layout
        self._block_size = block_size
        self._blocks = list(block_ids)
        self._start = start
        self._length = length
        self._reserved = 0
        self.restored = 0

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return self._length

    def _spans(self, start: int, end: int) -> Iterable[tuple[int, int, int, int]]:
        """(block id, offset in the block, count, offset from `start`) covering `[start, end)`."""
        p = start
        while p < end:
            idx, off = divmod(p, self._block_size)
            take = min(self._block_size - off, end - p)
            yield self._blocks[idx], off, take, p - start
            p += take

    # Destination
    def reserve(self, tokens: int) -> None:
        if math.ceil(tokens / self._block_size) > len(self._blocks):
            raise InputError(
                f"{tokens} positions need {math.ceil(tokens / self._block_size)} blocks of "
                f"{self._block_size}; the request holds {len(self._blocks)}"
            )
        self._reserved = tokens

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self._layout, kv, count)
        check_span(start, count, self._reserved)
        lo = max(start, self._start)
        if lo >= start + count:
            return  # vLLM computed these positions itself
        part: np.ndarray[Any, Any] | torch.Tensor = kv[:, :, lo - start : count]
        layers: list[Any]  # numpy views of CPU tensors, or the device tensors
        if self._layers[0].device.type == "cpu":
            layers = [numpy_view(t) for t in self._layers]  # the one copy, from the blob
        else:  # staged once in pinned memory, then block by block on the device
            staged = torch.empty(part.shape, dtype=torch_dtype(self._layout.dtype), pin_memory=True)
            numpy_view(staged)[...] = part
            part = staged.to(self._layers[0].device, non_blocking=True)
            layers = self._layers
        for block, off, take, s in self._spans(lo, start + count):
            for layer, dst in enumerate(layers):
                dst[block, :, off : off + take] = part[layer, :, s : s + take]

    def commit(self, tokens: int) -> None:
        self.restored = tokens
        self._reserved = 0

    def abort(self) -> None:
        self.restored = 0
        self._reserved = 0

    # KVSnapshot
    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        start, end = check_range(start, end, self._length)
        if self._layers[0].device.type == "cpu":
            out = np.empty(payload_shape(self._layout, end - start), dtype=self._layout.numpy_dtype)
            self.read_kv_into(out, start, end)
            return out
        staged = torch.empty(
            payload_shape(self._layout, end - start), dtype=torch_dtype(self._layout.dtype)
        )
        for block, off, take, s in self._spans(start, end):
            for layer, src in enumerate(self._layers):
                staged[layer, :, s : s + take].copy_(src[block, :, off : off + take])
        return numpy_view(staged)

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        """Copy positions `[start, end)` into `out` (`[L, 2, end - start, H, D]`, a record's
        payload): from CPU blocks the one copy a save makes; device blocks come through host."""
        start, end = check_range(start, end, self._length)
        check_payload(self._layout, out, end - start, what="out", exact=True)
        if self._layers[0].device.type != "cpu":
            out[...] = self.read_kv(start, end)
            return
        layers = [numpy_view(t) for t in self._layers]
        for block, off, take, s in self._spans(start, end):
            for layer, src in enumerate(layers):
                out[layer, :, s : s + take] = src[block, :, off : off + take]

    def check_finite(self, start: int, end: int) -> None:
        """Raise ValueError if positions `[start, end)` hold a NaN or an Inf (CPU blocks read in place)."""
        start, end = check_range(start, end, self._length)
        if self._layers[0].device.type != "cpu":
            check_finite(self.read_kv(start, end), self._layout.dtype)
            return
        layers = [numpy_view(t) for t in self._layers]
        for block, off, take, _s in self._spans(start, end):
            for src in layers:
                check_finite(src[block, :, off : off + take], self._layout.dtype)

    def blocks_from(self, position: int, end: int) -> set[int]:
        """The blocks holding positions `[position, end)`."""
        return {block for block, _off, _take, _s in self._spans(position, end)}


def layer_views(
    kv_caches: dict[str, torch.Tensor], layer_names: list[str], shard_layout: AttentionLayout, block_size: int
) -> list[torch.Tensor]:
    """vLLM's per-layer tensors, in layer order, as `[blocks, 2, block size, heads, head size]` views.

    vLLM's standard view is `[blocks, kv heads, block size, 2 * head size]`, K then V in the
    last dimension (vllm/v1/worker/utils.py); any other shape is refused.
    """
    heads, dim = shard_layout.num_kv_heads, shard_layout.head_dim
    views = []
    for name in layer_names:
        t = kv_caches[name]
        shape = tuple(t.shape)
        if len(shape) != 4 or shape[1:] != (heads, block_size, 2 * dim):
            raise UnsupportedModelError(
                f"vLLM's KV cache for layer {name} is shaped {shape}; the kvc connector reads "
                f"[blocks, {heads} kv heads, {block_size} block size, {2 * dim} (K and V packed)]"
            )
        if t.dtype != torch_dtype(shard_layout.dtype):
            raise UnsupportedModelError(
                f"vLLM's KV cache for layer {name} is {t.dtype}; the model's KV is {shard_layout.dtype}"
            )
        views.append(t.view(shape[0], heads, block_size, 2, dim).permute(0, 3, 2, 1, 4))
    return views


class KvcConnector(KVConnectorBase_V1):
    """kvc's vLLM v1 KV connector (see the module docstring)."""

    # vLLM's hit metrics by source: kvc's chunks come from a local directory or an object store.
    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size: int = vllm_config.cache_config.block_size
        self._namespace: str = extra.get("namespace", "default")
        chunk_size = int(extra.get("chunk_size", 256))
        stores = _config_get(extra, "stores")
        if isinstance(stores, str) or not stores:
            raise InputError("kv_connector_extra_config 'stores' must be a non-empty list of store URLs")
        check_full_attention(kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: vLLM fails a request whose kvc load fails (a "
                "corrupt or missing chunk, a store that is down); set "
                "kv_load_failure_policy='recompute' so vLLM recomputes those blocks instead",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self.layout = vllm_layout(vllm_config)
        self.fingerprint = vllm_fingerprint(vllm_config, extra.get("weights_id"))
        world = vllm_config.parallel_config.tensor_parallel_size
        rank = vllm_config.parallel_config.rank if role == KVConnectorRole.WORKER else 0
        self.shard = rank_shard(self.layout, rank % world, world)
        # The scheduler offers and skips saves by what every rank has stored.
        self._shards = tuple(rank_shard(self.layout, r, world) for r in range(world))
        catalog_url = str(_config_get(extra, "catalog"))
        # Scheduler state.
        self._offered: dict[str, tuple[int, int]] = {}  # req id -> (computed, end) offered
        # req id -> (start, end, the prompt's first end + 1 token ids) after alloc
        self._loads: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._saves: list[SaveSpec] = []
        # Requests kvc does not share (see `skip_reason`), counted once each by reason.
        self.skipped: Counter[str] = Counter()
        self._skipping: set[str] = set()
        # Worker state.
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._saved: set[str] = set()
        self._lock = threading.Lock()
        # What this process counted since vLLM last collected it (get_kv_connector_stats).
        self._stats = KvcConnectorStats()
        # One session per process: the scheduler uses its catalog, a worker its pipelines
        # (the first store receives every save, the first object store after it a
        # write-behind copy, every store is read; names are journaled to the stores).
        self.session = Session(
            catalog_url,
            [str(url) for url in stores],
            self._namespace,
            chunk_size,
            shard=self.shard,
            token=extra.get("token"),
            actor=f"vllm:rank{rank}",
        )
        self.catalog: CatalogAPI = self.session.catalog
        self.restorer: Restorer | None = None
        self.checkpointer: Checkpointer | None = None
        if role == KVConnectorRole.WORKER:
            self.restorer = self.session.restorer
            self.checkpointer = self.session.checkpointer

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a future miss, so vLLM need
        not recompute a preempted request to deliver it."""
        return False

    # ---- scheduler side ------------------------------------------------

    def _skip(self, request: Request) -> bool:
        reason = skip_reason(request)
        if reason is None:
            return False
        if request.request_id not in self._skipping:
            self._skipping.add(request.request_id)
            self.skipped[reason] += 1
            with self._lock:
                self._stats.record_skip(reason)
            log.debug("kvc skips request %s (%s): vLLM keys its KV on more than token ids",
                      request.request_id, reason)
        return True

    def _stored_by_every_rank(self, tokens: list[int], limit: int, need: int) -> int:
        """The longest prefix of `tokens` (at most `limit`) that every tensor-parallel rank's
        shard has stored: a hit is a hit only when each rank can load its kv heads. One lookup
        per rank, each bounded by the shortest so far, stopping at the first rank that holds
        fewer than `need` positions (the answer is then of no use to the caller)."""
        stored = limit
        for shard in self._shards:
            stored = self.catalog.lookup(
                self._namespace, self.fingerprint.hex, tokens, shard=shard, max_tokens=stored
            ).matched_tokens
            if stored < need:
                break
        return stored

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._skip(request):
            return 0, False
        tokens = request.prompt_token_ids or []
        limit = len(tokens) - 1  # vLLM computes at least the last prompt token
        if limit < self._block_size:
            return 0, False
        # An offer needs at least one whole block beyond what vLLM has computed.
        need = (num_computed_tokens // self._block_size + 1) * self._block_size
        try:
            stored = self._stored_by_every_rank(tokens, limit, need)
        except Exception as exc:  # the catalog unreachable is a miss, never a failed request
            log.warning("kvc lookup for request %s failed: %s", request.request_id, exc)
            return 0, False
        end = stored // self._block_size * self._block_size
        if end <= num_computed_tokens:
            return 0, False
        self._offered[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        offered = self._offered.pop(request.request_id, None)
        if num_external_tokens > 0 and offered is not None:
            computed, _end = offered
            end = computed + num_external_tokens
            tokens = tuple((request.prompt_token_ids or [])[: end + 1])
            self._loads[request.request_id] = (computed, end, tokens)
            with self._lock:
                self._stats.record_hit(num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvcConnectorMetadata:
        """The step's saves, and a load for every request `update_state_after_alloc` gave one:
        new requests, and preempted requests vLLM resumes (`scheduled_cached_reqs`, in
        `resumed_req_ids`, whose `new_block_ids` are the whole block table)."""
        meta = KvcConnectorMetadata(saves=self._saves)
        self._saves = []
        tables: dict[str, list[int]] = {
            new.req_id: list(new.block_ids[0]) for new in scheduler_output.scheduled_new_reqs
        }
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if req_id in cached.resumed_req_ids and block_ids is not None:
                    tables[req_id] = list(block_ids[0])
        for req_id, table in tables.items():
            span = self._loads.pop(req_id, None)
            if span is None:
                continue
            start, end, tokens = span
            meta.loads.append(LoadSpec(req_id, tokens, tuple(table), start, end))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Save the request's computed positions (whole vLLM blocks) unless the catalog has them
        for every tensor-parallel rank (every rank gets the save: one whose shard is missing
        stores it, the others' checkpointers skip what is catalogued); the blocks stay
        allocated until the workers report the save has read them. Only positions
        a finished step wrote count (`written_tokens`), in whole blocks: a block still being
        written is never saved."""
        self._offered.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        skip = self._skip(request)
        self._skipping.discard(request.request_id)
        if skip:
            return False, None
        tokens = list(request.all_token_ids)
        n = written_tokens(request) // self._block_size * self._block_size
        if n == 0:
            return False, None
        try:
            stored = self._stored_by_every_rank(tokens[: n + 1], n, n)
        except Exception as exc:
            log.warning("kvc lookup for request %s failed: %s", request.request_id, exc)
            return False, None
        if stored >= n:
            return False, None
        self._saves.append(
            SaveSpec(request.request_id, tuple(tokens[:n]), tuple(block_ids[: n // self._block_size]))
        )
        return True, None

    # ---- worker side ---------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != self.layout.num_layers:
            raise UnsupportedModelError(
                f"vLLM registered {len(names)} KV cache layers for a model of "
                f"{self.layout.num_layers} layers"
            )
        shard_layout = AttentionLayout(
            self.layout.num_layers,
            self.shard.head_hi - self.shard.head_lo,
            self.layout.head_dim,
            self.layout.dtype,
        )
        self._shard_layout = shard_layout
        self._layers = layer_views(kv_caches, names, shard_layout, self._block_size)

    def _table(self, block_ids: Iterable[int], *, start: int = 0, length: int = 0) -> BlockTable:
        if not self._layers:
            raise InputError("register_kv_caches must run before loads and saves")
        return BlockTable(
            self._layers, self._shard_layout, self._block_size, block_ids, start=start, length=length
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcConnectorMetadata)
        assert self.restorer is not None
        for load in meta.loads:
            table = self._table(load.block_ids, start=load.start)
            t0 = time.perf_counter()
            nbytes = 0
            try:
                result = self.restorer.restore_into(
                    table, list(load.token_ids), self.fingerprint, self.shard, max_tokens=load.end
                )
                nbytes = result.report.bytes
            except Exception as exc:  # any failure: vLLM recomputes, never reads unverified KV
                log.warning("kvc restore for request %s failed: %s", load.req_id, exc)
                table.restored = 0
            with self._lock:
                self._stats.record_load(
                    tokens=max(0, table.restored - load.start),
                    nbytes=nbytes,
                    seconds=time.perf_counter() - t0,
                    complete=table.restored >= load.end,
                )
                if table.restored < load.end:
                    self._load_errors |= table.blocks_from(max(table.restored, load.start), load.end)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv finishes every load before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves read the finished request's blocks (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcConnectorMetadata)
        assert self.checkpointer is not None
        for save in meta.saves:
            table = self._table(save.block_ids, length=len(save.token_ids))
            try:
                published = self.checkpointer.submit_snapshot(
                    table,
                    list(save.token_ids),
                    self.fingerprint,
                    release=functools.partial(self._mark_saved, save.req_id),
                )
            except Exception as exc:  # a refused save is a future miss
                log.warning("kvc save of request %s refused: %s", save.req_id, exc)
                published = None
            if published is None:  # refused, or dropped by a full checkpoint queue
                with self._lock:
                    self._stats.record_save(None)
            else:
                published.add_done_callback(functools.partial(self._count_save, save.req_id))

    def _count_save(self, req_id: str, published: Future[CheckpointResult]) -> None:
        """Count a background save once it is published, or failed (on the checkpointer's thread)."""
        exc = published.exception()
        if exc is not None:
            log.warning("kvc save of request %s failed: %s", req_id, exc)
        with self._lock:
            self._stats.record_save(None if exc is not None else published.result().stored_bytes)

    def _mark_saved(self, req_id: str) -> None:
        with self._lock:
            self._saved.add(req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._saved = self._saved, set()
        return (done or None), None

    def get_kv_connector_stats(self) -> KvcConnectorStats | None:
        """What this process counted since the last call (vLLM calls it every step, on the
        scheduler and on each worker, and aggregates the payloads), or None when nothing."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvcConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvcConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.session.close()


def _layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (`model.layers.12.self_attn.attn` -> 12)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise UnsupportedModelError(f"cannot tell the layer index of vLLM layer {name!r}")
    return numbers[0]

