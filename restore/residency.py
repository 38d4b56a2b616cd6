"""Residency: keeping a worker's resident replicas and demand in the catalog in step with its page pool.

After a checkpoint or a restore, the chunks a route of the pool holds *whole*
are advertised in the catalog as replicas at `worker:<id>` in tier `resident`,
so that a planner (here or elsewhere) can prefer forking those pages to
fetching bytes. A route that leaves the pool (released, dropped by a
quarantine, or gone with a new pool) takes its replicas with it. The pool dies
with the process, so a worker starting under the same id first withdraws
every resident replica the catalog still credits it with (`reconcile`).

Quarantine invalidations addressed to this worker (ARCHITECTURE 9) drop the
routes holding those chunks: on `apply_invalidations`, and every interval on a
timer thread (`start_timer`).

The prefix a route holds is also *demanded* (ARCHITECTURE 9): the worker
declares it in the catalog (a GC root while live), and the catalog's summed
demand for each route's prefix becomes part of that route's eviction value in
the pool (`PagePool.set_demand`), so a prefix other workers need outlives one
nobody asked for.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from catalog import Fingerprint, prefix_hashes
from catalog.base import CatalogAPI
from catalog.clock import utcnow
from catalog.errors import CatalogError, NotFoundError
from catalog.models import Match, ReplicaReceipt
from restore.pool import PagePool

__all__ = ["DEFAULT_DEMAND_TTL_S", "HeldChunk", "Residency", "ResidentPrefix", "timer_interval"]

log = logging.getLogger(__name__)

DEFAULT_DEMAND_TTL_S = 900.0


def timer_interval(value: object) -> float:
    """`value` as an invalidation timer interval in seconds (0: no timer); ValueError otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            "invalidation_interval must be a finite number of seconds >= 0 (0 disables "
            f"the timer), got {value!r}"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """A chunk a route holds whole: the route's positions `[0, end)` are its prefix."""

    blob_key: str
    prefix_hash: bytes
    end: int
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class ResidentPrefix:
    """The longest leading run of a lookup's chunks one live route holds: fork it at `tokens`."""

    route: int
    tokens: int


class Residency:
    """What one worker's page pool holds, as the catalog sees it.

    The owner tells it which pool is current (`use_pool`) and which chunks a
    route holds after a checkpoint or restore (`hold`); it releases routes
    through `release`, `clear` and `apply_invalidations` so that its records
    never outlive a route. `sync` then makes the catalog's resident replicas
    at `location` exactly what the live routes hold, declares their demand and
    copies the catalog's demand into the pool's eviction values.

    Thread-safe. It calls the pool while holding its own lock, and the catalog
    only outside it; callers may hold their own lock around any call.
    `invalidation_stats()` counts the invalidation checks (timer or not).
    """

    def __init__(
        self,
        catalog: CatalogAPI,
        *,
        worker_id: str,
        namespace: str,
        chunk_size: int,
        demand_ttl_s: float = DEFAULT_DEMAND_TTL_S,
        demand_priority: float = 1.0,
    ) -> None:
        self.catalog = catalog
        self.worker_id = worker_id
        self.location = f"worker:{worker_id}"
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.demand_ttl_s = demand_ttl_s
        self.demand_priority = demand_priority
        self._lock = threading.RLock()
        # Syncs are serialised so one never withdraws what another just advertised.
        self._sync_lock = threading.Lock()
        # `apply_invalidations` calls move the event cursor: one reader at a time.
        self._invalidation_lock = threading.Lock()
        self._invalidated_seq = 0  # the last `invalidate` event applied
        self._pool: PagePool | None = None
        # route -> {blob key: chunk} of the chunks that route holds whole.
        self._held: dict[int, dict[str, HeldChunk]] = {}
        self._checks = self._failures = self._invalidated_routes = 0
        self._last_check: datetime | None = None
        self._interval = 0.0
        self._stop = threading.Event()
        self._withdraw_pending = False  # touched by the timer thread only
        self._timer: threading.Thread | None = None

    # -- the pool and its routes -------------------------------------------------

    @property
    def pool(self) -> PagePool | None:
        with self._lock:
            return self._pool

    def use_pool(self, pool: PagePool | None) -> None:
        """Make `pool` the current pool (None: no pool); nothing of the old one is held any more.

        Call `sync` after it to withdraw the old pool's replicas.
        """
        with self._lock:
            self._pool = pool
            self._held.clear()

    @property
    def resident_chunks(self) -> int:
        """How many distinct chunks the live routes hold whole."""
        with self._lock:
            return len({k for held in self._held.values() for k in held})

    def whole_chunks(self, fingerprint: Fingerprint, tokens: Sequence[int]) -> list[HeldChunk]:
        """The catalogued chunks exactly covering `tokens` (what a checkpoint of them made durable)."""
        exact = set(prefix_hashes(self.namespace, list(tokens), self.chunk_size))
        # A dummy pending token lets the lookup cover every checkpointed position.
        match = self.catalog.lookup(self.namespace, fingerprint, [*tokens, 0])
        # Filtering by our own prefix hashes keeps a longer sibling tail out.
        return [
            HeldChunk(c.blob_key, c.prefix_hash, c.token_start + c.token_count, c.stored_bytes)
            for c in match.chunks
            if c.prefix_hash in exact and c.tokens_used == c.token_count
        ]

    @staticmethod
    def restored_chunks(match: Match, restored_tokens: int) -> list[HeldChunk]:
        """The chunks of `match` a restore of its first `restored_tokens` positions loaded whole."""
        return [
            HeldChunk(c.blob_key, c.prefix_hash, c.token_start + c.token_count, c.stored_bytes)
            for c in match.chunks
            if c.tokens_used == c.token_count and c.token_start + c.token_count <= restored_tokens
        ]

    def hold(self, pool: PagePool, route: int, chunks: Iterable[HeldChunk]) -> None:
        """Record that `route` of `pool` holds `chunks` whole, and declare demand for its prefix.

        Ignored when the pool was replaced or the route released meanwhile.
        """
        with self._lock:
            if self._pool is not pool or route not in pool.routes():
                return
            held = self._held.setdefault(route, {})
            held.update((c.blob_key, c) for c in chunks)
            head = max(held.values(), key=lambda c: c.end, default=None)
        if head is not None:
            self._declare_demand(head.prefix_hash)

    def resident_prefix(self, match: Match) -> ResidentPrefix | None:
        """The live route holding the longest leading run of `match`'s chunks, if any."""
        best: ResidentPrefix | None = None
        with self._lock:
            pool = self._pool
            live = set(pool.routes()) if pool is not None else set()
            for route, held in self._held.items():
                if route not in live:
                    continue
                tokens = 0
                for c in match.chunks:
                    if c.blob_key not in held:
                        break
                    tokens = c.token_start + c.tokens_used
                if tokens and (best is None or tokens > best.tokens):
                    best = ResidentPrefix(route, tokens)
        return best

    def fork(self, pool: PagePool, route: int, tokens: int) -> int:
        """A new route sharing the first `tokens` positions of `route`; it holds what they cover.

        Raises `UnknownRouteError` if `route` is gone.
        """
        with self._lock:
            new = pool.fork(route, tokens)
            source = self._held.get(route, {})
            if self._pool is pool:
                self._held[new] = {k: c for k, c in source.items() if c.end <= tokens}
        return new

    def release(self, pool: PagePool, route: int) -> None:
        """Release `route` (`UnknownRouteError` if it is gone); call `sync` to withdraw its replicas."""
        with self._lock:
            pool.release(route)
            self._held.pop(route, None)

    def clear(self, pool: PagePool) -> list[int]:
        """Release every route of `pool`; returns their ids."""
        with self._lock:
            routes = pool.routes()
            for r in routes:
                pool.release(r)
            self._held.clear()
            return routes

    # -- the catalog -------------------------------------------------------------

    def reconcile(self) -> int:
        """Withdraw the resident replicas credited to this worker that it does not hold; how many.

        Call it on start: a new pool holds nothing, so every resident replica
        the catalog still lists for this worker is stale.
        """
        return self.sync(advertise=False)["withdrawn"]

    def sync(self, *, advertise: bool = True) -> dict[str, int]:
        """Make the catalog's replicas at `location` exactly what the live routes hold
        (nothing, without `advertise`); then refresh the routes' demand in the pool.

        Returns `{"advertised": n, "withdrawn": m}`.
        """
        with self._sync_lock:
            with self._lock:
                pool = self._pool
                live = set(pool.routes()) if pool is not None else set()
                for r in [r for r in self._held if r not in live]:
                    del self._held[r]
                want: dict[str, HeldChunk] = {}
                if advertise:
                    for held in self._held.values():
                        want.update(held)
            present = set(self.catalog.replicas_at(self.location, namespace=self.namespace))
            stale = sorted(present - want.keys())
            withdrawn = 0
            if stale:
                withdrawn = self.catalog.remove_replicas(
                    self.location,
                    stale,
                    reason="not resident in this worker's page pool",
                    namespace=self.namespace,
                    actor=self.location,
                )
            advertised = 0
            for key in sorted(want.keys() - present):
                receipt = ReplicaReceipt(
                    location=self.location,
                    tier="resident",
                    size=want[key].stored_bytes,
                    checksum="resident",
                    stored_at=utcnow(),
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
            if pool is not None:
                self.refresh_demand(pool)
            return {"advertised": advertised, "withdrawn": withdrawn}

    def refresh_demand(self, pool: PagePool) -> None:
        """Copy the catalog's live demand for each held route's prefix into the pool's eviction values."""
        with self._lock:
            if self._pool is not pool:
                return
            heads = {
                route: max(held.values(), key=lambda c: c.end).prefix_hash
                for route, held in self._held.items()
                if held
            }
        if not heads:
            return
        demand = self.catalog.demand(self.namespace, sorted(set(heads.values())))
        with self._lock:
            if self._pool is not pool:
                return
            live = set(pool.routes())
            for route, head in heads.items():
                if route in live:
                    pool.set_demand(route, demand.get(head, 0.0))

    def apply_invalidations(self) -> int:
        """Release every route holding a blob that a quarantine invalidated at this worker.

        Quarantine records one `invalidate` event per replica (ARCHITECTURE 9);
        the events addressed to `location` are read in order from the last one
        applied. Returns how many routes were released; call `sync` after it.
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
            # Under the lock every other route change takes: a dropped route is
            # never half-released, nor held again.
            with self._lock:
                pool = self._pool
                if bad and pool is not None:
                    for route, held in list(self._held.items()):
                        if bad & held.keys() and route in pool.routes():
                            pool.release(route)
                            del self._held[route]
                            dropped += 1
                self._checks += 1
                self._invalidated_routes += dropped
                self._last_check = utcnow()
            # Only now: a drop that raised is read again next time.
            self._invalidated_seq = seen
        if bad:
            log.info("dropped %d route(s) holding %d invalidated blob(s)", dropped, len(bad))
        return dropped

    # -- the invalidation timer ----------------------------------------------------

    def start_timer(self, interval: float) -> None:
        """Every `interval` seconds, on a daemon thread: `apply_invalidations`, then `sync`
        if it dropped anything. A failing round is logged and counted, and retried."""
        self._interval = timer_interval(interval)
        self._timer = threading.Thread(
            target=self._run_timer,
            name=f"kvc-daemon-invalidations[{self.location}]",
            daemon=True,
        )
        self._timer.start()

    def stop_timer(self, wait_s: float) -> None:
        """Stop the timer thread, waiting at most `wait_s` for a round stuck in a catalog call
        (a daemon thread: one that outlives the wait cannot keep the process alive)."""
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(wait_s)
            if timer.is_alive():
                log.warning(
                    "the invalidation timer of %s is still in a catalog call after %gs; "
                    "closing without it",
                    self.location,
                    wait_s,
                )

    def invalidation_stats(self) -> dict[str, Any]:
        """Checks made and routes dropped (by the timer or not), timer failures, the timer's state."""
        with self._lock:
            last = self._last_check
            return {
                "invalidation_timer": self._timer is not None and self._timer.is_alive(),
                "invalidation_checks": self._checks,
                "invalidation_failures": self._failures,
                "invalidated_routes": self._invalidated_routes,
                "last_invalidation_check": None if last is None else last.isoformat(),
            }

    def _run_timer(self) -> None:
        while not self._stop.wait(self._interval):
            self._tick()

    def _tick(self) -> None:
        """One timer round; never raises."""
        try:
            # A withdrawal that failed after its routes were dropped is retried on
            # the next tick, though that tick may drop nothing new.
            self._withdraw_pending = self.apply_invalidations() > 0 or self._withdraw_pending
            if self._withdraw_pending:
                self.sync()
                self._withdraw_pending = False
        except Exception as exc:
            # The class name only: a driver's message may carry a URL or a user name,
            # and the next tick retries from the same event cursor anyway.
            with self._lock:
                self._failures += 1
            log.warning(
                "invalidation check on %s failed (%s); retrying in %gs",
                self.location,
                exc.__class__.__name__,
                self._interval,
            )

    # -- internals -----------------------------------------------------------------

    def _forget(self, key: str) -> None:
        with self._lock:
            for held in self._held.values():
                held.pop(key, None)

    def _declare_demand(self, prefix_hash: bytes) -> None:
        try:
            self.catalog.declare_demand(
                self.worker_id,
                self.namespace,
                prefix_hash,
                priority=self.demand_priority,
                ttl_s=self.demand_ttl_s,
            )
        except CatalogError as exc:
            # Demand is advice to GC and eviction: the pages are loaded either way.
            log.warning("could not declare demand for %s: %s", prefix_hash.hex()[:16], exc)
