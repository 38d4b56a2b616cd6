"""An oracle engine around vLLM's real scheduler, for the kvc connector's integration tests.

`OracleEngine` is vLLM's engine loop on the CPU: vLLM's own `Scheduler` (or `AsyncScheduler`,
driven like vLLM's batch queue: step N+1 is scheduled and run before step N's output is in)
with its own KV cache manager, and per tensor-parallel rank an `OracleRank`: the kvc
connector's worker side over CPU tensors in vLLM's layout, called as vLLM's model runner calls
it (`gpu_model_runner.execute_model` and `KVConnectorModelRunnerMixin._get_kv_connector_output`
in vLLM 0.33): `handle_preemptions`, `bind_connector_metadata`, `start_load_kv` before the
forward when the step has synchronous loads and after it otherwise, `wait_for_layer_load` and
`save_kv_layer` around each layer, `wait_for_save`, `get_transfer_results`,
`get_block_ids_with_load_errors`, the stats, `clear_connector_metadata`; a step with nothing to
compute runs the same calls without a forward. vLLM's `KVOutputAggregator` merges the ranks'
outputs for `update_from_output`.

The forward is an oracle: the KV of position p is a deterministic function of everything that
identifies it (the token ids of positions 0..p, the LoRA adapter, the multimodal inputs at
their placeholders, the cache salt, p), and the sampled token of the function at the last
position. A forward reads its attention inputs: when a position before the ones it computes
does not hold exactly the oracle's KV (on any rank), what it writes is wrong too (poisoned),
as a real forward over wrong KV would be. A block vLLM frees (and does not keep in its prefix
cache) is overwritten before the next forward, as another request could. After every step, `check` asserts that every block
the scheduler counts as computed for a running request holds exactly the oracle's KV, on
every rank; a finished request's output tokens are the oracle's.

Run as a module (`python -m tests.restore.engines.vllm_oracle SPEC.json`) it serves one
engine in a fresh process: the requests of the spec run to completion, the connectors close
(their saves are published) and a JSON report goes to stdout.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pickle
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from restore.engines.vllm import KvcConnector, KvcConnectorMetadata
from tests.restore.engines.test_vllm import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    kv_cache_config,
    vllm_config,
)

LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
VOCAB = 500  # sampled tokens stay in the tiny model's vocabulary
EOS = 2  # never sampled: requests end at max_tokens
MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK
    return x ^ (x >> 31)


def _text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Identity:
    """What, besides token ids, makes vLLM's KV of a position what it is."""

    lora: str | None = None
    cache_salt: str | None = None
    # (identifier, first position, positions) of each multimodal input's placeholder
    mm: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, request: Request) -> Identity:
        return cls(
            lora=request.lora_request.lora_name if request.lora_request is not None else None,
            cache_salt=request.cache_salt,
            mm=tuple(
                (f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in request.mm_features or ()
            ),
        )

    def position_hashes(self, tokens: list[int]) -> list[int]:
        """One 64-bit hash per position: of every token up to it, the LoRA adapter, the salt,
        the multimodal inputs placed up to it, and the position."""
        h = _mix(_text_hash(f"lora={self.lora}|salt={self.cache_salt}"))
        images = {
            offset + i: _text_hash(f"{ident}#{i}")
            for ident, offset, length in self.mm
            for i in range(length)
        }
        out = []
        for p, token in enumerate(tokens):
            h = _mix(h ^ _mix((token << 20) ^ p ^ images.get(p, 0)))
            out.append(h)
        return out


def oracle_kv(hashes: list[int]) -> np.ndarray[Any, Any]:
    """The oracle's KV of positions with these hashes: `[positions, layers, 2, kv heads, head
    dim]` float16 (values k/256 - 2 for k < 1024: exact in float16)."""
    h = np.array(hashes, dtype=np.uint64)[:, None]
    idx = np.arange(LAYERS * 2 * KV_HEADS * HEAD_DIM, dtype=np.uint64)[None, :]
    v = (h ^ (idx * np.uint64(0x9E3779B97F4A7C15))) * np.uint64(0xBF58476D1CE4E5B9)
    v ^= v >> np.uint64(31)
    values = ((v >> np.uint64(40)) & np.uint64(0x3FF)).astype(np.float32) / 256 - 2
    return values.astype(np.float16).reshape(len(hashes), LAYERS, 2, KV_HEADS, HEAD_DIM)


def oracle_token(last_hash: int) -> int:
    """The token the oracle samples after a prefix whose last position hashes to this."""
    return 3 + _mix(last_hash ^ 0x5EED) % (VOCAB - 3)


def engine_config(
    model_dir: Path,
    tmp: Path,
    *,
    rank: int = 0,
    tp: int = 1,
    token_budget: int = 64,
    max_num_seqs: int = 4,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
    **extra: Any,
) -> VllmConfig:
    """docs/engines.md's connector configuration (test_vllm.vllm_config) with chunked prefill
    over a small token budget, as tensor-parallel rank `rank` of `tp` sees it."""
    base = vllm_config(model_dir, tmp, **extra)
    config = VllmConfig(
        model_config=base.model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=token_budget,
            max_model_len=1024,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=base.kv_transfer_config,
        device_config=base.device_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    config.parallel_config.rank = rank
    return config


@dataclass
class RunnerRequest:
    """What a model runner keeps of a request between steps (its persistent batch)."""

    tokens: list[int]
    blocks: list[int]
    identity: Identity
    prompt_len: int


class OracleRank:
    """One tensor-parallel rank: the connector's worker side over this rank's kv heads of
    vLLM's per-layer CPU tensors (`[blocks, kv heads, block size, 2 * head size]`)."""

    def __init__(self, config: VllmConfig, num_blocks: int, rank: int, tp: int) -> None:
        self.config = config
        self.heads = slice(rank * KV_HEADS // tp, (rank + 1) * KV_HEADS // tp)
        shape = (num_blocks, KV_HEADS // tp, BLOCK, 2 * HEAD_DIM)
        self.caches = {name: torch.zeros(shape, dtype=torch.float16) for name in LAYER_NAMES}
        self.connector = KvcConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
        self.connector.register_kv_caches(self.caches)

    def read(self, blocks: list[int], start: int, end: int) -> np.ndarray[Any, Any]:
        """Positions `[start, end)` held in `blocks`, as `[n, layers, 2, this rank's heads, head dim]`."""
        rows = []
        for name in LAYER_NAMES:
            t = self.caches[name]
            per_block = [
                t[b].permute(1, 0, 2) for b in blocks[: -(-end // BLOCK)]
            ]  # [block, heads, 2D]
            kv = torch.cat(per_block)[start:end]
            rows.append(kv.view(end - start, kv.shape[1], 2, HEAD_DIM).permute(0, 2, 1, 3))
        return torch.stack(rows, dim=1).numpy()

    def write_layer(
        self, name: str, blocks: list[int], start: int, kv: np.ndarray[Any, Any]
    ) -> None:
        """One layer's `[n, 2, all heads, head dim]` KV at positions `start..` into `blocks`."""
        t = self.caches[name]
        mine = torch.from_numpy(np.ascontiguousarray(kv[:, :, self.heads]))  # [n, 2, h, D]
        for i in range(kv.shape[0]):
            block, off = divmod(start + i, BLOCK)
            t[blocks[block], :, off] = mine[i].permute(1, 0, 2).reshape(-1, 2 * HEAD_DIM)

    def begin(self, out: SchedulerOutput, *, forward: bool) -> None:
        c = self.connector
        meta = out.kv_connector_metadata
        assert meta is not None
        c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        if forward and out.has_sync_kv_loads:
            c.start_load_kv(get_forward_context())

    def end(self, out: SchedulerOutput, *, forward: bool) -> KVConnectorOutput:
        c = self.connector
        if not (forward and out.has_sync_kv_loads):
            c.start_load_kv(get_forward_context())
        c.wait_for_save()
        results = c.get_transfer_results(out.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=c.get_block_ids_with_load_errors(),
            kv_connector_stats=c.get_kv_connector_stats(),
            kv_cache_events=c.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=c.build_connector_worker_meta(),
        )
        c.clear_connector_metadata()
        return output


@dataclass
class StepRecord:
    """What one engine step scheduled and what its connector metadata carried."""

    scheduled: dict[str, int]
    loads: list[tuple[str, int, int]]
    saves: list[tuple[str, int]]
    preempted: set[str]
    poisoned: set[str] = field(default_factory=set)


class OracleEngine:
    """vLLM's scheduler and an oracle model runner over `tp` ranks (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        tmp: Path,
        *,
        num_blocks: int = 64,
        tp: int = 1,
        async_scheduling: bool = False,
        **config: Any,
    ) -> None:
        self.configs = [
            engine_config(
                model_dir, tmp, rank=r, tp=tp, async_scheduling=async_scheduling, **config
            )
            for r in range(tp)
        ]
        sched_config = self.configs[0]
        sched_config.cache_config.num_gpu_blocks = num_blocks
        # vLLM's engine core hashes every request's blocks (a connector is configured).
        hash_fn = get_hash_fn_by_name(sched_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler: Scheduler = cls(
            vllm_config=sched_config,
            kv_cache_config=kv_cache_config(num_blocks),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(sched_config),
            block_size=BLOCK,
        )
        connector = self.scheduler.get_kv_connector()
        assert isinstance(connector, KvcConnector)
        self.connector: KvcConnector = connector
        self.ranks = [OracleRank(self.configs[r], num_blocks, r, tp) for r in range(tp)]
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.batch_queue: collections.deque[tuple[SchedulerOutput, ModelRunnerOutput]] = (
            collections.deque()
        )
        self.queue_size = 2 if async_scheduling else 1
        self.runner: dict[str, RunnerRequest] = {}
        self.steps: list[StepRecord] = []
        self.outputs: dict[str, list[int]] = {}  # finished request -> its output tokens
        self.finished: dict[str, RequestStatus] = {}
        self.checked_positions = 0
        self._requests: dict[str, Request] = {}
        self._scribbled: set[int] = set()  # free blocks overwritten since they were freed
        # Called with each step's scheduler output before the workers run it.
        self.on_scheduled: Callable[[SchedulerOutput], None] = lambda out: None

    # ---- the engine loop --------------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 4, **kwargs: Any) -> Request:
        """A request as vLLM's engine core builds it (with its block hasher; `lora_request`,
        `mm_features`, `cache_salt` as keyword arguments of `Request`), ending at `max_tokens`
        (the oracle never samples EOS), added to the scheduler."""
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        req = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
            **kwargs,
        )
        self._requests[req_id] = req
        self.scheduler.add_request(req)
        return req

    def step(self) -> StepRecord:
        """One engine step: schedule and run a batch; take in the oldest batch's output once
        the queue is full (at once for the synchronous scheduler), then `check`."""
        out = self.scheduler.schedule()
        self.on_scheduled(out)
        self._scribble_free_blocks()
        record = self._record(out)
        self.batch_queue.append((out, self._execute(out, record)))
        # Nothing new scheduled: the engine waits for every batch in flight.
        while self.batch_queue and (
            len(self.batch_queue) >= self.queue_size or not out.total_num_scheduled_tokens
        ):
            old, output = self.batch_queue.popleft()
            self.scheduler.update_from_output(old, output)
            self._collect_finished()
            self.check()
        self.steps.append(record)
        return record

    def run(self, until: Callable[[], bool] | None = None, max_steps: int = 5000) -> None:
        """Steps until `until()` holds (by default: no request left). A step with nothing
        scheduled sleeps a millisecond: background saves publish on their own threads."""
        done = until or (lambda: not self.scheduler.has_requests() and not self.batch_queue)
        for _ in range(max_steps):
            if done():
                return
            if not self.step().scheduled:
                time.sleep(0.001)
        raise AssertionError(
            f"not done after {max_steps} steps: "
            f"{ {r: (q.status, q.num_computed_tokens) for r, q in self.scheduler.requests.items()} }"
        )

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self._collect_finished()

    def close(self) -> None:
        """Shut the connectors down (the workers' saves are published first)."""
        for rank in self.ranks:
            rank.connector.shutdown()
        self.scheduler.shutdown()

    def _scribble_free_blocks(self) -> None:
        """Overwrite every block vLLM holds free and uncached (its prefix cache keeps the content
        of a freed block with a hash): another request may have written it by the time a
        request that let it go comes back, so nothing may rely on what it held."""
        for block in self.scheduler.kv_cache_manager.block_pool.blocks:
            if block.ref_cnt or block.is_null or block.block_hash is not None:
                self._scribbled.discard(block.block_id)
            elif block.block_id not in self._scribbled:
                self._scribbled.add(block.block_id)
                for rank in self.ranks:
                    for t in rank.caches.values():
                        t[block.block_id].fill_(-7.0)

    # ---- the model runner -------------------------------------------------------------------

    def _record(self, out: SchedulerOutput) -> StepRecord:
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvcConnectorMetadata)
        return StepRecord(
            scheduled=dict(out.num_scheduled_tokens),
            loads=[(load.req_id, load.start, load.end) for load in meta.loads],
            saves=[(save.req_id, len(save.token_ids)) for save in meta.saves],
            preempted=set(out.preempted_req_ids or ()),
        )

    def _update_states(self, out: SchedulerOutput) -> None:
        """The runner's persistent batch, as vLLM's `_update_states` keeps it."""
        for req_id in out.finished_req_ids | set(out.preempted_req_ids or ()):
            self.runner.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            tokens = (
                new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
            )
            req = self._requests[new.req_id]
            self.runner[new.req_id] = RunnerRequest(
                list(tokens or []), list(new.block_ids[0]), Identity.of(req), req.num_prompt_tokens
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            req = self._requests[req_id]
            if req_id in cached.resumed_req_ids:
                self.runner[req_id] = RunnerRequest(
                    list(cached.all_token_ids.get(req_id, req.all_token_ids)),
                    list(new_blocks[0]) if new_blocks is not None else [],
                    Identity.of(req),
                    req.num_prompt_tokens,
                )
                continue
            state = self.runner[req_id]
            # Tokens sampled by a step whose output vLLM discarded (a failed load) are dropped.
            del state.tokens[state.prompt_len + cached.num_output_tokens[i] :]
            if new_blocks is not None:
                state.blocks.extend(new_blocks[0])

    def _start(self, out: SchedulerOutput, req_id: str) -> int:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])

    def _execute(self, out: SchedulerOutput, record: StepRecord) -> ModelRunnerOutput:
        forward = out.total_num_scheduled_tokens > 0
        with set_forward_context(None, self.configs[0]):
            for rank in self.ranks:
                rank.begin(out, forward=forward)
            self._update_states(out)
            sampled = self._forward(out, record) if forward else {}
            kv_outputs = [rank.end(out, forward=forward) for rank in self.ranks]
        outputs: list[ModelRunnerOutput | None] = []
        req_ids = list(out.num_scheduled_tokens)
        for kv_output in kv_outputs:
            output = (
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                    kv_connector_output=kv_output,
                )
                if forward
                else ModelRunnerOutput.with_kv_conn_output_only(kv_output)
            )
            # Each worker's output reaches the executor serialized (the aggregator writes the
            # merged connector output into rank 0's, which must not be vLLM's shared empty one).
            outputs.append(pickle.loads(pickle.dumps(output)))
        merged = self.aggregator.aggregate(outputs)
        assert merged is not None
        return merged

    def _forward(self, out: SchedulerOutput, record: StepRecord) -> dict[str, list[int]]:
        """Each scheduled request computes its scheduled positions layer by layer; a request
        whose attention inputs (its earlier positions, on any rank) are not the oracle's KV
        writes poisoned KV and samples a wrong token."""
        work = []
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.runner[req_id]
            start = self._start(out, req_id)
            hashes = state.identity.position_hashes(state.tokens[: start + n])
            want = oracle_kv(hashes[:start])
            poisoned = (
                any(
                    not np.array_equal(
                        rank.read(state.blocks, 0, start).view(np.int16),
                        want[:, :, :, rank.heads].view(np.int16),
                    )
                    for rank in self.ranks
                )
                if start
                else False
            )
            kv = oracle_kv(hashes[start:])
            if poisoned:
                record.poisoned.add(req_id)
                kv = (kv.view(np.int16) ^ np.int16(0x0155)).view(np.float16)
            work.append((state, start, kv))
            if start + n >= len(state.tokens):  # not a partial prefill: a token is sampled
                token = oracle_token(hashes[-1]) if not poisoned else 1
                state.tokens.append(token)
                sampled[req_id] = [token]
        for layer, name in enumerate(LAYER_NAMES):
            for rank in self.ranks:
                rank.connector.wait_for_layer_load(name)
            for state, start, kv in work:
                for rank in self.ranks:
                    rank.write_layer(name, state.blocks, start, kv[:, layer])
            for rank in self.ranks:
                rank.connector.save_kv_layer(name, rank.caches[name], attn_metadata=object())
        return sampled

    # ---- the oracle's checks ----------------------------------------------------------------

    def _collect_finished(self) -> None:
        for req_id, req in self._requests.items():
            if req_id not in self.finished and req.is_finished():
                self.finished[req_id] = req.status
                self.outputs[req_id] = list(req.output_token_ids)

    def check(self) -> None:
        """Every block vLLM counts as computed for a running request holds the oracle's KV on
        every rank (positions whose token ids the scheduler knows), and every finished
        request's output tokens are the oracle's."""
        manager = self.scheduler.kv_cache_manager
        for req in self.scheduler.running:
            if req.status != RequestStatus.RUNNING:
                continue
            n = min(req.num_computed_tokens, req.num_tokens)
            if n == 0:
                continue
            (blocks,) = manager.get_block_ids(req.request_id)
            want = oracle_kv(Identity.of(req).position_hashes(list(req.all_token_ids[:n])))
            for r, rank in enumerate(self.ranks):
                got = rank.read(list(blocks), 0, n)
                bad = np.flatnonzero(
                    (got.view(np.int16) != want[:, :, :, rank.heads].view(np.int16))
                    .reshape(n, -1)
                    .any(axis=1)
                )
                assert bad.size == 0, (
                    f"step {len(self.steps)}: request {req.request_id} counts {n} positions computed "
                    f"but rank {r} holds wrong KV at positions {bad[:8].tolist()} "
                    f"(blocks {blocks[bad[0] // BLOCK]}...)"
                )
            self.checked_positions += n
        for req_id, tokens in self.outputs.items():
            req = self._requests[req_id]
            if self.finished[req_id] == RequestStatus.FINISHED_ABORTED:
                continue
            prompt = list(req.prompt_token_ids or [])
            hashes = Identity.of(req).position_hashes(prompt + tokens)
            want_tokens = [oracle_token(hashes[len(prompt) - 1 + i]) for i in range(len(tokens))]
            assert tokens == want_tokens, (
                f"request {req_id} generated {tokens}, the oracle {want_tokens}"
            )

    # ---- what the tests read ----------------------------------------------------------------

    def loads(self) -> list[tuple[str, int, int]]:
        return [load for s in self.steps for load in s.loads]

    def saves(self) -> list[tuple[str, int]]:
        return [save for s in self.steps for save in s.saves]

    def preempted(self) -> set[str]:
        return {r for s in self.steps for r in s.preempted}

    def report(self) -> dict[str, Any]:
        return {
            "loads": self.loads(),
            "saves": self.saves(),
            "preempted": sorted(self.preempted()),
            "finished": {r: s.name for r, s in self.finished.items()},
            "outputs": self.outputs,
            "steps": len(self.steps),
            "checked_positions": self.checked_positions,
            "fingerprint": self.connector.fingerprint.hex,
        }


def scheduled_steps(steps: Iterable[StepRecord], req_id: str) -> int:
    """How many of `steps` computed something for `req_id`."""
    return sum(1 for s in steps if s.scheduled.get(req_id))


def main(spec_path: str) -> None:
    """Serve one spec in this process: {"model_dir", "dir", "engine": {...OracleEngine
    keywords}, "requests": [{"id", "tokens", "max_tokens"}]}; the report to stdout."""
    spec = json.loads(Path(spec_path).read_text())
    engine = OracleEngine(Path(spec["model_dir"]), Path(spec["dir"]), **spec.get("engine", {}))
    for r in spec["requests"]:
        engine.add(r["id"], r["tokens"], max_tokens=r.get("max_tokens", 4))
    engine.run()
    engine.close()
    print(json.dumps(engine.report()))


if __name__ == "__main__":
    main(sys.argv[1])
