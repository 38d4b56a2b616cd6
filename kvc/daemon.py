"""The checkpoint/restore daemon: one page pool beside an inference engine, served over loopback HTTP.

An engine that cannot link kvc in process talks to a `Daemon` over HTTP: it
configures a pool for its fingerprint, then asks for checkpoints of its routes
and restores of new prompts. After a checkpoint (or a restore) the chunks a
route holds whole are advertised in the catalog as *resident* replicas at
`worker:<id>`, so a planner elsewhere can prefer forking them to fetching. The
pool dies with the process, so a daemon starting under the same worker id
first withdraws every resident replica the catalog still credits it with
(`reconcile`).

`POST /v1/prefill` computes KV with the in-tree reference decoder: it is the
reference-engine hook that lets tests and the demo drive a daemon without a
real engine, and it answers 409 for any other fingerprint.

A quarantine records `invalidate` events addressed to the workers holding the
quarantined chunks (ARCHITECTURE 9). A background timer applies the ones
addressed to this worker every `invalidation_interval` seconds, so the
affected routes leave the pool without anyone calling `refresh`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from catalog import Fingerprint, prefix_hashes
from catalog.catalog import Catalog
from catalog.errors import CatalogError, IdentityError, NotFoundError
from catalog.models import ReplicaReceipt
from chunkstore import ChunkStore
from chunkstore.errors import ChunkStoreError
from kvc import __version__
from restore.checkpoint import Checkpointer, write_behind_store
from restore.engines.reference import ReferenceModel
from restore.errors import (
    CheckpointBusyError,
    PoolExhaustedError,
    RestoreError,
    UnknownRouteError,
)
from restore.pool import PagePool
from restore.restore import Restorer

__all__ = [
    "CheckpointRequest",
    "ConfigureRequest",
    "Daemon",
    "DaemonError",
    "PrefillRequest",
    "RestoreRequest",
    "create_daemon_app",
]

log = logging.getLogger(__name__)

MAX_TOKENS = 1 << 20
REFERENCE = "reference"
DEFAULT_INVALIDATION_INTERVAL = 2.0
# How long close() waits for a timer tick stuck in a catalog call; the thread is a
# daemon thread, so one that outlives the wait cannot keep the process alive.
_TIMER_JOIN_SECONDS = 10.0

Token = Annotated[StrictInt, Field(ge=0, le=0xFFFFFFFF)]
Tokens = Annotated[list[Token], Field(min_length=1, max_length=MAX_TOKENS)]


class _Body(BaseModel):
    # A misspelt field is a 422 naming it, not a silently ignored option.
    model_config = ConfigDict(extra="forbid")


class ConfigureRequest(_Body):
    """`fingerprint`: a descriptor, the hex of a catalogued one, or "reference"."""

    fingerprint: dict[str, Any] | Annotated[StrictStr, Field(min_length=1, max_length=200)]
    num_pages: Annotated[StrictInt, Field(ge=1)]
    page_size: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None


class PrefillRequest(_Body):
    """Reference-engine hook: feed `tokens` to a new route, or after the end of `route`."""

    tokens: Tokens
    route: StrictInt | None = None


class CheckpointRequest(_Body):
    route: StrictInt
    tokens: Tokens
    name: Annotated[StrictStr, Field(min_length=1, max_length=512)] | None = None
    pending: Token | None = None


class RestoreRequest(_Body):
    tokens: Tokens


class RouteRequest(_Body):
    route: StrictInt


class DaemonError(Exception):
    """A request the daemon refuses: `status` is the HTTP status, `field` the body field at fault."""

    def __init__(self, status: int, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def _now() -> datetime:
    return datetime.now(UTC)


class Daemon:
    """Holds at most one page pool (for one fingerprint) and checkpoints/restores its routes.

    Every method is thread-safe; the HTTP app calls them from a thread pool.
    `stores[0]` takes checkpoints synchronously; an object store after it gets
    write-behind uploads; restores read from all of them. `engines` are the
    reference models `prefill` may use (default: `ReferenceModel.small(0)`,
    built on first use). Every `invalidation_interval` seconds (0: never) a
    daemon thread applies quarantine invalidations (`apply_invalidations`) and
    withdraws the resident replicas of the routes it dropped; `close` stops it.
    """

    def __init__(
        self,
        catalog: Catalog,
        stores: Sequence[ChunkStore],
        *,
        worker_id: str,
        namespace: str = "default",
        chunk_size: int = 256,
        page_size: int = 16,
        engines: Sequence[ReferenceModel] | None = None,
        max_pool_bytes: int = 8 << 30,
        invalidation_interval: float = DEFAULT_INVALIDATION_INTERVAL,
    ) -> None:
        if not isinstance(worker_id, str) or not worker_id.strip():
            raise ValueError("worker_id must be a non-empty string")
        if not stores:
            raise ValueError("a daemon needs at least one store to checkpoint into")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if (
            isinstance(invalidation_interval, bool)
            or not isinstance(invalidation_interval, int | float)
            or not math.isfinite(invalidation_interval)
            or invalidation_interval < 0
        ):
            raise ValueError(
                "invalidation_interval must be a finite number of seconds >= 0 (0 disables "
                f"the timer), got {invalidation_interval!r}"
            )
        self.catalog = catalog
        self.worker_id = worker_id
        self.location = f"worker:{worker_id}"
        self.namespace = namespace
        self.page_size = page_size
        self.max_pool_bytes = max_pool_bytes
        write_behind = write_behind_store(stores[1:])
        self._checkpointer = Checkpointer(
            catalog,
            stores[0],
            namespace,
            chunk_size,
            write_behind=write_behind,
            actor=self.location,
        )
        self.chunk_size = self._checkpointer.chunk_size
        self._restorer = Restorer(catalog, stores, namespace, actor=self.location)
        self._engines: dict[str, ReferenceModel] | None = (
            None if engines is None else {m.fingerprint.hex: m for m in engines}
        )
        self._lock = threading.RLock()
        # Refreshes are serialised so one never withdraws what another just advertised.
        self._sync_lock = threading.Lock()
        self._pool: PagePool | None = None
        self._fingerprint: Fingerprint | None = None
        # route -> {blob key: stored bytes} of the chunks that route holds whole.
        self._held: dict[int, dict[str, int]] = {}
        self._invalidated_seq = 0  # last `invalidate` event applied
        # The timer and `refresh` both move the event cursor: one reader at a time.
        self._invalidation_lock = threading.Lock()
        self._last_invalidation_check: datetime | None = None
        self._counts: Counter[str] = Counter()
        self._errors: deque[dict[str, Any]] = deque(maxlen=10)
        self._closed = False
        self.invalidation_interval = float(invalidation_interval)
        self._stop = threading.Event()
        self._withdraw_pending = False  # touched by the timer thread only
        self._timer: threading.Thread | None = None
        if self.invalidation_interval > 0:
            self._timer = threading.Thread(
                target=self._run_timer,
                name=f"kvc-daemon-invalidations[{self.location}]",
                daemon=True,
            )
            self._timer.start()

    @property
    def pool(self) -> PagePool | None:
        """The configured pool (None before `configure`), for an engine running in process."""
        with self._lock:
            return self._pool

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
        return self._sync(advertise=False)["withdrawn"]

    def refresh(self) -> dict[str, int]:
        """Apply pending invalidations, then make the catalog's resident replicas for this
        worker exactly what the pool holds."""
        dropped = self.apply_invalidations()
        return {**self._sync(advertise=True), "invalidated_routes": dropped}

    def apply_invalidations(self) -> int:
        """Drop every route holding a blob that a quarantine invalidated on this worker.

        Quarantine records one `invalidate` event per replica (ARCHITECTURE 9);
        the events addressed to this worker's location are read in order from
        the last one applied. Returns how many routes were released. The
        background timer calls this; so does `refresh`.
        """
        with self._invalidation_lock:
            events = self.catalog.events(
                kind="invalidate", since_seq=self._invalidated_seq, limit=10_000
            )
            bad: set[str] = set()
            seen = self._invalidated_seq
            for e in events:
                seen = max(seen, e.seq)
                if e.details.get("location") == self.location and e.subject:
                    bad.add(e.subject)
            dropped = 0
            # The same lock as every other pool/route change: a request never sees
            # a route half-dropped, and a dropped route is never re-held.
            with self._lock:
                pool = self._pool
                if bad and pool is not None:
                    for route, held in list(self._held.items()):
                        if bad & held.keys() and route in pool.routes():
                            pool.release(route)
                            del self._held[route]
                            dropped += 1
                self._counts["invalidated_routes"] += dropped
                self._counts["invalidation_checks"] += 1
                self._last_invalidation_check = _now()
            # Only now: a drop that raised is read again next time.
            self._invalidated_seq = seen
        if bad:
            log.info("dropped %d route(s) holding %d invalidated blob(s)", dropped, len(bad))
        return dropped

    def _run_timer(self) -> None:
        while not self._stop.wait(self.invalidation_interval):
            self._tick()

    def _tick(self) -> None:
        """One timer round: apply invalidations, withdraw what they dropped; never raises."""
        if self._closed:
            return
        try:
            # A withdrawal that failed after its routes were dropped is retried on
            # the next tick, though that tick may drop nothing new.
            self._withdraw_pending = self.apply_invalidations() > 0 or self._withdraw_pending
            if self._withdraw_pending:
                self._sync(advertise=True)
                self._withdraw_pending = False
        except Exception as exc:
            # The class name only: a driver's message may carry a URL or a user name,
            # and the next tick retries from the same event cursor anyway.
            with self._lock:
                self._counts["invalidation_failures"] += 1
            log.warning(
                "invalidation check on %s failed (%s); retrying in %gs",
                self.location,
                exc.__class__.__name__,
                self.invalidation_interval,
            )

    def close(self) -> None:
        """Stop the invalidation timer, release the pool, withdraw its resident replicas,
        drain write-behind uploads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(_TIMER_JOIN_SECONDS)
            if timer.is_alive():
                log.warning(
                    "the invalidation timer of %s is still in a catalog call after %gs; "
                    "closing without it",
                    self.location,
                    _TIMER_JOIN_SECONDS,
                )
        with self._lock:
            self._pool = None
            self._fingerprint = None
            self._held.clear()
        try:
            self.reconcile()
        finally:
            self._checkpointer.close()
            self._restorer.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ----------------------------------------------------------------

    def configure(
        self, fingerprint: Mapping[str, Any] | str, num_pages: int, page_size: int | None = None
    ) -> dict[str, Any]:
        """Create the pool for `fingerprint`'s layout; anything but an identical request drops the old one."""
        with self._errors_as("configure"):
            fp = self._resolve_fingerprint(fingerprint)
            ps = self.page_size if page_size is None else page_size
            layout = fp.layout
            nbytes = num_pages * ps * layout.bytes_per_token
            if nbytes > self.max_pool_bytes:
                raise DaemonError(
                    422,
                    f"{num_pages} pages of {ps} tokens need {nbytes} bytes, more than this "
                    f"daemon's limit of {self.max_pool_bytes}",
                    field="num_pages",
                )
            with self._lock:
                self._check_open()
                pool = self._pool
                same = (
                    pool is not None
                    and self._fingerprint == fp
                    and (pool.num_pages, pool.page_size) == (num_pages, ps)
                )
                if not same:
                    # Register first, so other workers can name this fingerprint by hex.
                    self.catalog.register_fingerprint(fp)
                    self._pool = PagePool(layout, ps, num_pages=num_pages)
                    self._fingerprint = fp
                    self._held.clear()
                    self._counts["configures"] += 1
            if not same and pool is not None:
                self._sync(advertise=True)
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
                raise DaemonError(
                    409,
                    f"prefill is the reference-engine hook; fingerprint {fp.hex[:16]} is not a "
                    "reference model's, so its engine must compute the KV",
                )
            new = route is None
            rid = pool.new_route() if route is None else route
            try:
                model.prefill(pool, rid, tokens)
            except ValueError as exc:
                raise DaemonError(422, str(exc), field="tokens") from exc
            except BaseException:
                if new:
                    pool.release(rid)
                raise
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
            resident = self._whole_chunks(fp, tokens)
            self._hold(pool, route, resident)
            self._counts["checkpoints"] += 1
            self._sync(advertise=True)
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
        """Restore the longest verified stored prefix into a new route; None on a miss."""
        with self._errors_as("restore"):
            pool, fp = self._current()
            result = self._restorer.restore(pool, list(tokens), fp)
            if result.route is None:
                self._counts["restore_misses"] += 1
                return None
            chunks = result.match.chunks if result.match is not None else ()
            whole = {
                c.blob_key: c.stored_bytes
                for c in chunks
                if c.tokens_used == c.token_count
                and c.token_start + c.token_count <= result.restored_tokens
            }
            self._hold(pool, result.route, whole)
            self._counts["restores"] += 1
            self._counts["restored_tokens"] += result.restored_tokens
            self._counts["restored_bytes"] += result.report.bytes
            self._sync(advertise=True)
            return {
                "route": result.route,
                "restored_tokens": result.restored_tokens,
                "recompute_from": result.recompute_from,
                "prompt_tokens": result.prompt_tokens,
                "chunks": result.report.chunks,
                "bytes": result.report.bytes,
                "failures": list(result.report.failures),
            }

    def release(self, route: int) -> dict[str, Any]:
        """Drop one route; the resident replicas only it held are withdrawn."""
        with self._errors_as("release"):
            pool, _ = self._current()
            with self._lock:
                pool.release(route)
                self._held.pop(route, None)
            self._sync(advertise=True)
            return {"released": [route]}

    def clear(self) -> dict[str, Any]:
        """Release every route and withdraw every resident replica of this worker."""
        with self._errors_as("clear"):
            pool, _ = self._current()
            with self._lock:
                routes = pool.routes()
                for r in routes:
                    pool.release(r)
                self._held.clear()
            self._sync(advertise=True)
            return {"released": routes}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pool, fp = self._pool, self._fingerprint
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
                "resident_chunks": len({k for held in self._held.values() for k in held}),
                "last_errors": list(self._errors),
                "invalidation_interval": self.invalidation_interval,
                "invalidation_timer": self._timer is not None and self._timer.is_alive(),
                "last_invalidation_check": (
                    None
                    if self._last_invalidation_check is None
                    else self._last_invalidation_check.isoformat()
                ),
            }
            for key in (
                "configures",
                "prefills",
                "checkpoints",
                "restores",
                "restore_misses",
                "restored_tokens",
                "restored_bytes",
                "invalidation_checks",
                "invalidation_failures",
                "invalidated_routes",
            ):
                doc[key] = self._counts[key]
            doc["checkpoints_dropped"] = dict(self._checkpointer.dropped)
            return doc

    # -- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonError(503, "the daemon is shutting down")

    def _current(self) -> tuple[PagePool, Fingerprint]:
        with self._lock:
            self._check_open()
            if self._pool is None or self._fingerprint is None:
                raise DaemonError(409, "no pool is configured: POST /v1/configure first")
            return self._pool, self._fingerprint

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
            found = self.catalog.get_fingerprint(spec.lower()) if _is_hex(spec) else None
            if found is None and spec.lower() in engines:
                found = engines[spec.lower()].fingerprint
            if found is None:
                raise DaemonError(
                    422,
                    f"fingerprint {spec[:64]!r} is not catalogued: send its descriptor instead",
                    field="fingerprint",
                )
            return found
        try:
            return Fingerprint.from_descriptor(spec)
        except IdentityError as exc:
            raise DaemonError(
                422, f"invalid fingerprint descriptor: {exc}", field="fingerprint"
            ) from exc

    def _whole_chunks(self, fp: Fingerprint, tokens: Sequence[int]) -> dict[str, int]:
        """Blob keys (with stored bytes) of the chunks exactly covering `tokens`."""
        exact = set(prefix_hashes(self.namespace, list(tokens), self.chunk_size))
        # A dummy pending token lets the lookup cover every checkpointed position.
        match = self.catalog.lookup(self.namespace, fp, [*tokens, 0])
        # Filtering by our own prefix hashes keeps a longer sibling tail out.
        return {
            c.blob_key: c.stored_bytes
            for c in match.chunks
            if c.prefix_hash in exact and c.tokens_used == c.token_count
        }

    def _hold(self, pool: PagePool, route: int, chunks: dict[str, int]) -> None:
        with self._lock:
            # A reconfigure or release while we worked means the route is gone.
            if self._pool is pool and route in pool.routes():
                self._held.setdefault(route, {}).update(chunks)

    def _sync(self, *, advertise: bool) -> dict[str, int]:
        with self._sync_lock:
            with self._lock:
                pool = self._pool
                live = set(pool.routes()) if pool is not None else set()
                for r in [r for r in self._held if r not in live]:
                    del self._held[r]
                want: dict[str, int] = {}
                if advertise:
                    for held in self._held.values():
                        want.update(held)
            present = set(self.catalog.replicas_at(self.location))
            stale = sorted(present - want.keys())
            withdrawn = 0
            if stale:
                withdrawn = self.catalog.remove_replicas(
                    self.location,
                    stale,
                    reason="not resident in this worker's page pool",
                    actor=self.location,
                )
            advertised = 0
            for key in sorted(want.keys() - present):
                receipt = ReplicaReceipt(
                    location=self.location,
                    tier="resident",
                    size=want[key],
                    checksum="resident",
                    stored_at=_now(),
                    worker=self.worker_id,
                )
                try:
                    self.catalog.record_replica(
                        key, receipt, namespace=self.namespace, actor=self.location
                    )
                    advertised += 1
                except NotFoundError:
                    # The chunk left the catalog (GC, quarantine purge): nothing to advertise.
                    log.info("chunk %s is no longer catalogued; not advertising it", key)
                    self._forget(key)
            return {"advertised": advertised, "withdrawn": withdrawn}

    def _forget(self, key: str) -> None:
        with self._lock:
            for held in self._held.values():
                held.pop(key, None)

    @contextmanager
    def _errors_as(self, op: str) -> Iterator[None]:
        """Turn library errors into DaemonErrors with an HTTP status, and remember the last few."""
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
                {"at": _now().isoformat(), "op": op, "status": err.status, "error": err.message}
            )


def _is_hex(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s.lower())


def _translate(op: str, exc: Exception) -> DaemonError:
    # Order matters: UnknownRouteError is a RestoreError, IdentityError a CatalogError.
    if isinstance(exc, UnknownRouteError):
        return DaemonError(404, str(exc), field="route")
    if isinstance(exc, PoolExhaustedError):
        return DaemonError(507, str(exc))
    if isinstance(exc, CheckpointBusyError):
        return DaemonError(503, str(exc))
    if isinstance(exc, RestoreError):
        return DaemonError(409, str(exc))
    if isinstance(exc, NotFoundError):
        return DaemonError(404, str(exc))
    if isinstance(exc, IdentityError):
        return DaemonError(422, str(exc))
    if isinstance(exc, CatalogError):
        return DaemonError(409, str(exc))
    if isinstance(exc, ChunkStoreError):
        return DaemonError(503, f"store error: {exc}")
    if isinstance(exc, ValueError):
        return DaemonError(422, str(exc))
    # Unexpected: the traceback goes to the daemon's log, never to the client.
    log.error("%s failed", op, exc_info=exc)
    return DaemonError(
        500, f"internal error during {op} ({type(exc).__name__}); see the daemon log"
    )


def _field(loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    # Union members appear in the location (e.g. "str", "dict[str,any]"): not a field name.
    parts = [p for p in parts if p.isidentifier() or p.isdigit()]
    return ".".join(parts) or "body"


def create_daemon_app(daemon: Daemon) -> FastAPI:
    """The daemon's HTTP API (see docs/daemon.md); serve it on loopback."""
    app = FastAPI(
        title="kvc daemon",
        version=__version__,
        summary="Checkpoint and restore a page pool's routes through the kvc catalog.",
    )

    @app.exception_handler(DaemonError)
    async def _daemon_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DaemonError)
        body: dict[str, Any] = {"error": exc.message}
        if exc.field is not None:
            body["field"] = exc.field
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems: list[str] = []
        fields: list[str] = []
        for e in exc.errors():
            name = _field(e.get("loc", ()))
            if e.get("type") == "json_invalid":
                name = "body"
            if name not in fields:
                fields.append(name)
            # The message only: echoing the input could repeat a whole prompt.
            problems.append(f"{name}: {e.get('msg', 'invalid')}")
        return JSONResponse(
            {"error": "invalid request: " + "; ".join(problems[:5]), "fields": fields},
            status_code=422,
        )

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        stats = daemon.stats()
        return JSONResponse(
            {"ok": True, "worker": daemon.worker_id, "configured": stats["configured"]}
        )

    @app.get("/v1/stats")
    def stats() -> JSONResponse:
        return JSONResponse(daemon.stats())

    @app.post("/v1/configure")
    def configure(body: ConfigureRequest) -> JSONResponse:
        return JSONResponse(daemon.configure(body.fingerprint, body.num_pages, body.page_size))

    @app.post("/v1/prefill")
    def prefill(body: PrefillRequest) -> JSONResponse:
        return JSONResponse(daemon.prefill(body.tokens, body.route))

    @app.post("/v1/checkpoint")
    def checkpoint(body: CheckpointRequest) -> JSONResponse:
        return JSONResponse(daemon.checkpoint(body.route, body.tokens, body.name, body.pending))

    @app.post("/v1/restore", response_model=None)
    def restore(body: RestoreRequest) -> Response:
        result = daemon.restore(body.tokens)
        if result is None:
            return Response(status_code=204)
        return JSONResponse(result)

    @app.post("/v1/release")
    def release(body: RouteRequest) -> JSONResponse:
        return JSONResponse(daemon.release(body.route))

    @app.post("/v1/clear")
    def clear() -> JSONResponse:
        return JSONResponse(daemon.clear())

    @app.post("/v1/refresh")
    def refresh() -> JSONResponse:
        return JSONResponse(daemon.refresh())

    return app
