"""The kvc vLLM v1 connector against vLLM's own classes: the real `Scheduler` deciding hits and
building metadata against a real kvc catalog, and the worker side moving KV in vLLM's real
per-layer layout, bit for bit, with a corrupted chunk reported for recomputation."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from catalog.catalog import Catalog  # noqa: E402
from catalog.errors import CatalogInputError  # noqa: E402
from catalog.remote import RemoteCatalog  # noqa: E402
from chunkstore import ChunkStore, Receipt, open_store  # noqa: E402
from chunkstore.errors import StoreUnavailableError  # noqa: E402
from kvc.service import create_app, hash_token  # noqa: E402
from restore.engines.vllm import (  # noqa: E402
    KvcConnector,
    KvcConnectorMetadata,
    LoadSpec,
    SaveSpec,
)
from restore.errors import InputError, UnsupportedModelError  # noqa: E402
from tests.rebuild_helpers import kvc_rebuild, lose_catalog, names  # noqa: E402
from tests.services import serve_in_thread  # noqa: E402
from tests.store_wrappers import Delegating  # noqa: E402

BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with random weights, saved with save_pretrained (nothing downloads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)
    return path


def vllm_config(
    model_dir: Path, tmp: Path, *, policy: str = "recompute", **extra: Any
) -> VllmConfig:
    """docs/engines.md's configuration (`kv_load_failure_policy="recompute"`) over `tmp`."""
    Catalog.open(f"sqlite:///{tmp / 'catalog.db'}", upgrade=True).close()  # `kvc init`
    kv = KVTransferConfig(
        kv_connector="KvcConnector",
        kv_connector_module_path="restore.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={
            "catalog": f"sqlite:///{tmp / 'catalog.db'}",
            "stores": [f"file://{tmp / 'blobs'}"],
            "namespace": "vllm",
            "chunk_size": 64,
            **extra,
        },
    )
    model = ModelConfig(model=str(model_dir), dtype="float16", seed=0, skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float16
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def kv_caches(fill: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views: [blocks, kv heads, block size, 2 * head size], K|V packed."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=g).to(torch.float16) if fill else torch.zeros(shape, dtype=torch.float16)
        )
        for i in range(LAYERS)
    }


def worker(config: VllmConfig, caches: dict[str, torch.Tensor]) -> KvcConnector:
    c = KvcConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    c.register_kv_caches(caches)
    return c


def run_step(c: KvcConnector, meta: KvcConnectorMetadata) -> None:
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.wait_for_save()
    c.clear_connector_metadata()


def load_now(c: KvcConnector, *loads: LoadSpec, deadline_s: float = 20.0) -> None:
    """Run a step with `loads` and wait until the worker reports every one received (a load
    runs on the connector's load threads, beside the forward passes)."""
    run_step(c, KvcConnectorMetadata(loads=list(loads)))
    waiting = {load.req_id for load in loads if load.load_async}
    stop = time.monotonic() + deadline_s
    while waiting:
        assert time.monotonic() < stop, f"loads {waiting} not received"
        _sending, received = c.get_finished(set())
        waiting -= received or set()
        time.sleep(0.001)


def save(c: KvcConnector, tokens: list[int], blocks: list[int]) -> None:
    run_step(c, KvcConnectorMetadata(saves=[SaveSpec("r-save", tuple(tokens), tuple(blocks))]))
    assert c.checkpointer is not None
    c.checkpointer.close()  # the background save is durable and catalogued
    assert c.get_finished(set()) == ({"r-save"}, None)


def positions(caches: dict[str, torch.Tensor], blocks: list[int], n: int) -> list[torch.Tensor]:
    """Each layer's KV of positions [0, n) held in `blocks`, as [n, heads, 2 * head dim]."""
    out = []
    for t in caches.values():
        rows = torch.cat([t[b].permute(1, 0, 2) for b in blocks])  # [blocks * block, heads, C]
        out.append(rows[:n].clone())
    return out


def test_worker_round_trips_kv_in_vllms_layout_bit_for_bit(model_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(model_dir, tmp_path)
    src = kv_caches(fill=True)
    tokens = list(range(1, 161))  # 10 blocks
    w = worker(config, src)
    save(w, tokens, list(range(3, 13)))
    w.shutdown()
    # docs/engines.md's queries see what was stored.
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        usage = db.execute(
            "SELECT fingerprint, chunks, tokens, stored_bytes "
            "FROM v_namespace_usage WHERE namespace = 'vllm'"
        ).fetchall()
        accesses = db.execute(
            "SELECT fingerprint, sum(access_count) AS accesses, max(last_access_at) AS last_access "
            "FROM v_chunks WHERE namespace = 'vllm' GROUP BY fingerprint"
        ).fetchall()
    assert [(fp, chunks, n) for fp, chunks, n, _bytes in usage] == [(w.fingerprint.hex, 3, 160)]
    assert [fp for fp, _n, _last in accesses] == [w.fingerprint.hex]

    dst = kv_caches(fill=False)
    r = worker(config, dst)
    dst_blocks = list(range(40, 50))
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(dst_blocks), 0, 160))
    assert r.get_block_ids_with_load_errors() == set()
    for a, b in zip(positions(src, list(range(3, 13)), 160), positions(dst, dst_blocks, 160), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    r.shutdown()


def test_positions_vllm_already_holds_are_not_written(model_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(model_dir, tmp_path)
    src = kv_caches(fill=True)
    tokens = list(range(1, 129))
    w = worker(config, src)
    save(w, tokens, list(range(0, 8)))
    w.shutdown()

    dst = kv_caches(fill=False)
    r = worker(config, dst)
    blocks = list(range(20, 28))
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(blocks), 64, 128))
    got = positions(dst, blocks, 128)
    want = positions(src, list(range(0, 8)), 128)
    for g, w_ in zip(got, want, strict=True):
        assert not g[:64].any()  # vLLM's own (here: zero) positions left alone
        assert torch.equal(g[64:].view(torch.int16), w_[64:].view(torch.int16))
    r.shutdown()


def test_a_corrupted_chunk_reports_its_blocks_and_writes_no_bytes(model_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(model_dir, tmp_path)
    src = kv_caches(fill=True)
    tokens = list(range(1, 257))  # 4 kvc chunks of 64
    w = worker(config, src)
    save(w, tokens, list(range(0, 16)))
    w.shutdown()

    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    match = cat.lookup("vllm", w.fingerprint.hex, [*tokens, 7])
    assert match.matched_tokens == 256
    third = match.chunks[2]
    blob = open_store(f"file://{tmp_path / 'blobs'}").path_of(third.blob_key)  # type: ignore[attr-defined]
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))

    dst = kv_caches(fill=False)
    r = worker(config, dst)
    blocks = list(range(30, 46))
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(blocks), 0, 256))
    # Positions 128..255 (chunks 3 and 4) could not be restored: their blocks go back to vLLM.
    assert r.get_block_ids_with_load_errors() == set(blocks[8:])
    assert r.get_block_ids_with_load_errors() == set()  # reported once
    got = positions(dst, blocks, 256)
    want = positions(src, list(range(0, 16)), 256)
    for g, w_ in zip(got, want, strict=True):
        assert torch.equal(g[:128].view(torch.int16), w_[:128].view(torch.int16))
        assert not g[128:192].any()  # nothing of the corrupt chunk was written
        # (the verified chunk after it may have been: its blocks are reported all the same)
    r.shutdown()
    cat.close()


def make_scheduler(config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def request(req_id: str, tokens: list[int], max_tokens: int = 4, **kwargs: Any) -> Request:
    """A request as vLLM's engine core builds it (`lora_request`, `mm_features`, `cache_salt`
    as keyword arguments of `Request`)."""
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        **kwargs,
    )


@pytest.mark.parametrize("load_async", [True, False])
def test_vllms_scheduler_loads_the_stored_prefix_in_whole_blocks(
    model_dir: Path, tmp_path: Path, load_async: bool
) -> None:
    """An asynchronous load (the default): vLLM allocates the blocks, parks the request while
    the worker loads, and schedules only the rest of the prompt once the worker reports it
    received; a synchronous one (`load_async: false`) is scheduled in the step of its load."""
    config = vllm_config(model_dir, tmp_path, load_async=load_async)
    w = worker(config, kv_caches(fill=True))
    stored = list(range(1, 201))  # 200 positions: chunks of 64, 64, 64, 8
    save(w, stored, list(range(0, 13)))
    w.shutdown()

    sched = make_scheduler(config)
    prompt = [*stored, 7, 8, 9, 10, 11]  # 205 tokens
    sched.add_request(request("hit", prompt))
    sched.add_request(request("miss", [999] * 40))
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvcConnectorMetadata)
    loads = {load.req_id: load for load in meta.loads}
    assert set(loads) == {"hit"}
    load = loads["hit"]
    # 200 stored, whole blocks of 16: 192; vLLM computes the rest.
    assert (load.start, load.end, load.load_async) == (0, 192, load_async)
    assert list(load.token_ids) == prompt[:193]
    assert list(load.block_ids) == sched.kv_cache_manager.get_block_ids("hit")[0]
    assert out.num_scheduled_tokens["miss"] == 40
    if load_async:
        assert "hit" not in out.num_scheduled_tokens
        assert sched.requests["hit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        r = worker(config, kv_caches(fill=False))
        run_step(r, meta)  # the load starts; the step's forward computes "miss"
        sched.update_from_output(out, runner_output(list(out.num_scheduled_tokens), token=1))
        scheduled: list[Any] = []
        drive(
            sched,
            r,
            until=lambda: bool(scheduled),
            on_step=lambda o: scheduled.extend([o] if "hit" in o.num_scheduled_tokens else []),
        )
        r.shutdown()
        out = scheduled[0]
    new = {q.req_id: q for q in out.scheduled_new_reqs}
    assert list(new["hit"].block_ids[0][: len(load.block_ids)]) == list(load.block_ids)
    assert out.num_scheduled_tokens["hit"] == len(prompt) - 192
    # vLLM's hit metrics count these tokens under the disk source.
    connector = sched.get_kv_connector()
    assert connector is not None
    assert connector.get_external_cache_hit_sources(sched.requests["hit"], 192) == {
        CacheHitSource.DISK: 192
    }
    sched.shutdown()


def test_a_finished_request_is_saved_and_its_blocks_held_until_the_worker_read_them(
    model_dir: Path, tmp_path: Path
) -> None:
    config = vllm_config(model_dir, tmp_path)
    caches = kv_caches(fill=True)
    w = worker(config, caches)
    sched = make_scheduler(config)
    prompt = list(range(1, 40))  # 39 tokens; with 2 generated, 40 computed: 2 whole blocks
    sched.add_request(request("r", prompt))
    out = sched.schedule()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.update_from_output(out, runner_output(["r"], token=1))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(["r"], token=EOS))  # max_tokens or EOS: finished
    out = sched.schedule()  # carries the save
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvcConnectorMetadata)
    assert [(s.req_id, len(s.token_ids), list(s.block_ids)) for s in meta.saves] == [("r", 32, blocks[:2])]
    # vLLM has not freed the request's blocks: the save has not read them yet.
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < free_before + len(blocks)
    assert "r" in sched.requests
    run_step(w, meta)
    assert w.checkpointer is not None
    w.checkpointer.close()
    sending, _ = w.get_finished(set())
    sched.update_from_output(out, runner_output([], finished_sending=sending))
    assert "r" not in sched.requests  # released once the worker reported the save read
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    assert cat.lookup("vllm", w.fingerprint.hex, [*prompt, 1]).matched_tokens == 32
    cat.close()
    w.shutdown()
    sched.shutdown()


EOS = 2


def runner_output(req_ids: list[str], token: int = 0, finished_sending: set[str] | None = None) -> Any:
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=finished_sending)
        if finished_sending
        else None,
    )


def test_the_scheduler_saves_a_finished_request_once(model_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(model_dir, tmp_path)
    sched = KvcConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    req = request("r", list(range(1, 41)))
    req.num_computed_tokens = 40
    delay, _params = sched.request_finished(req, list(range(5, 8)))
    assert delay is True  # the blocks stay until the worker has read them
    meta = sched.build_connector_meta(_empty_output())
    assert meta.saves == [SaveSpec("r", tuple(range(1, 33)), (5, 6))]
    assert sched.build_connector_meta(_empty_output()).saves == []
    sched.shutdown()


def _empty_output() -> Any:
    """A SchedulerOutput with no new requests (all build_connector_meta reads of it)."""
    return type("SchedulerOutput", (), {"scheduled_new_reqs": ()})()


def test_unsupported_configurations_are_refused_by_name(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="stores"):
        KvcConnector(vllm_config(model_dir, tmp_path, stores=[]), KVConnectorRole.SCHEDULER, kv_cache_config())
    config = vllm_config(model_dir, tmp_path)
    config.cache_config.cache_dtype = "fp8"
    with pytest.raises(UnsupportedModelError, match="fp8"):
        KvcConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    w = KvcConnector(vllm_config(model_dir, tmp_path), KVConnectorRole.WORKER, kv_cache_config())
    # K and V in separate tensors' worth of shape ([blocks, block size, heads, head dim]): refused.
    wrong = {
        name: torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float16)
        for name in kv_caches(False)
    }
    with pytest.raises(UnsupportedModelError, match="shaped"):
        w.register_kv_caches(wrong)
    w.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llm_generates_the_same_tokens_with_the_connector(model_dir: Path, tmp_path: Path) -> None:
    from vllm import LLM

    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(0).integers(1, 500, 300)]}
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    plain = LLM(
        model=str(model_dir),
        dtype="float16",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
    )
    want = plain.generate([prompt], greedy)[0].outputs[0].token_ids
    del plain
    kv = vllm_config(model_dir, tmp_path).kv_transfer_config
    for _ in range(2):  # the first run saves, the second restores
        llm = LLM(
            model=str(model_dir),
            dtype="float16",
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.3,
            kv_transfer_config=kv,
        )
        assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == want
        del llm
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    assert int(cat.stats("vllm")["chunks"]) > 0  # the first run saved the prompt's blocks
    cat.close()


def test_the_connector_works_through_a_kvc_service(model_dir: Path, tmp_path: Path) -> None:
    """The catalog behind `kvc serve`: workers save and the real Scheduler finds hits over HTTP."""
    token = "vllm-connector-test-token"
    local = Catalog.open(f"sqlite:///{tmp_path / 'served.db'}", upgrade=True)
    app = create_app(local, {"vllm": hash_token(token)}, max_prompt_tokens=4096)
    with serve_in_thread(app) as url:
        config = vllm_config(model_dir, tmp_path, catalog=url, token=token)
        w = worker(config, kv_caches(fill=True))
        assert isinstance(w.catalog, RemoteCatalog)
        stored = list(range(1, 129))
        save(w, stored, list(range(0, 8)))
        w.shutdown()
        sched = make_scheduler(config)
        sched.add_request(request("hit", [*stored, 5, 6]))
        meta = sched.schedule().kv_connector_metadata
        assert isinstance(meta, KvcConnectorMetadata)
        assert [(load.req_id, load.start, load.end) for load in meta.loads] == [("hit", 0, 128)]
        sched.shutdown()  # the scheduler's connector closes its HTTP client
    assert local.lookup("vllm", w.fingerprint.hex, [*stored, 5]).matched_tokens == 128
    local.close()


def test_a_kvc_service_without_a_token_is_refused(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVC_SERVICE_TOKEN", raising=False)
    config = vllm_config(model_dir, tmp_path, catalog="http://127.0.0.1:9")
    with pytest.raises(CatalogInputError, match="bearer token"):
        KvcConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_the_catalog_comes_back_from_the_store_alone_names_included(
    model_dir: Path, tmp_path: Path
) -> None:
    """The connector journals by default: a pin and refs made through its catalog, a deleted
    ref, then the catalog lost, `kvc rebuild --from` the store, and a new connector loads."""
    config = vllm_config(model_dir, tmp_path)
    src = kv_caches(fill=True)
    tokens = list(range(1, 161))
    w = worker(config, src)
    save(w, tokens, list(range(3, 13)))
    head = w.catalog.lookup("vllm", w.fingerprint.hex, [*tokens, 0], shard=w.shard).chunks[-1]
    w.catalog.create_ref("vllm", "chat", w.fingerprint, head.prefix_hash)
    w.catalog.create_ref("vllm", "draft", w.fingerprint, head.prefix_hash)
    w.catalog.delete_ref("vllm", "draft")
    w.catalog.pin("vllm", "system", head.prefix_hash)
    w.shutdown()
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    before = names(url, "vllm")
    assert set(before[0]) == {"chat"} and set(before[1]) == {"system"}
    lose_catalog(url)
    assert kvc_rebuild(url, [f"file://{tmp_path / 'blobs'}"])["complete"]
    assert names(url, "vllm") == before
    dst = kv_caches(fill=False)
    r = worker(config, dst)
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(range(40, 50)), 0, 160))
    assert r.get_block_ids_with_load_errors() == set()
    for a, b in zip(positions(src, list(range(3, 13)), 160), positions(dst, list(range(40, 50)), 160), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    r.shutdown()


def test_the_second_store_gets_a_write_behind_copy(
    model_dir: Path, tmp_path: Path, s3_url: str
) -> None:
    """docs/engines.md's [file, s3] configuration: every save reaches the object store too,
    catalogued as a replica there once its receipt is in."""
    config = vllm_config(model_dir, tmp_path, stores=[f"file://{tmp_path / 'blobs'}", s3_url])
    w = worker(config, kv_caches(fill=True))
    save(w, list(range(1, 161)), list(range(3, 13)))
    keys = [c.blob_key for c in w.catalog.lookup("vllm", w.fingerprint.hex, [*range(1, 161), 0], shard=w.shard).chunks]
    w.shutdown()
    s3 = open_store(s3_url)
    try:
        assert len(keys) == 3 and all(s3.exists(k) for k in keys)
        with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
            assert set(cat.replicas_at(s3.name, namespace="vllm")) >= set(keys)
    finally:
        s3.close()


def drive(
    sched: Scheduler,
    w: KvcConnector,
    *,
    until: Any,
    on_step: Any = None,
    deadline_s: float = 20.0,
) -> list[Any]:
    """vLLM's engine loop with a CPU model runner that samples token 1: each step the scheduler
    schedules, the worker side runs the step's loads and saves, and the runner's output carries
    what the worker reports (saves copied out, loads received, blocks that failed to load)
    back to the scheduler, as vLLM's model runner mixin does.
    Returns the scheduler outputs, until `until()` holds."""
    outs = []
    stop = time.monotonic() + deadline_s
    while not until():
        assert time.monotonic() < stop, {r: (q.status, q.num_computed_tokens) for r, q in sched.requests.items()}
        out = sched.schedule()
        outs.append(out)
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvcConnectorMetadata)
        run_step(w, meta)
        if on_step is not None:
            on_step(out)
        sending, received = w.get_finished(set())
        output = runner_output(list(out.num_scheduled_tokens), token=1)
        output.kv_connector_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=received,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
        )
        sched.update_from_output(out, output)
    return outs


def test_requests_vllm_keys_on_more_than_token_ids_are_never_loaded_nor_saved(
    model_dir: Path, tmp_path: Path
) -> None:
    """A LoRA adapter, an image at its placeholders or a cache salt make vLLM's own block hashes
    differ for the same token ids: kvc offers them nothing and saves nothing, and counts why."""
    config = vllm_config(model_dir, tmp_path)
    src = worker(config, kv_caches(fill=True))
    stored = list(range(1, 129))
    save(src, stored, list(range(0, 8)))
    src.shutdown()

    prompt = [*stored, *range(300, 340)]  # 168 tokens: 128 stored, 160 in whole blocks
    image = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="image-a",
        mm_position=PlaceholderRange(offset=16, length=32),
    )
    sched = make_scheduler(config)
    w = worker(config, kv_caches(fill=False))
    sched.add_request(request("plain", prompt))
    sched.add_request(request("lora", prompt, lora_request=LoRARequest("adapter", 1, "/adapters/a")))
    sched.add_request(request("salted", prompt, cache_salt="tenant-a"))
    sched.add_request(request("image", prompt, mm_features=[image]))
    loads: list[LoadSpec] = []
    saves: list[SaveSpec] = []

    def record(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        saves.extend(out.kv_connector_metadata.saves)

    # A text-only model has no encoder to run the image: vLLM computes up to its placeholder,
    # and the request ends aborted (request_finished all the same).
    drive(sched, w, until=lambda: set(sched.requests) == {"image"}, on_step=record)
    sched.finish_requests("image", RequestStatus.FINISHED_ABORTED)
    drive(sched, w, until=lambda: not sched.has_requests(), on_step=record)
    assert [(load.req_id, load.start, load.end) for load in loads] == [("plain", 0, 128)]
    assert [(s.req_id, len(s.token_ids)) for s in saves] == [("plain", 160)]
    connector = sched.get_kv_connector()
    assert isinstance(connector, KvcConnector)
    assert connector.skipped == {"lora": 1, "cache_salt": 1, "multimodal": 1}
    assert connector._skipping == set()  # forgotten once finished
    sched.shutdown()
    w.shutdown()


def test_a_request_with_prompt_embeds_is_skipped(model_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(model_dir, tmp_path)
    c = KvcConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    params = SamplingParams(max_tokens=4)
    req = Request("embeds", None, params, None, prompt_embeds=torch.zeros(40, 64))
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    req.num_computed_tokens = 40
    assert c.request_finished(req, [1, 2, 3]) == (False, None)
    assert c.skipped == {"prompt_embeds": 1}
    c.shutdown()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_preempted_request_gets_its_load_again_when_resumed(
    model_dir: Path, tmp_path: Path, runner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM preempts a request that loaded a prefix (its blocks freed and reused), then resumes
    it: for the V1 model runner through `scheduled_cached_reqs` (`resumed_req_ids`), for V2 as a
    new request. Either way the load is in that step's metadata, into the blocks it holds now,
    and the prefix is in them."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0" if runner == "v1" else "1")
    # Synchronous loads: the load is in the step that schedules the resumed request.
    config = vllm_config(model_dir, tmp_path, load_async=False)
    src_caches = kv_caches(fill=True)
    src = worker(config, src_caches)
    stored = list(range(1, 129))  # 8 blocks
    save(src, stored, list(range(0, 8)))
    src.shutdown()

    config.cache_config.enable_prefix_caching = False  # a resume finds nothing in vLLM's own cache
    sched = make_scheduler(config, num_blocks=20)  # 19 usable: two 9-block prompts, then too few
    assert sched.use_v2_model_runner == (runner == "v2")
    caches = kv_caches(fill=False)
    w = worker(config, caches)
    sched.add_request(request("other", [400 + i for i in range(144)]))
    sched.add_request(request("hit", [*stored, *range(300, 316)]))  # 144 tokens
    loads: list[tuple[str, LoadSpec]] = []

    def record(out: Any) -> None:
        meta = out.kv_connector_metadata
        for load in meta.loads:
            resumed = load.req_id in out.scheduled_cached_reqs.resumed_req_ids
            loads.append(("resumed" if resumed else "new", load))
            if resumed:
                i = out.scheduled_cached_reqs.req_ids.index(load.req_id)
                assert list(load.block_ids) == list(out.scheduled_cached_reqs.new_block_ids[i][0])
        if sched.requests.get("hit") is not None and sched.requests["hit"].status == RequestStatus.PREEMPTED:
            for t in caches.values():
                t.zero_()  # its blocks are free: whatever was in them is gone

    drive(sched, w, until=lambda: not sched.has_requests(), on_step=record)
    assert sched.requests.get("hit") is None
    assert [(kind, load.req_id, load.start, load.end) for kind, load in loads] == [
        ("new", "hit", 0, 128),
        ("resumed" if runner == "v1" else "new", "hit", 0, 128),
    ]
    resumed = loads[1][1]
    got = positions(caches, list(resumed.block_ids), 128)
    want = positions(src_caches, list(range(0, 8)), 128)
    for g, w_ in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int16), w_.view(torch.int16))
    sched.shutdown()
    w.shutdown()


def corrupt_third_chunk(tmp_path: Path, fingerprint: str, tokens: list[int]) -> None:
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        third = cat.lookup("vllm", fingerprint, [*tokens, 7]).chunks[2]
    blob = open_store(f"file://{tmp_path / 'blobs'}").path_of(third.blob_key)  # type: ignore[attr-defined]
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_corrupt_chunk_is_recomputed_by_vllm_and_the_request_finishes(
    model_dir: Path, tmp_path: Path, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With docs/engines.md's configuration (`kv_load_failure_policy="recompute"`) vLLM's
    scheduler recomputes the blocks of a corrupt chunk and the request finishes; vLLM's default
    ("fail") would fail it, and the connector says so when it starts."""
    config = vllm_config(model_dir, tmp_path, policy=policy)
    src = worker(config, kv_caches(fill=True))
    stored = list(range(1, 257))  # 4 kvc chunks of 64
    save(src, stored, list(range(0, 16)))
    src.shutdown()
    corrupt_third_chunk(tmp_path, src.fingerprint.hex, stored)

    with caplog.at_level(logging.WARNING, logger="restore.engines.vllm"):
        sched = make_scheduler(config)
    warned = [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert bool(warned) == (policy == "fail")
    w = worker(config, kv_caches(fill=False))
    req = request("hit", [*stored, 5, 6])
    sched.add_request(req)
    outs = drive(sched, w, until=lambda: not sched.has_requests())
    assert [(load.start, load.end) for load in outs[0].kv_connector_metadata.loads] == [(0, 256)]
    if policy == "recompute":
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert req.num_output_tokens == 4
        # once the load was received, vLLM recomputed from the last verified position
        # (chunks 1 and 2: 128)
        first = next(o for o in outs if "hit" in o.num_scheduled_tokens)
        assert first.num_scheduled_tokens["hit"] == len(req.prompt_token_ids or []) - 128
    else:
        assert req.status == RequestStatus.FINISHED_ERROR
    sched.shutdown()
    w.shutdown()


def test_a_kv_cache_other_than_full_attention_is_refused_by_name(model_dir: Path, tmp_path: Path) -> None:
    """A model whose layers are all sliding-window is one KV cache group: refused all the same."""
    names_ = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float16, sliding_window=64
    )
    sliding = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names_, spec)]
    )
    with pytest.raises(UnsupportedModelError, match="SlidingWindowSpec"):
        KvcConnector(vllm_config(model_dir, tmp_path), KVConnectorRole.SCHEDULER, sliding)


def test_vllm_does_not_treat_kvc_saves_as_deliveries(model_dir: Path, tmp_path: Path) -> None:
    """A best-effort cache: vLLM need not recompute a preempted request to deliver its save."""
    sched = make_scheduler(vllm_config(model_dir, tmp_path))
    assert sched.requires_kv_delivery is False
    sched.shutdown()


# ---- asynchronous loads, staged saves, aborts ------------------------------------------------


class Held(Delegating):
    """A store whose gets and puts wait until released (`gets`, `puts`: set = open), whose gets
    fail as if it were unreachable while `down`, and which counts the gets that started."""

    def __init__(self, inner: ChunkStore) -> None:
        super().__init__(inner)
        self.gets = threading.Event()
        self.gets.set()
        self.puts = threading.Event()
        self.puts.set()
        self.down = False
        self.gets_started = 0
        self.fail_puts_after: int | None = None
        self.puts_done = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        self.gets_started += 1
        if self.down:
            raise StoreUnavailableError(f"{self.name}: connection refused")
        assert self.gets.wait(30), "the test never released the store's gets"
        return self.inner.get(key)

    def put(self, key: str, data: Any) -> Receipt:
        assert self.puts.wait(30), "the test never released the store's puts"
        with self._lock:
            if self.fail_puts_after is not None and self.puts_done >= self.fail_puts_after:
                raise StoreUnavailableError(f"{self.name}: connection reset during a put")
            self.puts_done += 1
        return self.inner.put(key, data)


def hold_store(w: KvcConnector) -> Held:
    """Put a `Held` wrapper between the worker's restore and checkpoint and its one store."""
    assert w.restorer is not None and w.checkpointer is not None
    [(name, store)] = w.restorer.stores.items()
    held = Held(store)
    w.restorer.stores[name] = held
    w.checkpointer.store = held
    return held


def wait_until(condition: Any, what: str, deadline_s: float = 20.0) -> None:
    stop = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < stop, what
        time.sleep(0.001)


def test_a_slow_load_does_not_hold_back_the_other_requests(model_dir: Path, tmp_path: Path) -> None:
    """While a load waits on its store, vLLM keeps stepping the request already running (40
    steps here: the load stays blocked until the test releases it); the loading request is
    not scheduled until the worker reports it received, then only its uncached tail is
    computed, on top of the stored KV, bit for bit."""
    config = vllm_config(model_dir, tmp_path)
    src_caches = kv_caches(fill=True)
    src = worker(config, src_caches)
    stored = list(range(1, 129))  # 8 blocks, 2 chunks of 64
    save(src, stored, list(range(0, 8)))
    src.shutdown()

    sched = make_scheduler(config)
    caches = kv_caches(fill=False)
    w = worker(config, caches)
    held = hold_store(w)
    held.gets.clear()
    sched.add_request(request("other", [400 + i for i in range(40)], max_tokens=600))
    drive(sched, w, until=lambda: sched.requests["other"].num_output_tokens > 0)
    sched.add_request(request("hit", [*stored, 300, 301, 302]))
    other_steps = 0
    hit_steps: list[Any] = []

    def count(out: Any) -> None:
        nonlocal other_steps
        other_steps += "other" in out.num_scheduled_tokens
        if "hit" in out.num_scheduled_tokens:
            hit_steps.append(out)

    # Every step from the arrival of "hit" on is a step during its load: the load cannot end
    # before the test opens the store.
    drive(sched, w, until=lambda: other_steps >= 40 and held.gets_started > 0, on_step=count)
    assert sched.requests["hit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert hit_steps == []
    held.gets.set()
    drive(sched, w, until=lambda: bool(hit_steps), on_step=count)
    assert hit_steps[0].num_scheduled_tokens["hit"] == 3  # 128 positions loaded
    new = {q.req_id: q for q in hit_steps[0].scheduled_new_reqs}
    blocks = list(new["hit"].block_ids[0][:8])
    for got, want in zip(positions(caches, blocks, 128), positions(src_caches, list(range(8)), 128), strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    sched.finish_requests("other", RequestStatus.FINISHED_ABORTED)
    drive(sched, w, until=lambda: not sched.has_requests())
    sched.shutdown()
    w.shutdown()


@pytest.mark.parametrize("fault", ["collected", "store_down"])
def test_a_load_that_fails_is_recomputed_and_never_offered_again(
    model_dir: Path, tmp_path: Path, fault: str
) -> None:
    """A chunk deleted (collected) between the scheduler's lookup and the worker's load, or a
    store that is down: the blocks that could not be loaded are reported with the request's
    completion, vLLM recomputes them (`kv_load_failure_policy="recompute"`) and the request
    finishes. A load that lost its first block leaves vLLM nothing computed: the request is
    looked up again and not offered the same hit."""
    config = vllm_config(model_dir, tmp_path)
    src = worker(config, kv_caches(fill=True))
    stored = list(range(1, 257))  # 4 kvc chunks of 64
    save(src, stored, list(range(0, 16)))
    src.shutdown()
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        chunks = cat.lookup("vllm", src.fingerprint.hex, [*stored, 7]).chunks

    sched = make_scheduler(config)
    w = worker(config, kv_caches(fill=False))
    held = hold_store(w)
    req = request("hit", [*stored, 5, 6])
    sched.add_request(req)
    out = sched.schedule()  # the scheduler looked up and offered 256 positions
    assert [(load.start, load.end) for load in out.kv_connector_metadata.loads] == [(0, 256)]
    if fault == "collected":
        held.inner.delete(chunks[2].blob_key)
        verified = 128
    else:
        held.down = True
        verified = 0
    run_step(w, out.kv_connector_metadata)
    sched.update_from_output(out, runner_output([], token=1))
    outs = drive(sched, w, until=lambda: not sched.has_requests())
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_output_tokens == 4
    first = next(o for o in outs if "hit" in o.num_scheduled_tokens)
    assert first.num_scheduled_tokens["hit"] == len(stored) + 2 - verified
    assert [load for o in outs for load in o.kv_connector_metadata.loads] == []  # not offered again
    connector = sched.get_kv_connector()
    assert isinstance(connector, KvcConnector)
    assert connector._load_failed == set()  # forgotten once finished
    sched.shutdown()
    w.shutdown()


def test_an_abort_mid_load_releases_the_blocks_and_caches_nothing(model_dir: Path, tmp_path: Path) -> None:
    """vLLM aborts a request while its load waits on the store: the connector does not save it,
    the worker stops the load and reports it received, and vLLM frees every block without
    caching any (the half-written blocks never become a prefix-cache hit: the same prompt
    afterwards loads from kvc again, from position 0)."""
    config = vllm_config(model_dir, tmp_path)
    src = worker(config, kv_caches(fill=True))
    stored = list(range(1, 257))  # 4 chunks of 64
    save(src, stored, list(range(0, 16)))
    src.shutdown()

    sched = make_scheduler(config)
    pool = sched.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    w = worker(config, kv_caches(fill=False))
    held = hold_store(w)
    held.gets.clear()
    sched.add_request(request("hit", [*stored, 5, 6]))
    metas: list[KvcConnectorMetadata] = []
    drive(sched, w, until=lambda: held.gets_started > 0, on_step=lambda o: metas.append(o.kv_connector_metadata))
    assert pool.get_num_free_blocks() < free_at_start
    sched.finish_requests("hit", RequestStatus.FINISHED_ABORTED)
    assert "hit" in sched.requests  # its blocks wait for the load to stop
    held.gets.set()
    drive(sched, w, until=lambda: "hit" not in sched.requests, on_step=lambda o: metas.append(o.kv_connector_metadata))
    assert pool.get_num_free_blocks() == free_at_start
    assert [c for m in metas for c in m.cancels] == ["hit"]
    assert [s for m in metas for s in m.saves] == []
    stats = w.get_kv_connector_stats()
    assert stats is None or (stats.data["loads"], stats.data["load_errors"]) == (0, 0)

    sched.add_request(request("again", [*stored, 5, 6]))
    out = sched.schedule()
    # vLLM's own prefix cache held nothing of it (a local hit would start the load past 0).
    assert [(load.req_id, load.start, load.end) for load in out.kv_connector_metadata.loads] == [
        ("again", 0, 256)
    ]
    sched.shutdown()
    w.shutdown()


def test_a_finished_requests_blocks_are_released_before_its_publish(
    model_dir: Path, tmp_path: Path
) -> None:
    """The save copies the request's positions to host memory and reports the blocks free in
    the same step; the publish (here a store whose puts wait) finishes later, and only then
    does the catalog know the prefix."""
    config = vllm_config(model_dir, tmp_path)
    sched = make_scheduler(config)
    w = worker(config, kv_caches(fill=True))
    held = hold_store(w)
    held.puts.clear()
    prompt = list(range(1, 40))
    sched.add_request(request("r", prompt))
    saves: list[SaveSpec] = []
    drive(sched, w, until=lambda: "r" not in sched.requests, on_step=lambda o: saves.extend(o.kv_connector_metadata.saves))
    assert [(s.req_id, len(s.token_ids)) for s in saves] == [("r", 32)]
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        assert cat.lookup("vllm", w.fingerprint.hex, [*prompt, 1]).matched_tokens == 0
        assert held.puts_done == 0  # the publish is still waiting on its store
        held.puts.set()
        assert w.checkpointer is not None
        w.checkpointer.close()
        assert cat.lookup("vllm", w.fingerprint.hex, [*prompt, 1]).matched_tokens == 32
    sched.shutdown()
    w.shutdown()


def test_a_save_whose_publish_fails_midway_leaves_nothing_visible(model_dir: Path, tmp_path: Path) -> None:
    """The store fails after the first of a save's chunks: the blocks were released all the
    same, the catalog holds nothing of the save (the chunk put before the failure is an
    orphan, never catalogued), and the save counts as an error."""
    config = vllm_config(model_dir, tmp_path)
    w = worker(config, kv_caches(fill=True))
    held = hold_store(w)
    held.fail_puts_after = 1
    tokens = list(range(1, 257))  # 4 chunks of 64
    run_step(w, KvcConnectorMetadata(saves=[SaveSpec("r", tuple(tokens), tuple(range(16)))]))
    assert w.get_finished(set()) == ({"r"}, None)  # released before the publish ran
    assert w.checkpointer is not None
    w.checkpointer.close()
    assert held.puts_done == 1  # the other chunks' puts failed (or were not tried)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        assert cat.lookup("vllm", w.fingerprint.hex, [*tokens, 1]).matched_tokens == 0
    stats = w.get_kv_connector_stats()
    assert stats is not None and (stats.data["saves"], stats.data["save_errors"]) == (0, 1)
    w.shutdown()


# ---- CUDA: the connector's stream, ordered with vLLM's by events (not run without a GPU) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_cuda(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to("cuda") for name, t in caches.items()}


@pytest.mark.cuda
@cuda
def test_cuda_a_save_reads_what_the_forward_stream_wrote_before_it(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's stream writes the request's KV behind a long kernel; the save, handed over after
    it, copies on the connector's stream once the write is done (an event orders them): the
    saved KV is the written KV, and the blocks are released once the copy has landed."""
    config = vllm_config(model_dir, tmp_path)
    caches = on_cuda(kv_caches(fill=False))
    want = on_cuda(kv_caches(fill=True, seed=3))
    w = worker(config, caches)
    tokens = list(range(1, 129))
    torch.cuda._sleep(200_000_000)  # the forward stream is busy for a while
    for name, t in caches.items():
        t.copy_(want[name])  # ... then writes the KV the save must read
    run_step(w, KvcConnectorMetadata(saves=[SaveSpec("r", tuple(tokens), tuple(range(8)))]))
    wait_until(lambda: w.get_finished(set())[0] == {"r"}, "the save's blocks were never released")
    assert w.checkpointer is not None
    w.checkpointer.close()
    w.shutdown()
    dst = on_cuda(kv_caches(fill=False))
    r = worker(config, dst)
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(range(20, 28)), 0, 128))
    assert r.get_block_ids_with_load_errors() == set()
    torch.cuda.synchronize()
    for got, expected in zip(positions(dst, list(range(20, 28)), 128), positions(want, list(range(8)), 128), strict=True):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    r.shutdown()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("load_async", [True, False])
def test_cuda_a_load_lands_after_what_the_forward_stream_enqueued_before_it(
    model_dir: Path, tmp_path: Path, load_async: bool
) -> None:
    """vLLM's stream zeroes the destination blocks behind a long kernel, then the step hands
    the load over: the load's copies wait for the zeroing (an event on vLLM's stream), so the
    blocks end up holding the stored KV, not zeros. A synchronous load makes vLLM's stream
    wait for its copies before the forward."""
    config = vllm_config(model_dir, tmp_path, load_async=load_async)
    src_caches = kv_caches(fill=True)
    src = worker(config, src_caches)
    tokens = list(range(1, 129))
    save(src, tokens, list(range(8)))
    src.shutdown()
    dst = on_cuda(kv_caches(fill=True, seed=5))
    r = worker(config, dst)
    torch.cuda._sleep(200_000_000)
    for t in dst.values():
        t[20:28].zero_()  # vLLM zeroing newly allocated blocks, still queued
    load_now(r, LoadSpec("r1", (*tokens, 7), tuple(range(20, 28)), 0, 128, load_async))
    if not load_async:
        for t in dst.values():
            t[20:28].add_(0)  # the forward, on vLLM's stream, reads the loaded blocks
    torch.cuda.synchronize()
    for got, expected in zip(positions(dst, list(range(20, 28)), 128), positions(src_caches, list(range(8)), 128), strict=True):
        assert torch.equal(got.cpu().view(torch.int16), expected.view(torch.int16))
    r.shutdown()


def test_a_preempted_request_loads_again_asynchronously_into_the_blocks_it_holds_then(
    model_dir: Path, tmp_path: Path
) -> None:
    """With asynchronous loads, a request vLLM preempts after its load (its blocks freed and
    reused) is offered its prefix again when vLLM takes it back; the second load goes into
    the blocks vLLM allocated then (`update_state_after_alloc`), which are the blocks the
    resumed request computes on, and they hold the prefix."""
    config = vllm_config(model_dir, tmp_path)
    src_caches = kv_caches(fill=True)
    src = worker(config, src_caches)
    stored = list(range(1, 129))  # 8 blocks
    save(src, stored, list(range(0, 8)))
    src.shutdown()

    config.cache_config.enable_prefix_caching = False  # a resume finds nothing in vLLM's own cache
    sched = make_scheduler(config, num_blocks=20)  # 19 usable: both prompts, then too few
    caches = kv_caches(fill=False)
    w = worker(config, caches)
    for name, tail in (("a", range(300, 316)), ("b", range(500, 516))):
        sched.add_request(request(name, [*stored, *tail], max_tokens=40))
    loads: list[LoadSpec] = []
    computed_on: dict[str, list[list[int]]] = {"a": [], "b": []}  # blocks after each load
    preempted: set[str] = set()

    def record(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        for name, tables in computed_on.items():
            if name in out.num_scheduled_tokens and len(tables) < sum(
                load.req_id == name for load in loads
            ):
                tables.append(list(sched.kv_cache_manager.get_block_ids(name)[0]))
        for name in computed_on:
            req = sched.requests.get(name)
            if req is not None and req.status == RequestStatus.PREEMPTED:
                preempted.add(name)
                for t in caches.values():
                    t.zero_()  # its blocks are free: whatever was in them is gone

    drive(sched, w, until=lambda: not sched.has_requests(), on_step=record)
    [again] = preempted
    reloads = [load for load in loads if load.req_id == again]
    assert [(load.start, load.end, load.load_async) for load in reloads] == [(0, 128, True)] * 2
    assert list(reloads[1].block_ids) == computed_on[again][1][: len(reloads[1].block_ids)]
    for got, want in zip(
        positions(caches, list(reloads[1].block_ids), 128),
        positions(src_caches, list(range(0, 8)), 128),
        strict=True,
    ):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    sched.shutdown()
    w.shutdown()
