"""What an operator of vLLM relies on, through vLLM's own objects: the connector's metrics
collected, aggregated, serialized and exposed the way vLLM does it; tensor parallelism
(a hit only when every rank's shard is stored, a missing shard saved again); and the save
frontier under vLLM's `AsyncScheduler` (only positions a finished step wrote are saved)."""

from __future__ import annotations

import functools
import pickle
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from catalog.catalog import Catalog  # noqa: E402
from chunkstore import open_store  # noqa: E402
from restore.engines.vllm import KvcConnector, KvcConnectorMetadata, SaveSpec  # noqa: E402
from tests.restore.engines.test_vllm import (  # noqa: E402
    BLOCK,
    EOS,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    NUM_BLOCKS,
    corrupt_third_chunk,
    kv_cache_config,
    kv_caches,
    model_dir,
    positions,
    request,
    run_step,
    save,
    vllm_config,
    worker,
)

__all__ = ["model_dir"]  # the module-scoped tiny Llama of test_vllm.py


def scheduler(config: VllmConfig, cls: type[Scheduler] = Scheduler) -> Scheduler:
    """vLLM's scheduler with statistics on (what `vllm serve` runs unless told not to log)."""
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config(),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def step_output(out: Any, w: KvcConnector, token: int) -> ModelRunnerOutput:
    """One worker's `ModelRunnerOutput` for a step, carrying what its connector reports after
    the step (as vLLM's model runner mixin does), pickled and unpickled like the output a
    worker process sends to the executor."""
    sending, received = w.get_finished(set())
    req_ids = list(out.num_scheduled_tokens)
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(
            finished_sending=sending,
            finished_recving=received,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
        ),
    )
    return pickle.loads(pickle.dumps(output))


def engine_step(
    sched: Scheduler,
    workers: list[KvcConnector],
    aggregator: KVOutputAggregator,
    on_step: Callable[[Any], None] = lambda out: None,
    on_stats: Callable[[dict[str, Any]], None] = lambda payload: None,
) -> None:
    """One step of vLLM's engine loop over tensor-parallel workers with a CPU runner sampling
    token 1: every worker runs the step's loads and saves, vLLM's `KVOutputAggregator` merges
    their outputs (a save is read once every rank reports it; stats are aggregated), the
    scheduler takes the result, and the `SchedulerStats` it returns travel through vLLM's
    msgpack encoding to `on_stats` as the front end receives them."""
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvcConnectorMetadata)
    for w in workers:
        run_step(w, meta)
    on_step(out)
    merged = aggregator.aggregate([step_output(out, w, token=1) for w in workers])
    assert merged is not None
    for eco in sched.update_from_output(out, merged).values():
        received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(eco))
        if received.scheduler_stats is not None and received.scheduler_stats.kv_connector_stats:
            on_stats(received.scheduler_stats.kv_connector_stats)


def drive(
    sched: Scheduler,
    workers: list[KvcConnector],
    *,
    until: Callable[[], bool],
    on_step: Callable[[Any], None] = lambda out: None,
    on_stats: Callable[[dict[str, Any]], None] = lambda payload: None,
    deadline_s: float = 30.0,
) -> None:
    """`engine_step` until `until()` holds."""
    aggregator = KVOutputAggregator(expected_finished_count=len(workers))
    stop = time.monotonic() + deadline_s
    while not until():
        assert time.monotonic() < stop, {r: (q.status, q.num_computed_tokens) for r, q in sched.requests.items()}
        engine_step(sched, workers, aggregator, on_step, on_stats)


def flush_stats(
    sched: Scheduler, workers: list[KvcConnector], on_stats: Callable[[dict[str, Any]], None]
) -> None:
    """Saves publish in the background: once every one is (the checkpointers closed), one
    more, empty, step carries their counts, as the next step of a running server would."""
    for w in workers:
        assert w.checkpointer is not None
        w.checkpointer.close()
    engine_step(sched, workers, KVOutputAggregator(len(workers)), on_stats=on_stats)


def registry_prom(config: VllmConfig, registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's `KVConnectorProm` (what `PrometheusStatLogger` builds; it asks the connector
    class named in the config for `build_prom_metrics`) with its metrics in `registry`, the
    way vLLM's Ray logger swaps the metric classes."""

    class InRegistry(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=registry)  # type: ignore[assignment]

    return InRegistry(config, ["model_name", "engine"], {0: ["tiny", "0"]})


def test_metrics_reach_vllms_log_and_prometheus(model_dir: Path, tmp_path: Path) -> None:
    """Hits, tokens and bytes loaded, load time, a load error, saves and their bytes, and a
    skipped request, counted by the scheduler and the worker, merged by vLLM, and read back
    from vLLM's log line and from Prometheus metrics registered by `build_prom_metrics`."""
    config = vllm_config(model_dir, tmp_path)
    src = worker(config, kv_caches(fill=True))
    intact = list(range(1, 129))  # 2 chunks of 64
    corrupt = list(range(1000, 1256))  # 4 chunks; the third is corrupted below
    save(src, intact, list(range(0, 8)))
    src.shutdown()
    src = worker(config, kv_caches(fill=True, seed=1))
    save(src, corrupt, list(range(8, 24)))
    src.shutdown()
    corrupt_third_chunk(tmp_path, src.fingerprint.hex, corrupt)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        chunk_bytes = [c.stored_bytes for c in cat.lookup("vllm", src.fingerprint.hex, [*intact, 0]).chunks]
        chunk_bytes += [c.stored_bytes for c in cat.lookup("vllm", src.fingerprint.hex, [*corrupt, 0]).chunks[:2]]
    usage_before = stored_bytes(tmp_path)

    sched = scheduler(config)
    w = worker(config, kv_caches(fill=False))
    sched.add_request(request("hit", [*intact, *range(600, 620)]))  # saves 144 positions
    sched.add_request(request("bad", [*corrupt, 5, 6, 7]))
    sched.add_request(request("lora", [*intact, 5, 6, 7], lora_request=LoRARequest("a", 1, "/a")))
    sched.add_request(request("miss", [900 + i for i in range(40)]))
    saves: list[str] = []
    payloads: list[dict[str, Any]] = []
    drive(
        sched,
        [w],
        until=lambda: not sched.has_requests(),
        on_step=lambda out: saves.extend(s.req_id for s in out.kv_connector_metadata.saves),
        on_stats=payloads.append,
    )
    flush_stats(sched, [w], payloads.append)
    assert sorted(saves) == ["bad", "hit", "miss"]
    saved_bytes = stored_bytes(tmp_path) - usage_before
    assert saved_bytes > 0

    # vLLM's periodic log line (KVConnectorLogging aggregates the interval's payloads).
    logging_ = KVConnectorLogging(config.kv_transfer_config)
    for payload in payloads:
        logging_.observe(payload)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    [line] = lines
    for part in ("Hit requests=2", "Hit tokens=384", "Loads=2", "Load errors=1", "Saves=3",
                 "Save errors=0", "Skipped (lora)=1"):
        assert part in line, line

    # Prometheus, as vLLM's PrometheusStatLogger observes every payload.
    registry = CollectorRegistry()
    prom = registry_prom(config, registry)
    for payload in payloads:
        prom.observe(payload, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}

    def sample(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert sample("vllm:kvc_hit_requests_total") == 2
    assert sample("vllm:kvc_hit_tokens_total") == 128 + 256
    assert sample("vllm:kvc_loads_total") == 2
    assert sample("vllm:kvc_load_errors_total") == 1
    assert sample("vllm:kvc_loaded_tokens_total") == 128 + 128  # the corrupt chunk stops "bad" at 128
    assert sample("vllm:kvc_loaded_bytes_total") == sum(chunk_bytes)
    assert sample("vllm:kvc_load_seconds_count") == 2
    assert (sample("vllm:kvc_load_seconds_sum") or 0) > 0
    assert sample("vllm:kvc_saves_total") == 3
    assert sample("vllm:kvc_save_errors_total") == 0
    assert sample("vllm:kvc_saved_bytes_total") == saved_bytes
    assert sample("vllm:kvc_skipped_requests_total", reason="lora") == 1
    assert sample("vllm:kvc_skipped_requests_total", reason="multimodal") is None
    sched.shutdown()
    w.shutdown()


def stored_bytes(tmp_path: Path) -> int:
    """The bytes of every chunk the catalog holds in the test namespace."""
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        rows = db.execute("SELECT stored_bytes FROM v_namespace_usage WHERE namespace = 'vllm'").fetchall()
    return sum(r[0] for r in rows)


def test_stats_are_none_when_nothing_happened_and_reset_when_collected(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM asks every step: an idle connector sends nothing, and a payload is sent once."""
    config = vllm_config(model_dir, tmp_path)
    c = KvcConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert c.get_kv_connector_stats() is None
    assert c.get_num_new_matched_tokens(request("s", list(range(40)), cache_salt="t"), 0) == (0, False)
    stats = c.get_kv_connector_stats()
    assert stats is not None and stats.reduce()["Skipped (cache_salt)"] == 1
    assert c.get_kv_connector_stats() is None
    # vLLM rebuilds a payload from its dict (build_kv_connector_stats) and merges payloads.
    again = KvcConnector.build_kv_connector_stats(stats.to_dict())
    assert again is not None and again.to_dict() == stats.to_dict()
    merged = again.aggregate(KvcConnector.build_kv_connector_stats(stats.to_dict()))  # type: ignore[arg-type]
    assert merged.to_dict()["skipped"] == {"cache_salt": 2}
    c.shutdown()


# ---- tensor parallelism ---------------------------------------------------------------

TP = 2


def tp_config(model_dir: Path, tmp_path: Path, rank: int) -> VllmConfig:
    """docs/engines.md's configuration at tensor-parallel size 2, as rank `rank` sees it."""
    base = vllm_config(model_dir, tmp_path)
    config = VllmConfig(
        model_config=base.model_config,
        scheduler_config=base.scheduler_config,
        cache_config=base.cache_config,
        kv_transfer_config=base.kv_transfer_config,
        device_config=base.device_config,
        parallel_config=ParallelConfig(tensor_parallel_size=TP),
    )
    config.parallel_config.rank = rank
    config.cache_config.enable_prefix_caching = False  # every reuse below is kvc's
    return config


def rank_caches(seed: int) -> dict[str, torch.Tensor]:
    """One rank's per-layer tensors in vLLM's layout: its KV_HEADS // TP kv heads."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, KV_HEADS // TP, BLOCK, 2 * HEAD_DIM)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.float16)
        for i in range(LAYERS)
    }


def test_tensor_parallel_hits_need_every_ranks_shard_and_a_missing_shard_is_saved_again(
    model_dir: Path, tmp_path: Path
) -> None:
    """TP=2 with only rank 0's shard of a prefix stored: vLLM's scheduler is offered nothing
    (rank 1 could not load its kv heads). When the request finishes it is saved: rank 1
    stores its shard, rank 0 stores only what it lacked. The next request with the prefix
    loads it on both ranks, bit for bit."""
    stored = list(range(1, 129))  # 8 blocks, 2 chunks of 64
    src_caches = rank_caches(seed=10)
    src = worker(tp_config(model_dir, tmp_path, 0), src_caches)
    assert src.shard.head_lo == 0 and src.shard.head_hi == KV_HEADS // TP
    save(src, stored, list(range(0, 8)))
    src.shutdown()
    store = open_store(f"file://{tmp_path / 'blobs'}")
    assert len(list(store.keys())) == 2

    config = tp_config(model_dir, tmp_path, 0)
    sched = scheduler(config)
    connector = sched.get_kv_connector()
    assert isinstance(connector, KvcConnector)
    caches = [rank_caches(seed=20 + r) for r in range(TP)]
    workers = [worker(tp_config(model_dir, tmp_path, r), caches[r]) for r in range(TP)]
    assert [w.shard.head_lo for w in workers] == [0, 1]

    # Only rank 0's shard is stored: no load is offered.
    sched.add_request(request("first", [*stored, *range(300, 316)]))  # 144 tokens
    first_blocks: list[int] = []
    loads: list[Any] = []
    saves: list[Any] = []
    saved_kv: list[list[torch.Tensor]] = []

    def record(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        saves.extend(out.kv_connector_metadata.saves)
        for new in out.scheduled_new_reqs:
            if new.req_id == "first":
                first_blocks.extend(new.block_ids[0])
        if out.kv_connector_metadata.saves:  # what rank 1 saved, before its blocks are reused
            saved_kv.extend(positions(caches[r], first_blocks[:8], 128) for r in range(TP))

    drive(sched, workers, until=lambda: not sched.has_requests(), on_step=record)
    assert loads == []
    # Saved, although rank 0 already held the first 128 positions: rank 1 did not.
    assert [(s.req_id, len(s.token_ids)) for s in saves] == [("first", 144)]
    # Each rank publishes in the background: wait until both have catalogued the prompt.
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        deadline = time.monotonic() + 30
        while any(
            cat.lookup("vllm", w.fingerprint.hex, [*stored, *range(300, 316)], shard=w.shard).matched_tokens < 143
            for w in workers
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # Rank 0 stored only its third chunk (positions 128..143); rank 1 all three of its own.
    assert len(list(store.keys())) == 2 + 1 + 3

    # The next request with the prefix loads it, on both ranks, into its own blocks.
    sched.add_request(request("second", [*stored, *range(500, 516)]))
    loads.clear()
    drive(sched, workers, until=lambda: not sched.has_requests(), on_step=record)
    assert [(load.req_id, load.start, load.end) for load in loads] == [("second", 0, 128)]
    blocks = list(loads[0].block_ids)[:8]
    want = [positions(src_caches, list(range(0, 8)), 128), saved_kv[1]]  # rank 0, rank 1
    for r in range(TP):
        for got, expected in zip(positions(caches[r], blocks, 128), want[r], strict=True):
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    sched.shutdown()
    for w in workers:
        w.shutdown()
    store.close()


def test_a_tensor_parallel_lookup_stops_at_the_first_rank_that_misses(
    model_dir: Path, tmp_path: Path
) -> None:
    """One catalog lookup per rank at most, and none after a rank that holds nothing useful."""
    c = KvcConnector(tp_config(model_dir, tmp_path, 0), KVConnectorRole.SCHEDULER, kv_cache_config())
    asked: list[tuple[int, int | None]] = []
    lookup = c.catalog.lookup

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked.append((kwargs["shard"].head_lo, kwargs.get("max_tokens")))
        return lookup(*args, **kwargs)

    c.catalog.lookup = counted  # type: ignore[method-assign]
    assert c.get_num_new_matched_tokens(request("r", list(range(1, 100))), 0) == (0, False)
    assert asked == [(0, 98)]  # rank 0 holds nothing: rank 1 is not asked
    c.shutdown()


# ---- the save frontier under async scheduling --------------------------------------------


def test_async_scheduling_saves_only_positions_a_finished_step_wrote(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's `AsyncScheduler` schedules step 2 before step 1's output is in. A 31-token
    prompt: step 1 computes positions 0..30 and samples EOS; step 2, already scheduled,
    computes position 31 (`num_computed_tokens` 32, one token in flight) when step 1's
    output finishes the request. Position 31 is not written yet, so only the first block
    (positions 0..15) is saved; counting the in-flight token would save a second block
    holding an unwritten position."""
    config = vllm_config(model_dir, tmp_path)
    config.scheduler_config.async_scheduling = True
    sched = scheduler(config, AsyncScheduler)
    caches = kv_caches(fill=True)
    w = worker(config, caches)
    prompt = list(range(1, 32))  # 31 tokens
    sched.add_request(request("r", prompt))
    req = sched.requests["r"]
    first = sched.schedule()
    blocks = list(first.scheduled_new_reqs[0].block_ids[0])
    second = sched.schedule()  # scheduled before the first step's output is in
    assert second.num_scheduled_tokens == {"r": 1}
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (32, 32)
    sched.update_from_output(first, step_output(first, w, token=EOS))
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (32, 1)
    third = sched.schedule()  # carries the save
    meta = third.kv_connector_metadata
    assert isinstance(meta, KvcConnectorMetadata)
    assert [(s.req_id, s.token_ids, list(s.block_ids)) for s in meta.saves] == [
        ("r", tuple(prompt[:16]), blocks[:1])
    ]
    run_step(w, meta)
    assert w.checkpointer is not None
    w.checkpointer.close()
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        assert cat.lookup("vllm", w.fingerprint.hex, [*prompt, EOS]).matched_tokens == 16
    sched.update_from_output(second, step_output(second, w, token=1))
    sched.update_from_output(third, step_output(third, w, token=1))
    assert "r" not in sched.requests  # the save was read: vLLM freed the blocks
    sched.shutdown()
    w.shutdown()


def test_a_worker_step_with_nothing_to_report_sends_no_stats(model_dir: Path, tmp_path: Path) -> None:
    """A worker with no loads and no saves in a step reports None (vLLM then sends no payload)."""
    w = worker(vllm_config(model_dir, tmp_path), kv_caches(fill=False))
    run_step(w, KvcConnectorMetadata())
    assert w.get_kv_connector_stats() is None
    w.shutdown()


def test_a_save_that_fails_is_counted_as_a_save_error(model_dir: Path, tmp_path: Path) -> None:
    """KV holding a NaN is refused by the checkpointer (nothing stored): the blocks are
    released all the same and the save counts as an error, not a save."""
    caches = kv_caches(fill=True)
    next(iter(caches.values()))[2, 0, 3, 0] = float("nan")  # block 2, a position of the save
    w = worker(vllm_config(model_dir, tmp_path), caches)
    run_step(w, KvcConnectorMetadata(saves=[SaveSpec("r", tuple(range(1, 65)), (0, 1, 2, 3))]))
    assert w.checkpointer is not None
    w.checkpointer.close()
    assert w.get_finished(set()) == ({"r"}, None)
    stats = w.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["saves"], stats.data["save_errors"], stats.data["saved_bytes"]) == (0, 1, 0)
    assert stored_bytes(tmp_path) == 0
    w.shutdown()
