"""vLLM: what the running requests do while a 32k-token prefix loads from S3, synchronous versus
asynchronous kvc loads (issue 27).

Usage (repository root, the venv with vLLM; SeaweedFS is started on loopback):

    python bench/bench_vllm_async_load.py [--tokens 32768] [--others 4] [--forward-ms 10] [--reps 2]

The driver: vLLM 0.33's real `Scheduler` (its KV cache manager, its calls into the connector)
with kvc's connector on both sides; the worker side works on CPU tensors in vLLM's layout
(`[blocks, kv heads, block size, 2 * head dim]` per layer) shaped like Qwen2-0.5B's KV
(24 layers, 2 kv heads, head dim 64, bfloat16: 12 KiB per token, 384 MiB for 32k tokens),
from a config-only model with random weights (nothing downloads). The model runner is a
stand-in that makes the connector's per-step calls in vLLM's order (vLLM's model-runner mixin:
`start_load_kv` before the forward when the step has a synchronous load, after its launch
otherwise; `wait_for_save`; `get_finished`; `get_block_ids_with_load_errors`), reports them
back like the mixin, and "runs the forward" by waiting `--forward-ms` (a GPU forward, during
which the host thread waits on the device; no real model runs). A step's time is the
scheduler, the connector and that wait.

The prefix is saved once into S3 (the connector's only store; catalog on SQLite). Each run:
`--others` requests are decoding; the 32k-token request arrives; the bench counts the steps
the others complete while its load runs (from the step that hands the load to the worker to
the one whose output reports it received; for a synchronous load, inside that one step), and
their step times over the window (median, the longest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from catalog.catalog import Catalog
from restore.engines.vllm import KvcConnector, KvcConnectorMetadata, SaveSpec

BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM = 24, 2, 64  # Qwen2-0.5B's KV
EOS = 2


def model_dir(root: Path, max_len: int) -> Path:
    """A config-only Llama with Qwen2-0.5B's KV shape and random weights (tiny otherwise)."""
    path = root / "model"
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def make_config(model: Path, root: Path, s3_url: str, max_len: int, load_async: bool) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="KvcConnector",
        kv_connector_module_path="restore.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "catalog": f"sqlite:///{root / 'catalog.db'}",
            "stores": [s3_url],
            "namespace": "bench",
            "load_async": load_async,
        },
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model),
            dtype="bfloat16",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=max_len,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def request(req_id: str, tokens: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id, prompt_token_ids=tokens, sampling_params=params, pooling_params=None
    )


def step(sched: Scheduler, w: KvcConnector, forward_s: float) -> tuple[Any, float, set[str]]:
    """One engine step: schedule, the worker's connector calls around the stand-in forward in
    vLLM's order, the output back to the scheduler. Returns (scheduler output, seconds,
    loads the worker reported received)."""
    t0 = time.perf_counter()
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvcConnectorMetadata)
    w.bind_connector_metadata(meta)
    if out.has_sync_kv_loads:
        w.start_load_kv(None)  # type: ignore[arg-type]
    if out.total_num_scheduled_tokens:
        time.sleep(forward_s)  # the forward: the host waits on the device
    if not out.has_sync_kv_loads:
        w.start_load_kv(None)  # type: ignore[arg-type]
    w.wait_for_save()
    sending, received = w.get_finished(out.finished_req_ids)
    invalid = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    req_ids = list(out.num_scheduled_tokens)
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[1] for _ in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=received, invalid_block_ids=invalid
            ),
        ),
    )
    return out, time.perf_counter() - t0, received or set()


def run(
    config: VllmConfig,
    caches: dict[str, torch.Tensor],
    num_blocks: int,
    prefix: list[int],
    others: int,
    forward_s: float,
) -> dict[str, float]:
    config.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    w = KvcConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
    w.register_kv_caches(caches)
    other_ids = [f"other-{i}" for i in range(others)]
    for i, req_id in enumerate(other_ids):
        sched.add_request(request(req_id, [400 + i] * 64, max_tokens=100_000))
    while not all(sched.requests[r].num_output_tokens > 2 for r in other_ids):
        step(sched, w, forward_s)
    idle = [step(sched, w, forward_s)[1] for _ in range(20)]  # decoding, no load
    sched.add_request(request("long", [*prefix, 7, 8, 9], max_tokens=1))
    load_started: float | None = None
    load_s = 0.0
    steps_during = 0
    step_times: list[float] = []
    while True:
        t = time.perf_counter()
        out, seconds, received = step(sched, w, forward_s)
        loads = out.kv_connector_metadata.loads
        if loads and loads[0].load_async:
            load_started = t
            step_times.append(seconds)  # the step that hands the load over
            continue
        if loads:  # synchronous: the load ran inside this step
            load_s = seconds
            step_times.append(seconds)
            break
        if load_started is not None:
            step_times.append(seconds)
            if "long" in received:
                load_s = time.perf_counter() - load_started
                break
            steps_during += 1
    stats = w.get_kv_connector_stats()
    assert stats is not None and stats.data["load_errors"] == 0, "the load failed"
    assert stats.data["loaded_tokens"] == len(prefix), stats.data
    sched.shutdown()
    w.shutdown()
    return {
        "load_s": load_s,
        "steps": steps_during,
        "idle_ms": statistics.median(idle) * 1e3,
        "median_ms": statistics.median(step_times) * 1e3,
        "p90_ms": sorted(step_times)[int(0.9 * (len(step_times) - 1))] * 1e3,
        "longest_at": max(range(len(step_times)), key=step_times.__getitem__),
        "max_ms": max(step_times) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--others", type=int, default=4)
    ap.add_argument("--forward-ms", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from tests.services import start_seaweedfs

    max_len = args.tokens + 1024
    num_blocks = (args.tokens + 1024) // BLOCK + args.others * 16
    prefix = torch.randint(
        3, 500, (args.tokens,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    with tempfile.TemporaryDirectory(prefix="kvc-bench-vllm-") as tmp, start_seaweedfs() as srv:
        root = Path(tmp)
        os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_key
        s3_url = f"s3://{srv.bucket}/bench?endpoint_url={srv.endpoint_url}&region={srv.region}"
        model = model_dir(root, max_len)
        Catalog.open(f"sqlite:///{root / 'catalog.db'}", upgrade=True).close()
        g = torch.Generator().manual_seed(0)
        shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.bfloat16)
            for i in range(LAYERS)
        }
        # Store the prefix once (S3 is the only store).
        config = make_config(model, root, s3_url, max_len, load_async=True)
        saver = KvcConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
        saver.register_kv_caches(caches)
        t = time.perf_counter()
        saver.bind_connector_metadata(
            KvcConnectorMetadata(
                saves=[SaveSpec("prefix", tuple(prefix), tuple(range(args.tokens // BLOCK)))]
            )
        )
        saver.wait_for_save()
        saver.clear_connector_metadata()
        saver.shutdown()
        mib = args.tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 2**20
        print(
            f"stored {args.tokens} tokens ({mib:.0f} MiB) in S3 in {time.perf_counter() - t:.1f} s"
        )
        rows: list[tuple[str, dict[str, float]]] = []
        for _ in range(args.reps):
            for load_async in (False, True):
                config = make_config(model, root, s3_url, max_len, load_async)
                result = run(config, caches, num_blocks, prefix, args.others, args.forward_ms / 1e3)
                rows.append(("asynchronous" if load_async else "synchronous", result))
                print(rows[-1], flush=True)
    print()
    print(
        f"{args.tokens}-token prefix from S3 (SeaweedFS, loopback), {args.others} requests decoding, "
        f"stand-in forward {args.forward_ms:g} ms"
    )
    print(
        f"{'load':<13} {'load s':>7} {'steps of the others during it':>30} "
        f"{'median step ms':>15} {'p90 step ms':>12} {'longest step ms (step #)':>25} "
        f"{'median step ms, no load':>24}"
    )
    for name, r in rows:
        print(
            f"{name:<13} {r['load_s']:7.2f} {r['steps']:30.0f} {r['median_ms']:15.1f} "
            f"{r['p90_ms']:12.1f} {r['max_ms']:19.1f} ({r['longest_at']:3.0f}) {r['idle_ms']:24.1f}"
        )


if __name__ == "__main__":
    main()
