"""The daemon's core: one page pool beside an inference engine, checkpointed and restored.

An engine that cannot link kvc in process talks to a `Daemon` over HTTP
(`kvc.daemon.app`): it configures a pool for its fingerprint, then asks for
checkpoints of its routes and restores of new prompts. What the pool holds is
kept in step with the catalog (resident replicas at `worker:<id>`, demand,
reconcile on start) by `restore.residency.Residency`; a restore is planned by
`restore.planner.Planner` (fork resident pages, restore from a tier, or
recompute). `prefill` computes KV with the in-tree reference decoder: it is the
reference-engine hook that lets tests and the demo drive a daemon without a
real engine, and it refuses any other fingerprint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from catalog import Fingerprint, fingerprint_hex
from catalog.base import CatalogAPI
from catalog.clock import utcnow
from catalog.errors import CatalogError, IdentityError, NotFoundError
from chunkstore import ChunkStore
from chunkstore.errors import ChunkStoreError
from kvc.daemon.errors import (
    DaemonConflictError,
    DaemonError,
    DaemonInputError,
    DaemonInternalError,
    DaemonNotFoundError,
    DaemonUnavailableError,
    PoolFullError,
)
from restore.engines.reference import ReferenceModel
from restore.errors import (
    CheckpointBusyError,
    PoolExhaustedError,
    RestoreError,
    UnknownRouteError,
)
from restore.planner import Planner
from restore.pool import PagePool
from restore.residency import DEFAULT_DEMAND_TTL_S, Residency, timer_interval
from restore.reuse import reuse_prefix
from restore.session import Session
from restore.write_behind import DEFAULT_WRITE_BEHIND_BYTES

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

REFERENCE = "reference"
DEFAULT_INVALIDATION_INTERVAL = 2.0
# The planner's prefill rate until the engine says (configure's prefill_tokens_per_s):
# a cautious guess at a small GPU's, so a stored prefix is restored rather than recomputed.
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0
# How long close() waits for an invalidation timer tick stuck in a catalog call.
_TIMER_JOIN_SECONDS = 10.0

_COUNTS = (
    *("configures", "prefills", "checkpoints", "restores", "restore_misses"),
    *("restored_tokens", "restored_bytes", "planned_forks", "planned_restores"),
    "planned_recomputes",
)


class Daemon:
    """Holds at most one page pool (for one fingerprint) and checkpoints/restores its routes.

    Every method is thread-safe; the HTTP app calls them from a thread pool.
    `stores[0]` takes checkpoints synchronously; an object store after it gets
    write-behind uploads; restores read from all of them. `engines` are the
    reference models `prefill` may use (default: `ReferenceModel.small(0)`,
    built on first use). `prefill_tokens_per_s` is the engine's prefill rate
    the planner weighs restores against (configure may set it too). Every
    `invalidation_interval` seconds (0: never) a daemon thread applies
    quarantine invalidations (`apply_invalidations`) and withdraws the resident
    replicas of the routes it dropped; `close` stops it. Refusals are
    `kvc.daemon.errors` classes (a `DaemonError`, each also the builtin it
    refines); `stats()["last_errors"]` names each one's `kind`.
    """

    def __init__(
        self,
        catalog: CatalogAPI,
        stores: Sequence[ChunkStore],
        *,
        worker_id: str,
        namespace: str = "default",
        chunk_size: int = 256,
        page_size: int = 16,
        engines: Sequence[ReferenceModel] | None = None,
        max_pool_bytes: int = 8 << 30,
        invalidation_interval: float = DEFAULT_INVALIDATION_INTERVAL,
        prefill_tokens_per_s: float | None = None,
        demand_ttl_s: float = DEFAULT_DEMAND_TTL_S,
        write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
    ) -> None:
        if not isinstance(worker_id, str) or not worker_id.strip():
            raise ValueError("worker_id must be a non-empty string")
        if not stores:
            raise ValueError("a daemon needs at least one store to checkpoint into")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        interval = timer_interval(invalidation_interval)
        self.catalog = catalog
        self.worker_id = worker_id
        self.location = f"worker:{worker_id}"
        self.namespace = namespace
        self.page_size = page_size
        self.max_pool_bytes = max_pool_bytes
        self._session = Session(
            catalog,
            stores,
            namespace,
            chunk_size,
            actor=self.location,
            write_behind_bytes=write_behind_bytes,
        )
        self._checkpointer = self._session.checkpointer
        self._restorer = self._session.restorer
        self.chunk_size = self._session.chunk_size
        self._residency = Residency(
            catalog,
            worker_id=worker_id,
            namespace=namespace,
            chunk_size=self.chunk_size,
            demand_ttl_s=demand_ttl_s,
        )
        self._planner = Planner(prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)
        self._engines: dict[str, ReferenceModel] | None = (
            None if engines is None else {m.fingerprint.hex: m for m in engines}
        )
        self._lock = threading.RLock()
        self._fingerprint: Fingerprint | None = None
        self._counts: Counter[str] = Counter()
        self._errors: deque[dict[str, Any]] = deque(maxlen=10)
        self._closed = False
        self.invalidation_interval = interval
        if interval > 0:
            self._residency.start_timer(self.invalidation_interval)

    @property
    def pool(self) -> PagePool | None:
        """The configured pool (None before `configure`), for an engine running in process."""
        return self._residency.pool

    @property
    def fingerprint(self) -> Fingerprint | None:
        with self._lock:
            return self._fingerprint

    # -- lifecycle ---------------------------------------------------------------

    def reconcile(self) -> int:
        """Withdraw resident replicas credited to this worker that it does not hold; returns how many.

        Call it on start: a new pool holds nothing, so every resident replica
        the catalog still lists for this worker id is stale.
        """
        return self._residency.reconcile()

    def refresh(self) -> dict[str, int]:
        """Apply pending invalidations, then make the catalog's resident replicas for this
        worker exactly what the pool holds."""
        dropped = self.apply_invalidations()
        return {**self._residency.sync(), "invalidated_routes": dropped}

    def apply_invalidations(self) -> int:
        """Drop every route holding a blob that a quarantine invalidated on this worker
        (`Residency.apply_invalidations`); returns how many. The timer calls this, so does `refresh`."""
        return self._residency.apply_invalidations()

    def close(self) -> None:
        """Stop the invalidation timer, release the pool, withdraw its resident replicas,
        drain write-behind uploads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._residency.stop_timer(_TIMER_JOIN_SECONDS)
        with self._lock:
            self._residency.use_pool(None)
            self._fingerprint = None
        try:
            self.reconcile()
        finally:
            self._session.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ----------------------------------------------------------------

    def configure(
        self,
        fingerprint: Mapping[str, Any] | str,
        num_pages: int,
        page_size: int | None = None,
        prefill_tokens_per_s: float | None = None,
    ) -> dict[str, Any]:
        """Create the pool for `fingerprint`'s layout; anything but an identical request drops
        the old one. `prefill_tokens_per_s`: the engine's prefill rate, for the planner."""
        with self._errors_as("configure"):
            fp = self._resolve_fingerprint(fingerprint)
            ps = self.page_size if page_size is None else page_size
            layout = fp.layout
            nbytes = num_pages * ps * layout.bytes_per_token
            if nbytes > self.max_pool_bytes:
                raise DaemonInputError(
                    f"{num_pages} pages of {ps} tokens need {nbytes} bytes, more than this "
                    f"daemon's limit of {self.max_pool_bytes}",
                    field="num_pages",
                )
            if prefill_tokens_per_s is not None:
                self._planner.prefill_tokens_per_s = prefill_tokens_per_s
            with self._lock:
                self._check_open()
                pool = self._residency.pool
                same = (
                    pool is not None
                    and self._fingerprint == fp
                    and (pool.num_pages, pool.page_size) == (num_pages, ps)
                )
                if not same:
                    # Register first, so other workers can name this fingerprint by hex.
                    self.catalog.register_fingerprint(fp, namespace=self.namespace)
                    self._residency.use_pool(PagePool(layout, ps, num_pages=num_pages))
                    self._fingerprint = fp
                    self._counts["configures"] += 1
            if not same and pool is not None:
                self._residency.sync()
            return {
                "fingerprint": fp.hex,
                "layout": layout.to_dict(),
                "num_pages": num_pages,
                "page_size": ps,
                "reconfigured": not same,
            }

    def prefill(self, tokens: Sequence[int], route: int | None = None) -> dict[str, Any]:
        """Reference-engine hook: compute KV for `tokens` on a new route (or after `route`)."""
        with self._errors_as("prefill"):
            pool, fp = self._current()
            model = self._engine_for(fp)
            if model is None:
                raise DaemonConflictError(
                    f"prefill is the reference-engine hook; fingerprint {fp.hex[:16]} is not a "
                    "reference model's, so its engine must compute the KV",
                )
            new = route is None
            rid = pool.new_route() if route is None else route
            started = time.perf_counter()
            try:
                model.prefill(pool, rid, tokens)
            except ValueError as exc:
                raise DaemonInputError(str(exc), field="tokens") from exc
            except BaseException:
                if new:
                    pool.release(rid)
                raise
            # What this engine really takes is what the planner weighs restores against.
            self._planner.observe_prefill(len(tokens), time.perf_counter() - started)
            self._counts["prefills"] += 1
            return {"route": rid, "length": pool.length(rid)}

    def checkpoint(
        self,
        route: int,
        tokens: Sequence[int],
        name: str | None = None,
        pending: int | None = None,
    ) -> dict[str, Any]:
        """Publish the route's first len(tokens) positions, then advertise its chunks as resident."""
        with self._errors_as("checkpoint"):
            pool, fp = self._current()
            result = self._checkpointer.checkpoint(
                pool, route, list(tokens), fp, name=name, pending=pending
            )
            resident = self._residency.whole_chunks(fp, tokens)
            self._residency.hold(pool, route, resident)
            self._counts["checkpoints"] += 1
            self._residency.sync()
            return {
                "route": route,
                "tokens": result.tokens,
                "chunks": result.chunks,
                "new_chunks": result.new_chunks,
                "skipped_chunks": result.skipped_chunks,
                "stored_bytes": result.stored_bytes,
                "head": None if result.head is None else result.head.hex(),
                "resident_chunks": len(resident),
            }

    def restore(self, tokens: Sequence[int]) -> dict[str, Any] | None:
        """Plan, then fork resident pages, restore the longest verified stored prefix into a
        new route, or leave the prompt to the engine (recompute); None on a miss.

        The answer's `decision` says which and why, with the planner's estimates.
        """
        with self._errors_as("restore"):
            pool, fp = self._current()
            done = reuse_prefix(self._planner, self._restorer, self._residency, pool, fp, tokens)
            if done is None:
                self._counts["restore_misses"] += 1
                return None
            d = done.decision
            self._counts[f"planned_{d.action}s"] += 1
            if d.action == "restore":
                self._counts["restores"] += 1
                self._counts["restored_tokens"] += done.restored_tokens
                self._counts["restored_bytes"] += done.bytes
            if done.route is not None:
                self._residency.sync()
            return done.to_dict()

    def release(self, route: int) -> dict[str, Any]:
        """Drop one route; the resident replicas only it held are withdrawn."""
        with self._errors_as("release"):
            pool, _ = self._current()
            self._residency.release(pool, route)
            self._residency.sync()
            return {"released": [route]}

    def clear(self) -> dict[str, Any]:
        """Release every route and withdraw every resident replica of this worker."""
        with self._errors_as("clear"):
            pool, _ = self._current()
            routes = self._residency.clear(pool)
            self._residency.sync()
            return {"released": routes}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pool, fp = self._residency.pool, self._fingerprint
            doc: dict[str, Any] = {
                "worker": self.worker_id,
                "namespace": self.namespace,
                "chunk_size": self.chunk_size,
                "configured": pool is not None,
                "fingerprint": None if fp is None else fp.hex,
                "pages_total": 0 if pool is None else pool.num_pages,
                "pages_free": 0 if pool is None else pool.free_pages,
                "page_size": self.page_size if pool is None else pool.page_size,
                "routes": {} if pool is None else {r: pool.length(r) for r in pool.routes()},
                "resident_chunks": self._residency.resident_chunks,
                "last_errors": list(self._errors),
                "invalidation_interval": self.invalidation_interval,
                **self._residency.invalidation_stats(),
                "prefill_tokens_per_s": self._planner.prefill_tokens_per_s,
            }
            doc.update({key: self._counts[key] for key in _COUNTS})
            doc["checkpoints_dropped"] = dict(self._checkpointer.dropped)
            doc["write_behind_pending_bytes"] = self._checkpointer.write_behind_pending_bytes
            return doc

    # -- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonUnavailableError("the daemon is shutting down")

    def _current(self) -> tuple[PagePool, Fingerprint]:
        with self._lock:
            self._check_open()
            pool = self._residency.pool
            if pool is None or self._fingerprint is None:
                raise DaemonConflictError("no pool is configured: POST /v1/configure first")
            return pool, self._fingerprint

    def _reference_engines(self) -> dict[str, ReferenceModel]:
        with self._lock:
            if self._engines is None:
                model = ReferenceModel.small(seed=0)
                self._engines = {model.fingerprint.hex: model}
            return self._engines

    def _engine_for(self, fp: Fingerprint) -> ReferenceModel | None:
        return self._reference_engines().get(fp.hex)

    def _resolve_fingerprint(self, spec: Mapping[str, Any] | str) -> Fingerprint:
        if isinstance(spec, str):
            engines = self._reference_engines()
            if spec == REFERENCE:
                return next(iter(engines.values())).fingerprint
            try:
                found = self.catalog.get_fingerprint(
                    fingerprint_hex(spec.lower()), namespace=self.namespace
                )
            except IdentityError:
                found = None
            if found is None and spec.lower() in engines:
                found = engines[spec.lower()].fingerprint
            if found is None:
                raise DaemonInputError(
                    f"fingerprint {spec[:64]!r} is not catalogued: send its descriptor instead",
                    field="fingerprint",
                )
            return found
        try:
            return Fingerprint.from_descriptor(spec)
        except IdentityError as exc:
            raise DaemonInputError(
                f"invalid fingerprint descriptor: {exc}", field="fingerprint"
            ) from exc

    @contextmanager
    def _errors_as(self, op: str) -> Iterator[None]:
        """Turn library errors into the daemon's own (`kvc.daemon.errors`), and remember the last few."""
        try:
            yield
        except DaemonError as exc:
            self._note(op, exc)
            raise
        except Exception as exc:
            err = _translate(op, exc)
            self._note(op, err)
            raise err from exc

    def _note(self, op: str, err: DaemonError) -> None:
        with self._lock:
            self._errors.append(
                {
                    "at": utcnow().isoformat(),
                    "op": op,
                    "kind": type(err).__name__,
                    "error": err.message,
                }
            )


def _translate(op: str, exc: Exception) -> DaemonError:
    # Order matters: UnknownRouteError is a RestoreError, IdentityError a CatalogError, and a
    # RestoreError or CatalogError that is also a ValueError is a conflict, not bad input.
    if isinstance(exc, UnknownRouteError):
        return DaemonNotFoundError(str(exc), field="route")
    if isinstance(exc, PoolExhaustedError):
        return PoolFullError(str(exc))
    if isinstance(exc, CheckpointBusyError):
        return DaemonUnavailableError(str(exc))
    if isinstance(exc, RestoreError):
        return DaemonConflictError(str(exc))
    if isinstance(exc, NotFoundError):
        return DaemonNotFoundError(str(exc))
    if isinstance(exc, IdentityError):
        return DaemonInputError(str(exc))
    if isinstance(exc, CatalogError):
        return DaemonConflictError(str(exc))
    if isinstance(exc, ChunkStoreError):
        return DaemonUnavailableError(f"store error: {exc}")
    if isinstance(exc, ValueError):
        return DaemonInputError(str(exc))
    # Unexpected: the traceback goes to the daemon's log, never to the caller.
    log.error("%s failed", op, exc_info=exc)
    return DaemonInternalError(
        f"internal error during {op} ({type(exc).__name__}); see the daemon log"
    )
