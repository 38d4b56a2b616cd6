"""The page pool: preallocated paged KV memory, routes, copy-on-write forks, leases and eviction.

Storage layout (other code writes into it directly; do not change it lightly):
`PagePool.kv` is ONE numpy array shaped

    [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]

layer-major, axis 1 is K (0) then V (1), in the layout's numpy dtype (raw
uint16 bit patterns for bfloat16). Page `p` of layer `l` is `kv[l, :, p]`;
token slot `s` of page `p` is `kv[:, :, p, s]`. Layer-major because restoring a
chunk stored as `[L, 2, T, H, D]` is then a loop of plain slice copies
`kv[:, :, p, a:b] = payload[:, :, s:e]` (about 3x faster than fancy indexing
into a page-major pool). The array is allocated and touched (`fill(0)`) at
construction: fresh memory page-faults at about 1.2 GB/s on first write,
touched memory copies at 15+ GB/s, and a restore should only pay the latter.

A route is one live sequence: a page table and a length; position `i` lives in
slot `i % page_size` of page `table[i // page_size]`. Pages are refcounted by
their holders: routes, open leases and reservations. A page held twice is
never written: appending to a route whose partial last page is shared copies
that page first (copy-on-write). Slots past a route's length are garbage.

`Lease` (a route's snapshot) is in `restore.lease`; the loops that copy
positions into and out of pages are in `restore.pages`.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from catalog import AttentionLayout
from restore.errors import PoolExhaustedError, UnknownRouteError
from restore.lease import Lease, LeaseState
from restore.pages import (
    check_int,
    check_range,
    check_tokens,
    copy_in,
    copy_out_kv,
    flat_slots,
    page_runs,
)

__all__ = ["Lease", "PagePool"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Route:
    pages: list[int] = field(default_factory=list)
    length: int = 0
    pins: int = 0
    leases: int = 0
    protected: bool = False
    durable: int = 0
    # Unvalued routes are worth nothing, so eviction among them is plain LRU.
    reuse: float = 0.0
    cost: float = 1.0
    # Live demand for the route's prefix (summed priority of the workers that declared it).
    demand: float = 0.0
    last_used: int = 0

    @property
    def value(self) -> float:
        """What evicting the route loses: (reuse likelihood + demand) x tokens x cost per token."""
        return (self.reuse + self.demand) * self.length * self.cost


class PagePool:
    """Preallocated KV memory cut into pages of `page_size` tokens; see the module docstring.

    Every method is thread-safe (one internal lock). Route ids are ints that
    are never reused within a pool.
    """

    def __init__(self, layout: AttentionLayout, page_size: int = 16, *, num_pages: int) -> None:
        if not isinstance(layout, AttentionLayout):
            raise TypeError(f"layout must be an AttentionLayout, got {type(layout).__name__}")
        self._layout = layout
        self._page_size = check_int("page_size", page_size, 1)
        self._num_pages = check_int("num_pages", num_pages, 1)
        self._dtype = layout.numpy_dtype
        self._kv: np.ndarray[Any, Any] = np.empty(
            (
                layout.num_layers,
                2,
                self._num_pages,
                self._page_size,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=self._dtype,
        )
        # Touch every byte now so restores copy at memory speed, not page-fault speed.
        self._kv.fill(0)
        self._lock = threading.Lock()
        self._refcount: list[int] = [0] * self._num_pages
        # A stack popping the lowest page first keeps fresh pools' tables contiguous.
        self._free: list[int] = list(range(self._num_pages - 1, -1, -1))
        self._routes: dict[int, _Route] = {}
        self._leases: dict[int, LeaseState] = {}
        self._reserved: set[int] = set()
        self._route_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._clock = itertools.count(1)

    # -- geometry ----------------------------------------------------------------

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of `kv` (uint16 holding raw bits for bfloat16)."""
        return self._dtype

    @property
    def kv(self) -> np.ndarray[Any, Any]:
        """The storage array. Write only into pages you hold alone (reserved pages)."""
        return self._kv

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def refcount(self, page: int) -> int:
        """How many holders (routes, leases, reservations) a page has."""
        page = check_int("page", page)
        if page >= self._num_pages:
            raise ValueError(f"page {page} is not in [0, {self._num_pages})")
        with self._lock:
            return self._refcount[page]

    # -- routes ------------------------------------------------------------------

    def new_route(self) -> int:
        """Create an empty route and return its id."""
        with self._lock:
            rid = next(self._route_ids)
            self._routes[rid] = _Route(last_used=next(self._clock))
            return rid

    def routes(self) -> list[int]:
        with self._lock:
            return sorted(self._routes)

    def length(self, route: int) -> int:
        with self._lock:
            return self._get(route).length

    def page_table(self, route: int) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._get(route).pages)

    def append(self, route: int, k: np.ndarray[Any, Any], v: np.ndarray[Any, Any]) -> None:
        """Append `n` positions: `k` and `v` shaped `[num_layers, n, num_kv_heads, head_dim]`.

        Raises `PoolExhaustedError` (changing nothing) when the free pages do
        not cover the new pages plus a copy of a shared partial tail page.
        """
        n = check_tokens(self._layout, k, v)
        with self._lock:
            r = self._get(route)
            r.last_used = next(self._clock)
            if n == 0:
                return
            ps = self._page_size
            used = r.length % ps
            cow = used != 0 and self._refcount[r.pages[-1]] > 1
            grow = math.ceil((r.length + n) / ps) - len(r.pages)
            need = grow + int(cow)
            if need > len(self._free):
                raise PoolExhaustedError(
                    f"appending {n} positions to route {route} needs {need} free pages"
                    f"{' (one to copy a shared tail page)' if cow else ''}, "
                    f"{len(self._free)} are free (shortfall {need - len(self._free)})",
                    needed=need,
                    available=len(self._free),
                )
            if cow:
                old = r.pages[-1]
                new = self._alloc()
                self._kv[:, :, new, :used] = self._kv[:, :, old, :used]
                r.pages[-1] = new
                self._decref(old)
            r.pages.extend(self._alloc() for _ in range(grow))
            copy_in(self._kv, r.pages, r.length, k, v, self._page_size)
            r.length += n

    def read(
        self, route: int, start: int = 0, end: int | None = None
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """K and V copies of positions `[start, end)`, each `[num_layers, end-start, H, D]`."""
        with self._lock:
            r = self._get(route)
            start, end = check_range(start, end, r.length)
            r.last_used = next(self._clock)
            kv = copy_out_kv(self._kv, self._layout, r.pages, start, end, self._page_size)
        return kv[:, 0], kv[:, 1]

    def fork(self, route: int, at: int | None = None) -> int:
        """A new route sharing the first `at` positions of `route` (default: all of them).

        Full pages are shared by refcount; a partial last page is shared too and
        copied by whichever side appends to it first. The fork inherits the
        durable mark up to `at`, not pins, protection or value.
        """
        with self._lock:
            r = self._get(route)
            at = r.length if at is None else check_int("at", at)
            if at > r.length:
                raise ValueError(
                    f"cannot fork route {route} at {at}: it holds {r.length} positions"
                )
            pages = r.pages[: math.ceil(at / self._page_size)]
            for p in pages:
                self._refcount[p] += 1
            now = next(self._clock)
            r.last_used = now
            rid = next(self._route_ids)
            self._routes[rid] = _Route(
                pages=list(pages), length=at, durable=min(r.durable, at), last_used=now
            )
            return rid

    def truncate(self, route: int, n: int) -> None:
        """Drop positions `>= n`; pages no longer needed lose this route's reference."""
        n = check_int("n", n)
        with self._lock:
            r = self._get(route)
            if n > r.length:
                raise ValueError(
                    f"cannot truncate route {route} to {n}: it holds {r.length} positions"
                )
            keep = math.ceil(n / self._page_size)
            self._drop(r.pages[keep:])
            del r.pages[keep:]
            r.length = n
            r.durable = min(r.durable, n)

    def release(self, route: int) -> None:
        """Drop the route; its pages lose a reference (open leases keep theirs)."""
        with self._lock:
            self._release(route)

    # -- leases ------------------------------------------------------------------

    def lease(self, route: int) -> Lease:
        """Snapshot the route as it is now; the references are taken here, dropped on close/exit.

        `with pool.lease(route) as snap: k, v = snap.read(a, b)`.
        """
        with self._lock:
            r = self._get(route)
            for p in r.pages:
                self._refcount[p] += 1
            r.leases += 1
            lid = next(self._lease_ids)
            state = LeaseState(route, tuple(r.pages), r.length)
            self._leases[lid] = state
        return Lease(self, lid, state)

    def _lease_closed(self, lease_id: int) -> bool:
        with self._lock:
            return lease_id not in self._leases

    def _close_lease(self, lease_id: int) -> None:
        with self._lock:
            state = self._leases.pop(lease_id, None)
            if state is None:
                return
            self._drop(state.pages)
            r = self._routes.get(state.route)
            if r is not None:
                r.leases -= 1

    # -- eviction policy inputs --------------------------------------------------

    def pin(self, route: int) -> None:
        """Keep the route from eviction until a matching `unpin` (pins nest)."""
        with self._lock:
            self._get(route).pins += 1

    def unpin(self, route: int) -> None:
        with self._lock:
            r = self._get(route)
            if r.pins == 0:
                raise ValueError(f"route {route} is not pinned")
            r.pins -= 1

    def protect(self, route: int, flag: bool = True) -> None:
        """Mark the route as never evictable (or clear the mark)."""
        with self._lock:
            self._get(route).protected = bool(flag)

    def mark_durable(self, route: int, upto: int) -> None:
        """Positions `< upto` are checkpointed; a route with positions past its mark is never evicted.

        The mark only moves forward (truncate pulls it back to the new length).
        """
        upto = check_int("upto", upto)
        with self._lock:
            r = self._get(route)
            if upto > r.length:
                raise ValueError(
                    f"route {route} holds {r.length} positions, cannot mark {upto} durable"
                )
            r.durable = max(r.durable, upto)

    def set_value(
        self, route: int, reuse_likelihood: float, recompute_cost_per_token: float
    ) -> None:
        """Eviction value of the route: reuse likelihood in [0, 1] and recompute cost per token (>= 0)."""
        reuse = float(reuse_likelihood)
        cost = float(recompute_cost_per_token)
        if not 0.0 <= reuse <= 1.0:
            raise ValueError(f"reuse_likelihood must be in [0, 1], got {reuse_likelihood!r}")
        if not (math.isfinite(cost) and cost >= 0.0):
            raise ValueError(
                f"recompute_cost_per_token must be finite and >= 0, got {recompute_cost_per_token!r}"
            )
        with self._lock:
            r = self._get(route)
            r.reuse = reuse
            r.cost = cost

    def set_demand(self, route: int, demand: float) -> None:
        """The live demand for the route's prefix (>= 0; the catalog's `demand`), added to its
        reuse likelihood in the eviction value: a demanded route outlives an undemanded one."""
        value = float(demand)
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"demand must be finite and >= 0, got {demand!r}")
        with self._lock:
            self._get(route).demand = value

    def evict(self, pages_needed: int) -> list[int]:
        """Release whole routes, lowest value per freed page first, until `pages_needed` pages are freed.

        Value = (reuse likelihood + demand) x tokens x recompute cost per token; a page
        another holder keeps frees nothing; ties go to the least recently used.
        Pinned, leased, protected and not-yet-durable routes are never touched.
        Returns the evicted route ids in order; raises `PoolExhaustedError`
        (changing nothing) when even every evictable route would not be enough.
        """
        needed = check_int("pages_needed", pages_needed)
        with self._lock:
            if needed == 0:
                return []
            chosen, freed = self._plan_eviction(needed)
            if freed < needed:
                raise PoolExhaustedError(
                    f"eviction can free {freed} of the {needed} pages needed (shortfall {needed - freed}); "
                    "the rest is held by pinned, leased, protected or not-yet-durable routes, "
                    "leases or reservations",
                    needed=needed,
                    available=freed,
                )
            for rid in chosen:
                self._release(rid)
            log.debug("evicted routes %s to free %d pages", chosen, freed)
            return chosen

    def _evictable(self, r: _Route) -> bool:
        return r.pins == 0 and r.leases == 0 and not r.protected and r.durable >= r.length

    def _plan_eviction(self, needed: int) -> tuple[list[int], int]:
        # Greedy on simulated refcounts, so that nothing changes unless the plan suffices.
        rc = list(self._refcount)
        cands = {rid: r for rid, r in self._routes.items() if r.pages and self._evictable(r)}
        chosen: list[int] = []
        freed = 0
        while freed < needed and cands:
            best: tuple[float, int, int] | None = None
            for rid, r in cands.items():
                frees = sum(1 for p in r.pages if rc[p] == 1)
                if frees:
                    key = (r.value / frees, r.last_used, rid)
                    if best is None or key < best:
                        best = key
            if best is None:
                # Every remaining candidate shares all its pages (a fork and its
                # parent, say): none frees anything alone, a group might. Take the
                # lowest-value one whose pages only candidates hold.
                held = Counter(p for r in cands.values() for p in r.pages)
                for rid, r in cands.items():
                    if any(rc[p] == held[p] for p in r.pages):
                        key = (r.value, r.last_used, rid)
                        if best is None or key < best:
                            best = key
            if best is None:
                break
            rid = best[2]
            for p in cands.pop(rid).pages:
                rc[p] -= 1
                freed += rc[p] == 0
            chosen.append(rid)
        return chosen, freed

    # -- restore path ------------------------------------------------------------

    def reserve_pages(self, n_pages: int) -> list[int]:
        """Allocate pages outside any route, held by the caller, who may write them via `kv`.

        Hand them to a route with `attach`, or back with `free_reserved`.
        """
        n = check_int("n_pages", n_pages)
        with self._lock:
            if n > len(self._free):
                raise PoolExhaustedError(
                    f"reserving {n} pages: {len(self._free)} are free (shortfall {n - len(self._free)})",
                    needed=n,
                    available=len(self._free),
                )
            pages = [self._alloc() for _ in range(n)]
            self._reserved.update(pages)
            return pages

    def write_pages(self, pages: Sequence[int], start: int, kv: np.ndarray[Any, Any]) -> None:
        """Copy `kv` (`[L, 2, T, H, D]`, a blob payload's layout) to positions `[start, start + T)`
        of the page table `pages`, which must be pages the caller holds alone (reserved ones).

        Plain slice copies into the layer-major pool, one per run of consecutive pages (one
        for a fresh pool's table): no fancy indexing, no lock, and few GIL hand-offs for the
        restore threads copying side by side.
        """
        flat = flat_slots(self._kv)
        for at, n, s in page_runs(pages, start, start + kv.shape[2], self._page_size):
            flat[:, :, at : at + n] = kv[:, :, s : s + n]

    def attach(
        self, route: int, pages: Iterable[int], length: int, *, durable: bool = True
    ) -> None:
        """Make reserved `pages` the page table of the EMPTY `route`, holding `length` positions.

        The route takes over the reservation. `durable` (default) marks all
        positions checkpointed: restored pages came from the store.
        """
        table = [int(p) for p in pages]
        length = check_int("length", length)
        with self._lock:
            r = self._get(route)
            if r.length or r.pages:
                raise ValueError(
                    f"attach needs an empty route; route {route} holds {r.length} positions"
                )
            self._check_reserved(table)
            if len(table) != math.ceil(length / self._page_size):
                raise ValueError(
                    f"{length} positions need {math.ceil(length / self._page_size)} pages "
                    f"of {self._page_size}, got {len(table)}"
                )
            self._reserved.difference_update(table)
            r.pages = table
            r.length = length
            r.durable = length if durable else 0
            r.last_used = next(self._clock)

    def free_reserved(self, pages: Iterable[int]) -> None:
        """Return reserved pages to the free list (all or none)."""
        table = [int(p) for p in pages]
        with self._lock:
            self._check_reserved(table)
            self._reserved.difference_update(table)
            self._drop(table)

    def _check_reserved(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} contain duplicates")
        missing = [p for p in pages if p not in self._reserved]
        if missing:
            raise ValueError(f"pages {missing} are not reserved")

    # -- invariants --------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError with detail if the pool's bookkeeping is inconsistent (ARCHITECTURE 7)."""
        with self._lock:
            ps = self._page_size
            held: Counter[int] = Counter()
            for rid, r in self._routes.items():
                if len(set(r.pages)) != len(r.pages):
                    raise AssertionError(f"route {rid} holds a page twice: {r.pages}")
                if r.pages:
                    ok = (len(r.pages) - 1) * ps < r.length <= len(r.pages) * ps
                else:
                    ok = r.length == 0
                if not ok:
                    raise AssertionError(
                        f"route {rid} length {r.length} does not fit {len(r.pages)} pages of {ps}"
                    )
                if not 0 <= r.durable <= r.length:
                    raise AssertionError(
                        f"route {rid} durable mark {r.durable} outside [0, {r.length}]"
                    )
                if r.pins < 0 or r.leases < 0:
                    raise AssertionError(f"route {rid} has pins={r.pins} leases={r.leases}")
                held.update(r.pages)
            leases_on: Counter[int] = Counter()
            for lid, s in self._leases.items():
                if len(s.pages) != math.ceil(s.length / ps) or len(set(s.pages)) != len(s.pages):
                    raise AssertionError(f"lease {lid} has {s.pages} for {s.length} positions")
                held.update(s.pages)
                leases_on[s.route] += 1
            for rid, r in self._routes.items():
                if r.leases != leases_on[rid]:
                    raise AssertionError(
                        f"route {rid} counts {r.leases} leases, {leases_on[rid]} are open"
                    )
            held.update(self._reserved)
            bad = {
                p: (self._refcount[p], held[p])
                for p in range(self._num_pages)
                if self._refcount[p] != held[p]
            }
            if bad:
                raise AssertionError(
                    f"page refcount != holders for (page: (refcount, holders)) {bad}"
                )
            if len(set(self._free)) != len(self._free):
                raise AssertionError(f"free list has duplicates: {self._free}")
            zero = {p for p in range(self._num_pages) if self._refcount[p] == 0}
            if set(self._free) != zero:
                raise AssertionError(
                    f"free pages {sorted(self._free)} are not the refcount-0 pages {sorted(zero)}"
                )

    # -- internals (call with the lock held) -------------------------------------

    def _get(self, route: int) -> _Route:
        try:
            return self._routes[route]
        except (KeyError, TypeError):
            raise UnknownRouteError(f"no route {route!r} in this pool") from None

    def _release(self, route: int) -> None:
        r = self._get(route)
        del self._routes[route]
        self._drop(r.pages)

    def _alloc(self) -> int:
        p = self._free.pop()
        self._refcount[p] = 1
        return p

    def _drop(self, pages: Sequence[int]) -> None:
        """Drop a reference to each of `pages`, last first: the free stack then hands freed
        pages out again in their old order, so a table that was contiguous stays contiguous
        (and its chunks copy as one run, not page by page)."""
        for p in reversed(pages):
            self._decref(p)

    def _decref(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free.append(page)
