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
vLLM blocks and never the last prompt token, as an asynchronous load
(`load_async`, the default): vLLM allocates the blocks, parks the request in
WAITING_FOR_REMOTE_KVS and keeps stepping the other requests. The loads (with the
block ids `update_state_after_alloc` gave), the saves and the cancelled loads of a
step travel to the workers in `KvcConnectorMetadata`.

Worker side: a load is a kvc restore into the request's blocks (every chunk
verified; positions vLLM already holds are not written) run on the connector's
load threads beside the forward passes; `get_finished` reports it done (finished
receiving) and `get_block_ids_with_load_errors`, no later than that, the blocks
of positions that could not be restored: vLLM recomputes them
(`kv_load_failure_policy='recompute'`), and the scheduler never offers that
request a load again. A save copies the finished request's written positions to
host memory once (`restore/staging.py`), reports the blocks released (finished
sending), and only then publishes the copy (encode, fsync, S3, catalog) on the
checkpointer's thread. On a GPU every copy to or from vLLM's blocks runs on the
connector's own CUDA stream, ordered after vLLM's forward stream by an event
recorded when the step hands the work over. Prefix identity is kvc's chain hash
over token ids, the same in every process: vLLM's block boundaries are mapped
onto kvc chunks here.

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

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from catalog import AttentionLayout
from catalog.base import CatalogAPI
from restore.checkpoint import Checkpointer
from restore.engines.vllm_blocks import BlockTable, layer_views
from restore.engines.vllm_identity import (
    check_full_attention,
    rank_shard,
    vllm_fingerprint,
    vllm_layout,
)
from restore.engines.vllm_metrics import KvcConnectorStats, KvcPromMetrics
from restore.errors import InputError, UnsupportedModelError
from restore.restore import Restorer
from restore.session import Session
from restore.staging import StagedKV

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
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from restore.checkpoint import CheckpointResult

__all__ = ["KvcConnector", "KvcConnectorMetadata", "vllm_fingerprint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """Restore positions `[start, end)` into `block_ids` (the request's table); `token_ids` are the
    prompt's first `end + 1` (a kvc lookup restores at most all but the last token it is given).
    `load_async`: run beside the forward passes and report completion through `get_finished`;
    otherwise finish before this step's forward."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    load_async: bool = True


@dataclass(frozen=True)
class SaveSpec:
    """Checkpoint positions `[0, len(token_ids))`, held in `block_ids`, of a finished request."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class KvcConnectorMetadata(KVConnectorMetadata):
    """What the workers do this step: loads to start, saves to stage after the forward, and the
    requests whose asynchronous load to stop (aborted while loading)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


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
            raise InputError(
                "kv_connector_extra_config 'stores' must be a non-empty list of store URLs"
            )
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
        # Loads run beside the forward passes (vLLM's asynchronous loads) unless told not to.
        self._load_async = extra.get("load_async", True)
        if not isinstance(self._load_async, bool):
            raise InputError(
                f"kv_connector_extra_config 'load_async' must be true or false, got {self._load_async!r}"
            )
        load_threads = extra.get("load_threads", 2)
        if isinstance(load_threads, bool) or not isinstance(load_threads, int) or load_threads < 1:
            raise InputError(
                f"kv_connector_extra_config 'load_threads' must be an integer >= 1, got {load_threads!r}"
            )
        # Scheduler state.
        self._offered: dict[str, tuple[int, int]] = {}  # req id -> (computed, end) offered
        self._loads: dict[str, LoadSpec] = {}  # allocated, for the next metadata
        self._loading: dict[str, frozenset[int]] = {}  # async loads sent, not yet received: blocks
        self._load_failed: set[str] = set()  # requests whose async load lost blocks: never again
        self._cancels: list[str] = []  # async loads of requests that finished (aborted) meanwhile
        self._saves: list[SaveSpec] = []
        # Requests kvc does not share (see `skip_reason`), counted once each by reason.
        self.skipped: Counter[str] = Counter()
        self._skipping: set[str] = set()
        # Worker state.
        self._layers: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None  # copies to and from device blocks
        self._load_errors: set[int] = set()
        self._cancel: dict[str, threading.Event] = {}  # async loads queued or running
        self._received: set[str] = set()  # async loads done (or stopped), to report
        self._staging: list[tuple[SaveSpec, StagedKV, torch.cuda.Event | None]] = []
        self._saved: set[str] = set()  # saves whose blocks may be freed, to report
        self._loader: ThreadPoolExecutor | None = None
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
            self._loader = ThreadPoolExecutor(load_threads, thread_name_prefix="kvc-vllm-load")

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
            log.debug(
                "kvc skips request %s (%s): vLLM keys its KV on more than token ids",
                request.request_id,
                reason,
            )
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
        if self._skip(request) or request.request_id in self._load_failed:
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
        return end - num_computed_tokens, self._load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember the load vLLM allocated blocks for, with the request's whole block table
        as it is now (for a new request and for a preempted one vLLM resumes alike; an
        asynchronous load's request is not scheduled this step, so this is the only place
        its blocks are known). A second call after an asynchronous load (for the blocks of
        the tokens vLLM computes next) carries no external tokens and changes nothing."""
        offered = self._offered.pop(request.request_id, None)
        if num_external_tokens <= 0 or offered is None:
            return
        computed, _end = offered
        end = computed + num_external_tokens
        self._loads[request.request_id] = LoadSpec(
            request.request_id,
            tuple((request.prompt_token_ids or [])[: end + 1]),
            tuple(blocks.get_block_ids()[0]),
            computed,
            end,
            self._load_async,
        )
        with self._lock:
            self._stats.record_hit(num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvcConnectorMetadata:
        """The step's loads (every one `update_state_after_alloc` recorded since the last
        step), the saves of requests that finished, and the loads to stop."""
        meta = KvcConnectorMetadata(
            loads=list(self._loads.values()), saves=self._saves, cancels=self._cancels
        )
        self._loads, self._saves, self._cancels = {}, [], []
        for load in meta.loads:
            if load.load_async:
                first = load.start // self._block_size
                self._loading[load.req_id] = frozenset(
                    load.block_ids[first : -(-load.end // self._block_size)]
                )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Note which asynchronous loads lost blocks (vLLM recomputes them), so such a request
        is never offered a load again (a load that failed at its first block would otherwise
        be offered, and fail, again when vLLM reschedules it from scratch), and forget the
        loads the workers have finished."""
        invalid = connector_output.invalid_block_ids
        if invalid:
            self._load_failed.update(
                req_id for req_id, blocks in self._loading.items() if blocks & invalid
            )
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Save the request's computed positions (whole vLLM blocks) unless the catalog has them
        for every tensor-parallel rank (every rank gets the save: one whose shard is missing
        stores it, the others' checkpointers skip what is catalogued); the blocks stay
        allocated until the workers report the save has copied them to host memory. Only
        positions a finished step wrote count (`written_tokens`), in whole blocks: a block
        still being written is never saved. A request that finishes (is aborted) while its
        asynchronous load runs is not saved: the workers stop the load, and vLLM frees its
        blocks, never cached, once they report it received."""
        req_id = request.request_id
        self._offered.pop(req_id, None)
        self._load_failed.discard(req_id)
        skip = self._skip(request)
        self._skipping.discard(req_id)
        self._loads.pop(req_id, None)
        if req_id in self._loading:
            self._cancels.append(req_id)
            return False, None
        if skip:
            return False, None
        tokens = list(request.all_token_ids)
        n = written_tokens(request) // self._block_size * self._block_size
        if n == 0:
            return False, None
        try:
            stored = self._stored_by_every_rank(tokens[: n + 1], n, n)
        except Exception as exc:
            log.warning("kvc lookup for request %s failed: %s", req_id, exc)
            return False, None
        if stored >= n:
            return False, None
        self._saves.append(
            SaveSpec(req_id, tuple(tokens[:n]), tuple(block_ids[: n // self._block_size]))
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
        layers = layer_views(kv_caches, names, shard_layout, self._block_size)
        device = layers[0].device
        if device.type == "cuda":
            # The connector's copies, off vLLM's stream.
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        elif device.type != "cpu":
            raise UnsupportedModelError(
                f"vLLM's KV cache is on {device}: the kvc connector copies to and from CPU and "
                "CUDA devices"
            )
        self._layers = layers

    def _table(
        self,
        block_ids: Iterable[int],
        *,
        start: int = 0,
        length: int = 0,
        after: torch.cuda.Event | None = None,
    ) -> BlockTable:
        if not self._layers:
            raise InputError("register_kv_caches must run before loads and saves")
        return BlockTable(
            self._layers,
            self._shard_layout,
            self._block_size,
            block_ids,
            start=start,
            length=length,
            stream=self._stream,
            after=after,
        )

    def _forward_mark(self) -> torch.cuda.Event | None:
        """An event recorded now on vLLM's forward stream (the calling thread's current stream):
        copies on the connector's stream that wait on it come after everything the forward
        has enqueued so far. None for CPU blocks."""
        if self._stream is None:
            return None
        mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
        mark.record(torch.cuda.current_stream(self._layers[0].device))
        return mark

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Stop the loads of requests vLLM aborted, then start this step's loads: an
        asynchronous one on the load threads (vLLM calls this after launching the forward,
        which does not read its blocks), a synchronous one here, before the forward."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcConnectorMetadata)
        assert self._loader is not None
        with self._lock:
            for req_id in meta.cancels:
                cancel = self._cancel.get(req_id)
                if cancel is not None:
                    cancel.set()
        if not meta.loads:
            return
        after = self._forward_mark()
        for load in meta.loads:
            if not load.load_async:
                done = self._load(load, after, None)
                if done is not None:  # the forward reads these blocks: it waits for the copies
                    torch.cuda.current_stream(self._layers[0].device).wait_event(done)
                continue
            cancel = threading.Event()
            with self._lock:
                self._cancel[load.req_id] = cancel
            self._loader.submit(self._load_async_request, load, after, cancel)

    def _load_async_request(
        self, load: LoadSpec, after: torch.cuda.Event | None, cancel: threading.Event
    ) -> None:
        """An asynchronous load, on a load thread: done (its copies landed, or it stopped)
        before it is reported received, whatever happens."""
        # A new thread starts on device 0: copies go to the device of this rank's blocks.
        on_device: contextlib.AbstractContextManager[Any] = (
            torch.cuda.device(self._stream.device)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        try:
            with on_device:
                if not cancel.is_set():  # aborted before it started: nothing to stop
                    done = self._load(load, after, cancel)
                    if done is not None:
                        done.synchronize()
        finally:
            with self._lock:
                self._cancel.pop(load.req_id, None)
                self._received.add(load.req_id)

    def _load(
        self, load: LoadSpec, after: torch.cuda.Event | None, cancel: threading.Event | None
    ) -> torch.cuda.Event | None:
        """Restore one load's positions into its blocks; the blocks of positions not restored
        are load errors, except for a load stopped because vLLM aborted its request (its
        blocks are freed, never read). Returns the event after its device copies."""
        assert self.restorer is not None
        table = self._table(load.block_ids, start=load.start, after=after)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            result = self.restorer.restore_into(
                table,
                list(load.token_ids),
                self.fingerprint,
                self.shard,
                max_tokens=load.end,
                cancel=cancel,
            )
            nbytes = result.report.bytes
        except Exception as exc:  # any failure: vLLM recomputes, never reads unverified KV
            if cancel is None or not cancel.is_set():
                log.warning("kvc restore for request %s failed: %s", load.req_id, exc)
            table.restored = 0
        done = table.finish()
        with self._lock:
            if cancel is not None and cancel.is_set():
                return done
            self._stats.record_load(
                tokens=max(0, table.restored - load.start),
                nbytes=nbytes,
                seconds=time.perf_counter() - t0,
                complete=table.restored >= load.end,
            )
            if table.restored < load.end:
                self._load_errors |= table.blocks_from(max(table.restored, load.start), load.end)
        return done

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load is whole before its request's forward (see docs/engines.md)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves copy the finished request's blocks (wait_for_save)

    def wait_for_save(self) -> None:
        """Copy each finished request's positions to host memory once (on a device: enqueued
        on the connector's stream after this step's forward); a save whose copy has landed
        releases its blocks and goes to the checkpointer, which publishes it on its thread."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcConnectorMetadata)
        if meta.saves:
            after = self._forward_mark()
            for save in meta.saves:
                table = self._table(save.block_ids, length=len(save.token_ids), after=after)
                try:
                    staged, done = table.stage()
                except Exception as exc:  # a save not made is a future miss
                    log.warning(
                        "kvc could not copy request %s's KV to host memory: %s", save.req_id, exc
                    )
                    with self._lock:
                        self._stats.record_save(None)
                        self._saved.add(save.req_id)
                    continue
                self._staging.append((save, staged, done))
        self._publish_staged()

    def _publish_staged(self) -> None:
        """Saves whose host copy is complete: blocks released (reported finished sending at
        this step's `get_finished`), the copy handed to the checkpointer. Runs on the model
        runner's thread only (wait_for_save, get_finished)."""
        waiting: list[tuple[SaveSpec, StagedKV, torch.cuda.Event | None]] = []
        for save, staged, done in self._staging:
            if done is not None and not done.query():  # type: ignore[no-untyped-call]
                waiting.append((save, staged, done))
                continue
            with self._lock:
                self._saved.add(save.req_id)
            self._publish(save, staged)
        self._staging = waiting

    def _publish(self, save: SaveSpec, staged: StagedKV) -> None:
        assert self.checkpointer is not None
        try:
            published = self.checkpointer.submit_snapshot(
                staged, list(save.token_ids), self.fingerprint
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(saves whose blocks may be freed, asynchronous loads done or stopped) since the last
        call. A load's failed blocks are in `get_block_ids_with_load_errors` by the time its
        request is reported here (both are recorded together)."""
        self._publish_staged()
        with self._lock:
            saved, self._saved = self._saved, set()
            received, self._received = self._received, set()
        return (saved or None), (received or None)

    def get_kv_connector_stats(self) -> KvcConnectorStats | None:
        """What this process counted since the last call (vLLM calls it every step, on the
        scheduler and on each worker, and aggregates the payloads), or None when nothing."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvcConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
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
        """Stop every load (each stops at its next chunk), wait for the load threads and for
        host copies still in flight, publish what was staged, then close the session (which
        drains the checkpointer)."""
        with self._lock:
            for cancel in self._cancel.values():
                cancel.set()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        for _save, _staged, done in self._staging:
            if done is not None:
                done.synchronize()
        self._publish_staged()
        self.session.close()


def _layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (`model.layers.12.self_attn.attn` -> 12)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise UnsupportedModelError(f"cannot tell the layer index of vLLM layer {name!r}")
    return numbers[0]
