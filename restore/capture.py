"""The capture queue: a checkpointer's asynchronous captures, bounded, and the worker that publishes them."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from catalog import Fingerprint
from restore.destination import KVSnapshot
from restore.errors import CheckpointBusyError

if TYPE_CHECKING:
    from restore.checkpoint import CheckpointResult


@dataclass(frozen=True)
class Capture:
    """One capture to publish: a snapshot (pinned until published) and what to publish of it."""

    snapshot: KVSnapshot
    tokens: np.ndarray[Any, Any]
    fingerprint: Fingerprint
    name: str | None
    pending: int | None
    speculative: bool


@dataclass(frozen=True)
class _Job:
    capture: Capture
    release: Callable[[], None]
    nbytes: int
    future: Future[CheckpointResult]


class CaptureQueue:
    """The captures of one `Checkpointer` that its callers do not wait for.

    At most `max_queue` captures are queued or being published at once, and
    their snapshots hold at most `staging_bytes` of KV (each pins its snapshot,
    a page-pool lease or an engine's cache, until published). Past either bound
    a speculative capture is dropped (counted in `dropped` by reason: its
    snapshot released, no future) and an explicit one is refused with
    `CheckpointBusyError`. One worker thread, started by the first capture,
    publishes them in order with `publish`; `close` drains the queue.
    """

    def __init__(
        self,
        publish: Callable[[Capture], CheckpointResult],
        *,
        max_queue: int,
        staging_bytes: int,
    ) -> None:
        self._publish = publish
        self._max_queue = max_queue
        self._staging_budget = staging_bytes
        self._staged = 0
        self._queued = 0
        self._dropped: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    @property
    def dropped(self) -> Counter[str]:
        """Speculative captures dropped so far, by reason (`queue_full`, `staging_budget`): a copy."""
        with self._lock:
            return Counter(self._dropped)

    def submit(
        self, capture: Capture, release: Callable[[], None]
    ) -> Future[CheckpointResult] | None:
        """Queue `capture`; `release` is called once its snapshot is no longer read
        (also when it is dropped or refused). None when a speculative capture is dropped."""
        nbytes = len(capture.tokens) * capture.snapshot.layout.bytes_per_token
        with self._lock:
            reason = None
            if self._queued >= self._max_queue:
                reason = "queue_full"
            elif self._staged + nbytes > self._staging_budget:
                reason = "staging_budget"
            if reason is not None:
                release()
                if capture.speculative:
                    self._dropped[reason] += 1
                    return None
                raise CheckpointBusyError(
                    f"checkpoint queue busy ({reason}: {self._queued} queued, "
                    f"{self._staged} of {self._staging_budget} staging bytes in use)"
                )
            self._queued += 1
            self._staged += nbytes
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="kvc-checkpoint", daemon=True
                )
                self._worker.start()
        fut: Future[CheckpointResult] = Future()
        self._queue.put(_Job(capture, release, nbytes, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.future.set_result(self._publish(job.capture))
            except BaseException as exc:  # reported through the future, never lost
                job.future.set_exception(exc)
            finally:
                job.release()
                with self._lock:
                    self._queued -= 1
                    self._staged -= job.nbytes

    def close(self) -> None:
        """Publish the captures still queued, then stop the worker."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
