"""Restore: find the longest stored prefix, fetch and verify its chunks, load them into pool pages."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from catalog import AttentionLayout, Fingerprint, fingerprint_hex
from catalog.base import CatalogAPI
from catalog.identity import token_array
from catalog.lru import LRU
from catalog.models import TIERS, ChunkMatch, Match, ReplicaInfo, ReplicaState, Shard, Tier
from chunkstore import ChunkStore
from chunkstore.errors import ChunkIntegrityError, ChunkLayoutError, ChunkStoreError
from chunkstore.record import ChunkHeader, DecodedChunk, decode_chunk
from restore.cores import usable_cores
from restore.destination import Destination, PoolDestination
from restore.errors import RestoreError
from restore.pool import PagePool

log = logging.getLogger(__name__)


@dataclass
class RestoreReport:
    """How a restore went: chunks and bytes per replica, failures, seconds per stage."""

    chunks: int = 0
    bytes: int = 0
    replicas_used: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    # Chunks fetched at once ("local": from local or resident replicas, "object": from
    # object stores), the calling thread's lane included; 0 where no chunk was.
    lanes: dict[str, int] = field(default_factory=dict)


@dataclass
class RestoreResult:
    """`restored_tokens` verified positions were restored; recompute from `recompute_from`.

    `route` is the pool route holding them (None on a miss, and for restores
    into another `Destination`).
    """

    route: int | None
    restored_tokens: int
    recompute_from: int
    prompt_tokens: int
    match: Match | None
    report: RestoreReport

    @property
    def hit(self) -> bool:
        return self.restored_tokens > 0


class _ChunkFailed(Exception):
    """No replica of a chunk could be fetched and verified."""


class Restorer:
    """Restores prefixes from the stores this worker can read (matched to replicas by store name).

    Every blob is verified on every tier: its digest equals its key, and its
    header (fingerprint, prefix, parent, token range and ids, shard, shape)
    matches what the catalog and the prompt say. Nothing unverified reaches a
    page, and a route becomes visible only when all its pages are loaded.
    """

    DEFAULT_PARALLEL = 4  # chunks fetched and verified at once from local and resident replicas
    DEFAULT_OBJECT_PARALLEL = 8  # from object-tier replicas (GETs that mostly wait)
    DEFAULT_HEADER_CACHE = 1024  # verified headers kept (about 10 KB each for 256 tokens)

    def __init__(
        self,
        catalog: CatalogAPI,
        stores: Iterable[ChunkStore],
        namespace: str = "default",
        *,
        shard: Shard | None = None,
        max_parallel: int = DEFAULT_PARALLEL,
        byte_budget: int = 256 << 20,
        actor: str | None = None,
        header_cache: int = DEFAULT_HEADER_CACHE,
        object_parallel: int = DEFAULT_OBJECT_PARALLEL,
    ) -> None:
        """`max_parallel` chunks whose best replica is local or resident are fetched and
        verified at once (reads and hashes that keep the cores busy; as many as the cores
        while those reads mostly hash and copy, see `_local_lanes`), `object_parallel`
        whose best replica is in an object store (GETs that mostly wait on the network),
        all within `byte_budget` stored bytes in flight. `header_cache`: how many verified
        chunk headers to keep, so a chunk restored again (a hot prefix) is hashed and
        copied but its header not parsed again; 0 keeps none."""
        for name, value in (("max_parallel", max_parallel), ("object_parallel", object_parallel)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.catalog = catalog
        self.stores = {s.name: s for s in stores}
        self.namespace = namespace
        self.shard = shard
        self.max_parallel = max_parallel
        self.byte_budget = byte_budget
        self.actor = actor
        self.object_parallel = object_parallel
        self._executor = ThreadPoolExecutor(
            max_workers=max_parallel, thread_name_prefix="kvc-restore"
        )
        self._object_executor = ThreadPoolExecutor(
            max_workers=object_parallel, thread_name_prefix="kvc-restore-object"
        )
        self._tier_rates: dict[str, float] = {}
        # Per tier, how busy a read keeps its core: see `_local_lanes`.
        self._tier_busy: dict[str, float] = {}
        self._cores = usable_cores()
        self._fingerprints: LRU[str, Fingerprint] = LRU(64)
        self._rate_lock = threading.Lock()
        # Headers of chunks verified before, by blob key (the key commits to every byte).
        self._headers: LRU[str, _KnownHeader] | None = (
            LRU(header_cache) if header_cache > 0 else None
        )

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._object_executor.shutdown(wait=True)

    def __enter__(self) -> Restorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tier_rates(self) -> dict[str, float]:
        """Measured fetch+verify bytes/s per tier (for the planner)."""
        with self._rate_lock:
            return dict(self._tier_rates)

    def restore(
        self,
        pool: PagePool,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint | str,
        shard: Shard | None = None,
        *,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        match: Match | None = None,
    ) -> RestoreResult:
        """Restore the longest verified stored prefix of `tokens` into a new route of `pool`.

        `match`: this lookup of `tokens` (a planner's), instead of looking them up again.
        """
        dest = PoolDestination(pool)
        result = self.restore_into(
            dest, tokens, fingerprint, shard, max_tokens=max_tokens, cancel=cancel, match=match
        )
        result.route = dest.route
        return result

    def restore_into(
        self,
        destination: Destination,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        fingerprint: Fingerprint | str,
        shard: Shard | None = None,
        *,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        match: Match | None = None,
    ) -> RestoreResult:
        """Restore the longest verified stored prefix of `tokens` into any `Destination`.

        The destination is committed with the number of verified positions, or
        aborted (on a miss, when nothing verified, or on any error). `match`:
        as for `restore`.
        """
        t0 = time.perf_counter()
        tok = token_array(tokens)
        fp_hex = fingerprint_hex(fingerprint)
        shard = shard or self.shard
        report = RestoreReport()
        if match is None:
            match = self.catalog.lookup(
                self.namespace, fp_hex, tok, shard=shard, max_tokens=max_tokens
            )
        report.seconds["lookup"] = time.perf_counter() - t0
        if not match.hit:
            return RestoreResult(None, 0, 0, len(tok), match, report)
        shard = match.shard
        assert shard is not None
        self._check_destination(destination.layout, shard)
        layout = self._expected_layout(fingerprint, fp_hex, destination.layout, shard)
        destination.reserve(match.matched_tokens)
        try:
            restored = self._load(destination, match, tok, fp_hex, shard, layout, report, cancel)
            if restored == 0:
                destination.abort()
            else:
                destination.commit(restored)
        except BaseException:
            destination.abort()
            raise
        report.seconds["total"] = time.perf_counter() - t0
        return RestoreResult(None, restored, restored, len(tok), match, report)

    def _check_destination(self, layout: AttentionLayout, shard: Shard) -> None:
        got = (layout.num_layers, layout.num_kv_heads)
        if got != (shard.layer_hi - shard.layer_lo, shard.head_hi - shard.head_lo):
            raise RestoreError(
                f"the destination holds {got[0]} layers x {got[1]} kv heads, "
                f"the shard to restore is {shard}"
            )

    def _expected_layout(
        self,
        fingerprint: Fingerprint | str,
        fp_hex: str,
        dest: AttentionLayout,
        shard: Shard,
    ) -> AttentionLayout:
        """The layout every blob of this restore must declare: the shard's part of the
        fingerprint's attention layout. It bounds what a blob may make us decode (a
        planted record declaring gigabytes is refused from its header), and a
        destination of another head dim or dtype is refused before anything is read."""
        fp = fingerprint if isinstance(fingerprint, Fingerprint) else None
        if fp is None:
            with self._rate_lock:
                fp = self._fingerprints.get(fp_hex)
            if fp is None:
                fp = self.catalog.get_fingerprint(fp_hex)
                if fp is not None:
                    with self._rate_lock:
                        self._fingerprints.put(fp_hex, fp)  # immutable: the hex commits to it
        if fp is None:  # not catalogued (a lookup hit says otherwise): the destination's
            return dest
        full = fp.layout
        if (full.head_dim, full.dtype) != (dest.head_dim, dest.dtype) or (
            shard.layer_hi > full.num_layers or shard.head_hi > full.num_kv_heads
        ):
            raise RestoreError(
                f"the destination holds head dim {dest.head_dim} {dest.dtype}, the "
                f"fingerprint's layout is {full} (shard {shard})"
            )
        return dest

    def _load(
        self,
        destination: Destination,
        match: Match,
        tok: np.ndarray[Any, Any],
        fp_hex: str,
        shard: Shard,
        layout: AttentionLayout,
        report: RestoreReport,
        cancel: threading.Event | None,
    ) -> int:
        """Fetch, verify and write chunks, several at once within the byte budget; return how
        many leading positions are loaded (every chunk before the first failure).

        Chunks are taken in order by lanes: up to `max_parallel` for chunks whose best
        replica is local or resident, `object_parallel` for object-store ones, and the
        calling thread is one of them (a restore of one chunk hands nothing to another
        thread; a small one waits on no thread but its own). Each chunk is written into
        the destination by the lane that verified it (the writes are disjoint, and the
        copy of one chunk overlaps the hashing of the next). After a chunk fails, no lane
        starts a later one; positions past it already written are dropped by `commit`.
        """
        chunks = match.chunks
        n = len(chunks)
        outcomes: list[tuple[str, float, float] | BaseException | None] = [None] * n
        # Chunks verified side by side keep the cores busy: each is hashed on its own thread.
        hash_threads = 1 if n > 1 and self.max_parallel > 1 else None
        queues: dict[bool, collections.deque[int]] = {
            False: collections.deque(),
            True: collections.deque(),
        }
        for i, c in enumerate(chunks):
            queues[self._from_object_tier(c)].append(i)
        turn = threading.Condition()
        in_flight = 0
        stop = n  # no chunk at or past this index is started

        def take(queue: collections.deque[int]) -> int | None:
            nonlocal in_flight
            with turn:
                while True:
                    if not queue or queue[0] >= stop or (cancel is not None and cancel.is_set()):
                        return None
                    size = chunks[queue[0]].stored_bytes
                    if not in_flight or in_flight + size <= self.byte_budget:
                        in_flight += size
                        return queue.popleft()
                    turn.wait()

        def lane(queue: collections.deque[int], lanes: int) -> None:
            nonlocal in_flight, stop
            while (i := take(queue)) is not None:
                c = chunks[i]
                try:
                    decoded, location, seconds = self._fetch_verified(
                        c, tok, fp_hex, shard, layout, report, hash_threads, lanes
                    )
                    t = time.perf_counter()
                    destination.write(decoded.kv, c.token_start, c.tokens_used)
                    outcomes[i] = (location, seconds, time.perf_counter() - t)
                except BaseException as exc:
                    outcomes[i] = exc
                    with turn:  # the longest verified prefix ends before this chunk
                        stop = min(stop, i)
                finally:
                    with turn:
                        in_flight -= c.stored_bytes
                        turn.notify_all()

        widths = {
            False: self._local_lanes(chunks[queues[False][0]]) if queues[False] else 0,
            True: self.object_parallel,
        }
        lanes = {obj: min(widths[obj], len(queue)) for obj, queue in queues.items()}
        report.lanes = {"local": lanes[False], "object": lanes[True]}
        # The calling thread runs a lane of the tier the first chunk is read from.
        mine = self._from_object_tier(chunks[0])
        helpers: list[Future[None]] = [
            (self._object_executor if obj else self._executor).submit(lane, queue, lanes[obj])
            for obj, queue in queues.items()
            for _ in range(lanes[obj] - (obj == mine))
        ]
        try:
            lane(queues[mine], lanes[mine])
        except BaseException:
            with turn:
                stop = -1  # the caller is leaving (interrupted): start nothing more
                turn.notify_all()
            raise
        finally:
            wait(helpers)  # no thread writes into the destination after this
        if cancel is not None and cancel.is_set():
            raise RestoreError("restore cancelled")
        restored = 0
        fetch_s = copy_s = 0.0
        try:
            for c, outcome in zip(chunks, outcomes, strict=True):
                if outcome is None or isinstance(outcome, _ChunkFailed):
                    break  # the longest verified prefix ends before this chunk
                if isinstance(outcome, BaseException):
                    raise outcome
                location, seconds, copied = outcome
                fetch_s += seconds
                copy_s += copied
                restored = c.token_start + c.tokens_used
                report.chunks += 1
                report.bytes += c.stored_bytes
                report.replicas_used[location] = report.replicas_used.get(location, 0) + 1
        finally:
            # A failed chunk's exception holds its lane's frame, which holds this list: a
            # cycle that kept the destination (a restored cache's memory) until the next
            # garbage collection.
            outcomes.clear()
        report.seconds["fetch+verify"] = fetch_s
        report.seconds["copy"] = copy_s
        return restored

    def _from_object_tier(self, c: ChunkMatch) -> bool:
        """Whether the replica a chunk is read from first is in an object store."""
        order = self._replica_order(c)
        return bool(order) and order[0][0].tier == "object"

    def readable_prefix(self, match: Match) -> tuple[int, int, Tier | None]:
        """What a restore of `match` can fetch before verifying anything: `(tokens, stored
        bytes, slowest tier)` of its leading chunks that have a replica in a store this
        restorer reads (the tier of the replica it would try first), for a planner."""
        tokens = nbytes = 0
        slowest: Tier | None = None
        for c in match.chunks:
            order = self._replica_order(c)
            if not order:
                break
            tier = order[0][0].tier
            if slowest is None or TIERS.index(tier) > TIERS.index(slowest):
                slowest = tier
            tokens = c.token_start + c.tokens_used
            nbytes += c.stored_bytes
        return tokens, nbytes, slowest

    def _replica_order(self, c: ChunkMatch) -> list[tuple[ReplicaInfo, ChunkStore]]:
        return [(r, self.stores[r.location]) for r in c.replicas if r.location in self.stores]

    def _fetch_verified(
        self,
        c: ChunkMatch,
        tok: np.ndarray[Any, Any],
        fp_hex: str,
        shard: Shard,
        layout: AttentionLayout,
        report: RestoreReport,
        hash_threads: int | None,
        lanes: int,
    ) -> tuple[DecodedChunk, str, float]:
        """Read and verify `c` from its best readable replica; its location, and the seconds
        the read and verify took. `lanes`: how many chunks of its tier are read at once."""
        candidates = self._replica_order(c)
        if not candidates:
            report.failures.append(f"{c.blob_key[:16]}: no replica in a store this worker can read")
            raise _ChunkFailed(c.blob_key)
        for replica, store in candidates:
            t = time.perf_counter()
            cpu = time.thread_time()
            try:
                decoded = self._read_verified(store, c, tok, fp_hex, shard, layout, hash_threads)
            except FileNotFoundError as exc:
                self._mark(c, replica, "missing", str(exc), report)
                continue
            except ChunkStoreError as exc:
                if isinstance(exc, ConnectionError):  # unreachable: not the replica's fault
                    report.failures.append(f"{c.blob_key[:16]} at {replica.location}: {exc}")
                    continue
                self._mark(c, replica, "corrupt", str(exc), report)
                continue
            except _HeaderMismatch as exc:
                self._mark(c, replica, "corrupt", str(exc), report)
                continue
            seconds = time.perf_counter() - t
            # The share of the read this thread spent on a core, over the share it could
            # get with `lanes` threads on the cores: about 1 when reading is hashing and copying.
            cpu = time.thread_time() - cpu
            busy = cpu / max(seconds, 1e-9) * max(1.0, lanes / self._cores)
            self._note_rate(replica.tier, c.stored_bytes, seconds, busy)
            return decoded, replica.location, seconds
        raise _ChunkFailed(c.blob_key)

    def _read_verified(
        self,
        store: ChunkStore,
        c: ChunkMatch,
        tok: np.ndarray[Any, Any],
        fp_hex: str,
        shard: Shard,
        layout: AttentionLayout,
        hash_threads: int | None,
    ) -> DecodedChunk:
        """Read and verify one replica; a digest mismatch is read once more before it counts.

        Bits flipped in transit (a bad NIC, a proxy) fail once; bits flipped at
        rest fail every time. Only the second kind marks the replica corrupt.
        """
        known = self._headers.get(c.blob_key) if self._headers is not None else None
        shape = (layout.num_layers, 2, c.token_count, layout.num_kv_heads, layout.head_dim)

        def read() -> DecodedChunk:
            return decode_chunk(
                store.get(c.blob_key),
                expected_key=c.blob_key,
                hash_threads=hash_threads,
                known_header=None if known is None else known.header,
                expected_shape=shape,
                expected_dtype=layout.dtype,
            )

        try:
            decoded = read()
        except ChunkLayoutError:
            raise  # what the header declares does not change on a second read
        except ChunkIntegrityError:
            log.warning(
                "blob %s from %s failed verification; reading it again", c.blob_key, store.name
            )
            decoded = read()
        if known is None:
            known = _KnownHeader.of(decoded.header)
            if self._headers is not None:
                self._headers.put(c.blob_key, known)
        self._check_header(decoded, known, c, tok, fp_hex, shard)
        return decoded

    def _mark(
        self,
        c: ChunkMatch,
        replica: ReplicaInfo,
        state: ReplicaState,
        why: str,
        report: RestoreReport,
    ) -> None:
        report.failures.append(f"{c.blob_key[:16]} at {replica.location}: {state}: {why[:200]}")
        log.warning("replica %s of %s is %s: %s", replica.location, c.blob_key, state, why[:200])
        self.catalog.mark_replica(
            c.blob_key,
            replica.location,
            state,
            reason=why[:500],
            namespace=self.namespace,
            actor=self.actor,
        )

    @staticmethod
    def _check_header(
        decoded: DecodedChunk,
        known: _KnownHeader,
        c: ChunkMatch,
        tok: np.ndarray[Any, Any],
        fp_hex: str,
        shard: Shard,
    ) -> None:
        """The verified header is the chunk the catalog promised: its identity, shard, token
        range and the prompt's token ids. One comparison of each when all agree (this runs
        once per chunk, right after its hash, where every Python step costs twice its usual
        time); the problems are listed only when something disagrees."""
        span = tok[c.token_start : c.token_start + c.tokens_used]
        bounds = (shard.layer_lo, shard.layer_hi, shard.head_lo, shard.head_hi)
        expected = (fp_hex, c.prefix_hash, c.parent_hash, c.token_start, c.token_count, *bounds)
        if (
            known.identity == expected
            and decoded.kv.shape[2] == c.token_count
            and known.token_bytes[: span.nbytes] == span.tobytes()
        ):
            return
        h = decoded.header
        problems = []
        if h.fingerprint != fp_hex:
            problems.append("fingerprint")
        if h.prefix_hash != c.prefix_hash or h.parent_hash != c.parent_hash:
            problems.append("prefix or parent hash")
        if h.token_start != c.token_start or len(h.tokens) != c.token_count:
            problems.append("token range")
        elif known.token_bytes[: span.nbytes] != span.tobytes():
            problems.append("token ids")
        if tuple(h.layers) != (shard.layer_lo, shard.layer_hi) or tuple(h.kv_heads) != (
            shard.head_lo,
            shard.head_hi,
        ):
            problems.append("shard")
        if decoded.kv.shape[2] != c.token_count:
            problems.append("shape")
        raise _HeaderMismatch(
            f"blob header disagrees with the catalog: {', '.join(problems) or 'identity'}"
        )

    def _note_rate(self, tier: str, nbytes: int, seconds: float, busy: float) -> None:
        if seconds <= 0:
            return
        with self._rate_lock:
            for averages, value in ((self._tier_rates, nbytes / seconds), (self._tier_busy, busy)):
                old = averages.get(tier)
                averages[tier] = value if old is None else 0.8 * old + 0.2 * value

    def _local_lanes(self, c: ChunkMatch) -> int:
        """Lanes for the chunks read from local or resident replicas, `c` the first of them.

        As many as the cores while reads of its tier keep their thread on a core at least
        half the time they take, for as many threads as the cores can run at once (the page
        cache: each lane hashes and copies, and more lanes than cores only take turns on
        them); `max_parallel` before any read of the tier, or while reads spend most of their
        time waiting (on a device: more reads in flight keep it busy, as after a restart)."""
        order = self._replica_order(c)
        tier = order[0][0].tier if order else None
        with self._rate_lock:
            busy = self._tier_busy.get(tier) if tier is not None else None
        if busy is None or busy < 0.5:
            return self.max_parallel
        return min(self.max_parallel, self._cores)


class _KnownHeader(NamedTuple):
    """A header verified before, with what every restore of it compares: its identity as
    `_check_header` builds the catalog's (fingerprint, prefix and parent hash, token start
    and count, then the shard's layer and head bounds) and its token ids as uint32 bytes."""

    header: ChunkHeader
    identity: tuple[Any, ...]
    token_bytes: bytes

    @classmethod
    def of(cls, h: ChunkHeader) -> _KnownHeader:
        identity = (h.fingerprint, h.prefix_hash, h.parent_hash, h.token_start, len(h.tokens))
        bounds = (*h.layers, *h.kv_heads)
        tokens = np.asarray(h.tokens, np.uint32).tobytes()
        return cls(h, (*identity, *bounds), tokens)


class _HeaderMismatch(Exception):
    """A verified blob whose header is not the chunk the catalog promised."""
