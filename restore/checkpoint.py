"""Checkpoint: capture a route's KV under a lease, encode, store, then record (the ordered publish)."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import blake3
import numpy as np

from catalog import Fingerprint, chain_root, prefix_hashes
from catalog.base import CatalogAPI
from catalog.errors import MissingParentError, NotFoundError, PurgeInProgressError
from catalog.identity import token_array
from catalog.models import ChunkRecord, Shard
from chunkstore import ChunkStore
from chunkstore.codecs import DEFAULT_CODEC
from chunkstore.record import ChunkHeader, RawRecord, encode_chunk
from restore.capture import Capture, CaptureQueue
from restore.cores import usable_cores
from restore.descriptors import store_descriptor
from restore.destination import KVSnapshot
from restore.encode import RecordBuffers, check_snapshot_finite, fill_payload
from restore.errors import RestoreError
from restore.journal import ensure_journal
from restore.pool import PagePool
from restore.write_behind import (
    DEFAULT_WRITE_BEHIND_BYTES,
    DEFAULT_WRITE_BEHIND_WAIT_S,
    WriteBehind,
    to_replica_receipt,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_RECORD_BUFFER_BYTES = 128 << 20  # idle record buffers kept for the next chunks


@dataclass
class CheckpointResult:
    """What one checkpoint did: chunks new and already catalogued, bytes stored, time per stage."""

    tokens: int
    chunks: int
    new_chunks: int
    skipped_chunks: int
    stored_bytes: int
    head: bytes | None
    seconds: dict[str, float] = field(default_factory=dict)
    purge_retries: int = 0  # times it waited for a GC purging chunks it relied on


@dataclass(frozen=True)
class _ChunkJob:
    """What every chunk of one publish shares."""

    snapshot: KVSnapshot
    tokens: np.ndarray[Any, Any]
    fingerprint: Fingerprint
    shard: Shard
    speculative: bool
    catalogued: Future[bool]
    hash_threads: int


def finish_record(
    rec: RawRecord, buf: bytearray, threads: int
) -> tuple[str, memoryview, ChunkHeader]:
    """Hash a filled record in place and write its header (a seam the crash tests park in)."""
    return rec.finish(buf, threads=threads)


class Checkpointer:
    """Publishes routes as durable chunks: bytes first (with receipts), catalog second.

    `store` is where bytes land first (usually a local directory); with
    `write_behind` (usually an object store) each new blob is also uploaded in
    the background and that replica is catalogued only after its receipt.
    Uploads not yet done hold at most `write_behind_bytes` of encoded chunks
    (one chunk larger than that is let through alone): past it, a speculative
    capture (`submit`) keeps its catalogued local replica but gets no
    object-store copy (counted in `dropped["write_behind_budget"]`, like a
    failed upload), and an explicit checkpoint waits up to
    `write_behind_wait_s` for room, then raises `CheckpointBusyError`.
    A worker that owns a slab of the model passes `shard`: its pool then holds
    only those layers and kv heads, and only that slab is published.

    `submit` and `submit_snapshot` hand captures to a `CaptureQueue`
    (restore/capture.py): at most `max_queue` at once, pinning at most
    `staging_bytes` of KV. `dropped` counts by reason what that queue and
    write-behind (restore/write_behind.py) did not do.

    Every store a blob goes to also gets the blob's fingerprint descriptor (the
    document `fingerprints/<hex>`, restore/descriptors.py), written before the
    first blob that names it, once per store and fingerprint: the store then
    describes itself and `rebuild` needs nothing else.

    New chunks are encoded and put `parallel` at a time (default: one per core),
    and the KV is copied once on the way: from the snapshot (pool pages, an
    engine's cache) straight into the payload of a record buffer, which is
    hashed and written (and uploaded) in place, then reused for later records
    (at most `record_buffer_bytes` of idle buffers are kept). The catalog still
    hears of the chunks only once all of them are durable.
    """

    def __init__(
        self,
        catalog: CatalogAPI,
        store: ChunkStore,
        namespace: str = "default",
        chunk_size: int = 256,
        write_behind: ChunkStore | None = None,
        *,
        shard: Shard | None = None,
        codec: str = DEFAULT_CODEC,
        max_queue: int = 8,
        staging_bytes: int = 512 << 20,
        actor: str | None = None,
        purge_wait_s: float = 60.0,
        write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
        write_behind_wait_s: float = DEFAULT_WRITE_BEHIND_WAIT_S,
        parallel: int | None = None,
        record_buffer_bytes: int = DEFAULT_RECORD_BUFFER_BYTES,
        journal: bool = True,
    ) -> None:
        if parallel is not None and (isinstance(parallel, bool) or parallel < 1):
            raise ValueError(f"parallel must be >= 1, got {parallel!r}")
        self.catalog = catalog
        self.purge_wait_s = purge_wait_s
        self.store = store
        self.namespace = namespace
        self.write_behind = write_behind
        self.shard = shard
        self.codec = codec
        self.actor = actor
        chain_root(namespace)  # validates the name
        self.chunk_size = catalog.ensure_namespace(namespace, chunk_size)
        if self.chunk_size != chunk_size:
            raise RestoreError(
                f"namespace {namespace!r} uses chunk size {self.chunk_size}, not {chunk_size}"
            )
        self._lock = threading.Lock()
        self._capture = CaptureQueue(
            self._publish_capture, max_queue=max_queue, staging_bytes=staging_bytes
        )
        self._wb = WriteBehind(
            write_behind,
            catalog,
            namespace=namespace,
            actor=actor,
            budget=write_behind_bytes,
            wait_s=write_behind_wait_s,
            describe=self._describe,
        )
        self._described: set[tuple[str, str]] = set()  # (store name, fingerprint hex) written
        self._parallel = parallel or usable_cores()
        self._workers: ThreadPoolExecutor | None = None
        self._buffers = RecordBuffers(record_buffer_bytes)
        self._closed = False
        if journal:  # the store alone must rebuild the catalog: names go there too
            ensure_journal(catalog, [s for s in (store, write_behind) if s is not None])

    # -- synchronous -----------------------------------------------------------

    def checkpoint(
        self,
        pool: PagePool,
        route: int,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint,
        name: str | None = None,
        pending: int | None = None,
    ) -> CheckpointResult:
        """Publish the first len(tokens) positions of `route` (their ids are `tokens`).

        Returns when every new chunk is durable in `store` and catalogued (and,
        with `name`, the ref points at the new head).
        """
        with pool.lease(route) as lease:
            result = self.checkpoint_snapshot(lease, tokens, fingerprint, name, pending)
        pool.mark_durable(route, result.tokens)  # eviction may now drop these positions
        return result

    def checkpoint_snapshot(
        self,
        snapshot: KVSnapshot,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint,
        name: str | None = None,
        pending: int | None = None,
    ) -> CheckpointResult:
        """Publish the first len(tokens) positions of any `KVSnapshot` (an engine's own cache)."""
        tok, shard = self._check(snapshot, tokens, fingerprint)
        return self._publish(snapshot, tok, fingerprint, shard, name, pending, speculative=False)

    def _check(
        self,
        snapshot: KVSnapshot,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint,
    ) -> tuple[np.ndarray[Any, Any], Shard]:
        if self._closed:
            raise RestoreError("this Checkpointer is closed")
        tok = token_array(tokens)
        full = fingerprint.layout
        shard = self.shard or Shard.full(full)
        shard.check_within(full)
        pl = snapshot.layout
        want = (
            shard.layer_hi - shard.layer_lo,
            shard.head_hi - shard.head_lo,
            full.head_dim,
            full.dtype,
        )
        got = (pl.num_layers, pl.num_kv_heads, pl.head_dim, pl.dtype)
        if want != got:
            raise RestoreError(
                f"KV layout (layers, kv heads, head dim, dtype) = {got} does not match "
                f"fingerprint {fingerprint.hex[:12]}'s shard {want}"
            )
        if snapshot.length < len(tok):
            raise RestoreError(
                f"the KV holds {snapshot.length} positions but {len(tok)} token ids were given"
            )
        return tok, shard

    def _publish(
        self,
        snapshot: KVSnapshot,
        tok: np.ndarray[Any, Any],
        fp: Fingerprint,
        shard: Shard,
        name: str | None,
        pending: int | None,
        *,
        speculative: bool,
    ) -> CheckpointResult:
        """Publish, and if a concurrent GC is purging (or has purged) a chunk this
        publish relies on, wait for it to finish and publish again from a new plan (the
        bytes GC deleted are put again), for up to `purge_wait_s` seconds."""
        deadline = time.monotonic() + self.purge_wait_s
        delay = 0.05
        retries = 0
        while True:
            try:
                result = self._publish_once(
                    snapshot, tok, fp, shard, name, pending, speculative=speculative
                )
                result.purge_retries = retries
                return result
            except (PurgeInProgressError, MissingParentError) as exc:
                # Either way the plan is stale: chunks it skipped are being (or were)
                # purged. Plan again: those are put and recorded anew.
                if time.monotonic() + delay > deadline:
                    raise
                log.info("checkpoint waits for GC (%s); retrying in %.2f s", exc, delay)
                time.sleep(delay)
                delay = min(1.0, delay * 2)
                retries += 1

    def _publish_once(
        self,
        snapshot: KVSnapshot,
        tok: np.ndarray[Any, Any],
        fp: Fingerprint,
        shard: Shard,
        name: str | None,
        pending: int | None,
        *,
        speculative: bool,
    ) -> CheckpointResult:
        t0 = time.perf_counter()
        seconds: dict[str, float] = {"capture": 0.0, "encode": 0.0, "store": 0.0}
        cs = self.chunk_size
        hashes = prefix_hashes(self.namespace, tok, cs)
        known = self.catalog.known_blob_keys(self.namespace, fp, hashes, shard)
        seconds["plan"] = time.perf_counter() - t0
        new = [(i, h) for i, h in enumerate(hashes) if h not in known]
        spans = {i: (i * cs, min(len(tok), (i + 1) * cs)) for i, _h in new}
        # Refuse NaN/Inf (pool memory gone bad) before storing anything: one scan of the
        # new chunks, in place (no copy), so a refused checkpoint leaves no bytes.
        t = time.perf_counter()
        dtype = fp.layout.dtype
        self._each(
            [functools.partial(check_snapshot_finite, snapshot, *spans[i], dtype) for i, _ in new]
        )
        seconds["scan"] = time.perf_counter() - t
        parents = [chain_root(self.namespace), *hashes[:-1]]
        catalogued: Future[bool] = Future()  # tells write-behind uploads when to record
        # Chunks in parallel, each on one core: blake3's own threads would only contend.
        hash_threads = 1 if min(len(new), self._parallel) > 1 else blake3.blake3.AUTO
        job = _ChunkJob(snapshot, tok, fp, shard, speculative, catalogued, hash_threads)
        try:
            if new:
                self._describe(self.store, fp)  # the descriptor before the first blob naming it
            done = self._each(
                [functools.partial(self._put_chunk, job, h, parents[i], *spans[i]) for i, h in new]
            )
            records = [record for record, _ in done]
            for _, timing in done:
                for stage, sec in timing.items():
                    seconds[stage] += sec
            t = time.perf_counter()
            if records:
                self.catalog.record_chunks(records, actor=self.actor)
        except BaseException:
            catalogued.set_result(False)
            raise
        catalogued.set_result(True)
        head = hashes[-1] if hashes else None
        if name is not None and head is not None:
            self._move_ref(name, fp, head, pending)
        seconds["catalog"] = time.perf_counter() - t
        seconds["total"] = time.perf_counter() - t0
        return CheckpointResult(
            tokens=len(tok),
            chunks=len(hashes),
            new_chunks=len(records),
            skipped_chunks=len(hashes) - len(records),
            stored_bytes=sum(r.stored_bytes for r in records),
            head=head,
            seconds=seconds,
        )

    def _each(self, tasks: list[Callable[[], _T]]) -> list[_T]:
        """Run `tasks` on the chunk workers; their results in order, or the first task's
        error (in task order) once no task is left running. After a failure, tasks not
        yet started are skipped: a failing disk gets no more writes than it must."""
        if len(tasks) <= 1 or self._parallel == 1:
            return [task() for task in tasks]
        with self._lock:
            if self._workers is None:
                self._workers = ThreadPoolExecutor(self._parallel, thread_name_prefix="kvc-chunk")
            workers = self._workers
        failed = threading.Event()

        def run(task: Callable[[], _T]) -> _T:
            if failed.is_set():
                raise _Skipped
            try:
                return task()
            except BaseException:
                failed.set()  # before this worker takes the next task
                raise

        futures = [workers.submit(run, task) for task in tasks]
        wait(futures)
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None and not isinstance(e, _Skipped)), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    def _put_chunk(
        self, job: _ChunkJob, h: bytes, parent: bytes, start: int, end: int
    ) -> tuple[ChunkRecord, dict[str, float]]:
        """Encode one new chunk and put it durably in `store`; hand it to write-behind."""
        timing: dict[str, float] = {}
        fp, shard = job.fingerprint, job.shard
        tokens = job.tokens[start:end].tolist()
        lay = job.snapshot.layout
        shape = (lay.num_layers, 2, end - start, lay.num_kv_heads, lay.head_dim)
        done: Callable[[], None] = _nothing
        t = time.perf_counter()
        identity: dict[str, Any] = {
            "fingerprint": fp.hex,
            "namespace": self.namespace,
            "prefix_hash": h,
            "parent_hash": parent,
            "token_start": start,
            "tokens": tokens,
            "dtype": fp.layout.dtype,
            "layers": (shard.layer_lo, shard.layer_hi),
            "kv_heads": (shard.head_lo, shard.head_hi),
        }
        if self.codec == "raw":
            # One copy of the KV: snapshot -> the record's payload, hashed and written in place.
            rec = RawRecord(**identity, shape=shape)
            buf = self._buffers.acquire(rec)
            done = functools.partial(self._buffers.release, buf)
            try:
                fill_payload(job.snapshot, rec.payload(buf), start, end)
                timing["capture"] = time.perf_counter() - t
                t = time.perf_counter()
                key, data, header = finish_record(rec, buf, job.hash_threads)
            except BaseException:
                done()
                raise
        else:
            kv = job.snapshot.read_kv(start, end)  # compressing makes its own copy anyway
            timing["capture"] = time.perf_counter() - t
            t = time.perf_counter()
            enc = encode_chunk(**identity, kv=kv, codec=self.codec)
            key, data, header = enc.key, memoryview(enc.data), enc.header
        timing["encode"] = time.perf_counter() - t
        # Room for the upload is taken before the local put, so an explicit
        # checkpoint refused for lack of it leaves no bytes of this chunk.
        try:
            upload = self.write_behind is not None and self._wb.admit(data.nbytes, job.speculative)
        except BaseException:
            done()
            raise
        t = time.perf_counter()
        try:
            receipt = self.store.put_hashed(key, data)  # hashed in this buffer just now
        except BaseException:
            if upload:
                self._wb.release(data.nbytes)
            done()
            raise
        timing["store"] = time.perf_counter() - t
        record = ChunkRecord(
            namespace=self.namespace,
            fingerprint=fp,
            prefix_hash=h,
            parent_hash=parent,
            token_start=start,
            tokens=tokens,
            shard=shard,
            blob_key=key,
            codec=header.codec,
            stored_bytes=data.nbytes,
            kv_bytes=math.prod(shape) * lay.numpy_dtype.itemsize,
            receipts=[to_replica_receipt(receipt, self.store.tier)],
        )
        if upload:
            self._wb.upload_later(key, data, fp, job.catalogued, done=done)
        else:
            done()
        return record, timing

    def _move_ref(self, name: str, fp: Fingerprint, head: bytes, pending: int | None) -> None:
        try:
            current = self.catalog.get_ref(self.namespace, name)
        except NotFoundError:
            self.catalog.create_ref(
                self.namespace, name, fp, head, pending_token=pending, actor=self.actor
            )
            return
        self.catalog.update_ref(
            self.namespace,
            name,
            expected_head=current.head_hash,
            new_head=head,
            pending_token=pending,
            actor=self.actor,
        )

    def _describe(self, store: ChunkStore, fp: Fingerprint) -> None:
        """Make sure `store` holds `fp`'s descriptor before a blob naming it is put there.

        Once per (store, fingerprint) for this checkpointer; a failure raises (the
        blob is then not put either), so no blob it writes lacks its descriptor.
        """
        ident = (store.name, fp.hex)
        with self._lock:
            if ident in self._described:
                return
        store_descriptor(store, fp)  # idempotent: concurrent writers are harmless
        with self._lock:
            self._described.add(ident)

    # -- write-behind ------------------------------------------------------------

    @property
    def write_behind_pending_bytes(self) -> int:
        """Encoded bytes of write-behind uploads admitted and not yet put (at most
        `write_behind_bytes`, or one chunk larger than that alone)."""
        return self._wb.pending_bytes

    @property
    def write_behind_bytes(self) -> int:
        """The write-behind budget: encoded bytes of uploads pending at once."""
        return self._wb.budget

    @write_behind_bytes.setter
    def write_behind_bytes(self, value: int) -> None:
        self._wb.budget = value

    @property
    def write_behind_wait_s(self) -> float:
        """How long an explicit checkpoint waits for room in the write-behind budget."""
        return self._wb.wait_s

    @write_behind_wait_s.setter
    def write_behind_wait_s(self, value: float) -> None:
        self._wb.wait_s = value

    # -- asynchronous ------------------------------------------------------------

    def submit(
        self,
        pool: PagePool,
        route: int,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint,
        name: str | None = None,
        pending: int | None = None,
        *,
        speculative: bool = True,
    ) -> Future[CheckpointResult] | None:
        """Queue a checkpoint without blocking the caller; the route may keep decoding.

        A lease pins the snapshot until it is copied out. When the queue or the
        staging byte budget is full, speculative work is dropped (counted in
        `dropped` by reason, returns None) and an explicit checkpoint
        (`speculative=False`) raises `CheckpointBusyError`.
        """
        lease = pool.lease(route)
        return self.submit_snapshot(
            lease, tokens, fingerprint, name, pending, speculative=speculative, release=lease.close
        )

    def submit_snapshot(
        self,
        snapshot: KVSnapshot,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint,
        name: str | None = None,
        pending: int | None = None,
        *,
        speculative: bool = True,
        release: Callable[[], None] | None = None,
    ) -> Future[CheckpointResult] | None:
        """`submit` for any `KVSnapshot`; `release` is called once the snapshot is no longer read
        (also when the work is dropped or refused)."""
        try:
            tok, _shard = self._check(snapshot, tokens, fingerprint)
        except BaseException:
            if release is not None:
                release()
            raise
        capture = Capture(snapshot, tok, fingerprint, name, pending, speculative)
        return self._capture.submit(capture, release or _nothing)

    def _publish_capture(self, c: Capture) -> CheckpointResult:
        """Publish a queued capture (on the capture queue's worker)."""
        shard = self.shard or Shard.full(c.fingerprint.layout)
        return self._publish(
            c.snapshot, c.tokens, c.fingerprint, shard, c.name, c.pending, speculative=c.speculative
        )

    @property
    def dropped(self) -> Counter[str]:
        """Work not done, by reason: speculative captures dropped by the capture queue
        (`queue_full`, `staging_budget`) and object-store copies not made by
        write-behind (`write_behind_budget`, `write_behind_failed`, ...). A copy."""
        dropped = self._capture.dropped
        dropped.update(self._wb.dropped)
        return dropped

    def close(self) -> None:
        """Drain queued checkpoints and write-behind uploads, then stop the workers."""
        if self._closed:
            return
        self._closed = True
        self._capture.close()
        self._wb.close()
        if self._workers is not None:
            self._workers.shutdown(wait=True)
        self._buffers.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing() -> None:
    return None


class _Skipped(Exception):
    """A chunk task not run because another one had failed."""
