"""Write-behind: background uploads of new blobs to an object store, bounded by a byte budget."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from typing_extensions import Buffer

from catalog import Fingerprint
from catalog.base import CatalogAPI
from catalog.errors import NotFoundError, PurgeInProgressError
from catalog.models import ReplicaReceipt
from chunkstore import ChunkStore, Receipt, Tier
from chunkstore.errors import ChunkStoreError
from restore.errors import CheckpointBusyError

log = logging.getLogger(__name__)

DEFAULT_WRITE_BEHIND_BYTES = 256 << 20  # encoded bytes of write-behind uploads pending at once
DEFAULT_WRITE_BEHIND_WAIT_S = 30.0  # how long an explicit checkpoint waits for room in them


def write_behind_store(stores: Sequence[ChunkStore]) -> ChunkStore | None:
    """Of the stores after the first, the one that gets write-behind copies: the first object store."""
    return next((s for s in stores if s.tier == "object"), None)


def to_replica_receipt(receipt: Receipt, tier: Tier) -> ReplicaReceipt:
    """The catalog's form of a store's receipt, for a replica in `tier` (the store's `tier`)."""
    return ReplicaReceipt(
        location=receipt.store,
        tier=tier,
        size=receipt.size,
        checksum=receipt.checksum,
        stored_at=receipt.stored_at,
        etag=receipt.etag,
        version=receipt.version,
    )


class WriteBehind:
    """The uploads of one `Checkpointer` to its write-behind store, and their byte budget.

    `target` is the store copies go to (None: no write-behind; only the budget's
    bookkeeping exists). A publish takes room with `admit` before its local put,
    gives it back with `release` if that put fails, and hands the bytes to
    `upload_later`, which uploads them in the background and records the
    replica once the publish says its chunk is catalogued. Uploads not yet put
    hold at most `budget` encoded bytes (one chunk larger than that alone).
    What is not uploaded is counted in `dropped` by reason.
    `describe(store, fingerprint)` writes the fingerprint's descriptor to a
    store before the first blob naming it.
    """

    def __init__(
        self,
        target: ChunkStore | None,
        catalog: CatalogAPI,
        *,
        namespace: str,
        actor: str | None,
        budget: int,
        wait_s: float,
        describe: Callable[[ChunkStore, Fingerprint], None],
    ) -> None:
        if budget < 1:
            raise ValueError(f"write_behind_bytes must be >= 1, got {budget!r}")
        if not wait_s >= 0:
            raise ValueError(f"write_behind_wait_s must be >= 0, got {wait_s!r}")
        self.target = target
        self.catalog = catalog
        self.namespace = namespace
        self.actor = actor
        self.budget = budget
        self.wait_s = wait_s
        self._describe = describe
        self._dropped: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._pending = 0  # encoded bytes of uploads admitted and not yet put (or failed)
        self._uploads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvc-write-behind")
        self._futures: set[Future[None]] = set()

    @property
    def dropped(self) -> Counter[str]:
        """Copies not made so far, by reason (`write_behind_budget`, `write_behind_failed`,
        `write_behind_unpublished`, `write_behind_purged`, `write_behind_closed`): a copy."""
        with self._lock:
            return Counter(self._dropped)

    @property
    def pending_bytes(self) -> int:
        """Encoded bytes of uploads admitted and not yet put (at most `budget`, or one
        chunk larger than that alone)."""
        with self._lock:
            return self._pending

    def admit(self, nbytes: int, speculative: bool) -> bool:
        """Take `nbytes` of the budget: True if taken; False (counted) when a
        speculative capture finds it full; an explicit one waits, then is refused."""

        def fits() -> bool:
            return self._pending == 0 or self._pending + nbytes <= self.budget

        with self._room:
            if not fits():
                if speculative:
                    self._dropped["write_behind_budget"] += 1
                    return False
                if not self._room.wait_for(fits, timeout=self.wait_s):
                    raise CheckpointBusyError(
                        f"write-behind uploads busy: {self._pending} of "
                        f"{self.budget} bytes pending for "
                        f"{self.wait_s:g} s (the object store is slow or down)"
                    )
            self._pending += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` taken by `admit`."""
        with self._room:
            self._pending -= nbytes
            self._room.notify_all()

    def upload_later(
        self,
        key: str,
        data: Buffer,
        fp: Fingerprint,
        catalogued: Future[bool],
        *,
        done: Callable[[], None] | None = None,
    ) -> None:
        """Upload now (its room in the budget already taken); record the replica once
        `catalogued` says the chunk's row exists (a replica of a chunk not yet
        catalogued would be refused, and lost). `done` is called once `data` is no
        longer read (its buffer may then be reused)."""
        target = self.target
        assert target is not None
        nbytes = memoryview(data).nbytes
        held = [data]  # emptied after the put, so the bytes go as their room is given back

        def let_go() -> None:
            held.clear()
            if done is not None:
                done()

        def upload() -> None:
            try:
                self._describe(target, fp)
                receipt = target.put_hashed(key, held.pop())  # the publish hashed it
            except ChunkStoreError as exc:
                # The local replica is durable and catalogued; the object-store
                # replica simply does not exist until a later upload succeeds.
                log.warning("write-behind upload of %s to %s failed: %s", key, target.name, exc)
                with self._lock:
                    self._dropped["write_behind_failed"] += 1
                return
            finally:
                let_go()
                # Given back before waiting for the catalog: a publish waiting for room
                # never waits on its own uploads' catalog step.
                self.release(nbytes)
            if not catalogued.result():
                # The publish failed: these bytes are an orphan like the local ones,
                # reclaimed by GC after its grace period.
                with self._lock:
                    self._dropped["write_behind_unpublished"] += 1
                return
            try:
                self.catalog.record_replica(
                    key,
                    to_replica_receipt(receipt, target.tier),
                    namespace=self.namespace,
                    actor=self.actor,
                )
            except (PurgeInProgressError, NotFoundError) as exc:
                # GC purged the chunk while it was uploading: the uploaded bytes are an
                # orphan that a later GC deletes once past its grace period.
                log.warning("write-behind replica of %s not recorded: %s", key, exc)
                with self._lock:
                    self._dropped["write_behind_purged"] += 1

        with self._lock:
            try:
                fut = self._uploads.submit(upload)
            except RuntimeError:  # closed under a publish still running
                let_go()
                self._pending -= nbytes
                self._room.notify_all()
                self._dropped["write_behind_closed"] += 1
                return
            self._futures.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._lock:
            self._futures.discard(fut)

    def close(self) -> None:
        """Wait for the uploads under way, then stop the upload workers."""
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.result()
        self._uploads.shutdown(wait=True)
