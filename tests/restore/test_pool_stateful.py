"""Page pool against a plain model: random appends, forks, truncates, leases, pins and evictions."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from catalog import AttentionLayout
from restore.errors import PoolExhaustedError, UnknownRouteError
from restore.pool import Lease, PagePool

LAYERS, HEADS, DIM, PS, PAGES = 2, 2, 4, 4, 8

Arr = np.ndarray[Any, Any]


def _same(a: Arr, b: Arr) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


class PoolMachine(RuleBasedStateMachine):
    dtype = "float16"

    routes = Bundle("routes")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(
            AttentionLayout(LAYERS, HEADS, DIM, self.dtype),  # type: ignore[arg-type]
            page_size=PS,
            num_pages=PAGES,
        )
        # route -> (K, V), each [L, n, H, D]: what the route must read back.
        self.model: dict[int, tuple[Arr, Arr]] = {}
        self.pins: Counter[int] = Counter()
        self.protected: set[int] = set()
        self.durable: dict[int, int] = {}
        # id(lease) -> (lease, frozen K, frozen V)
        self.snapshots: dict[int, tuple[Lease, Arr, Arr]] = {}
        # Bytes of every page held twice after the previous step.
        self.shared_before: dict[int, bytes] = {}

    # -- helpers -----------------------------------------------------------------

    def _tokens(self, n: int, seed: int) -> tuple[Arr, Arr]:
        rng = np.random.default_rng(seed)
        shape = (LAYERS, n, HEADS, DIM)
        if self.dtype == "bfloat16":
            bits = rng.integers(0, 0x10000, size=(2, *shape)).astype(np.uint16)
            # Flip an exponent bit where it is all ones: no Inf or NaN patterns.
            inf_nan = (bits & 0x7F80) == 0x7F80
            bits[inf_nan] ^= 0x0080
            return bits[0], bits[1]
        kv = rng.standard_normal((2, *shape)).astype(self.pool.dtype)
        kv[rng.random((2, *shape)) < 0.05] = -0.0  # signed zeros must survive bit-exactly
        return kv[0], kv[1]

    def _alive(self, route: int) -> bool:
        if route in self.model:
            return True
        with pytest.raises(UnknownRouteError):
            self.pool.length(route)
        return False

    def _state(self) -> tuple[object, ...]:
        tables = {r: (self.pool.length(r), self.pool.page_table(r)) for r in self.pool.routes()}
        return self.pool.free_pages, tables, self.pool.kv.tobytes()

    def _leased_routes(self) -> Counter[int]:
        return Counter(lease.route for lease, _, _ in self.snapshots.values())

    def _evictable(self, route: int) -> bool:
        length = self.model[route][0].shape[1]
        return (
            self.pins[route] == 0
            and self._leased_routes()[route] == 0
            and route not in self.protected
            and self.durable[route] >= length
        )

    def _max_freeable(self) -> int:
        """Pages whose every holder is an evictable route: what evicting them all would free."""
        holders: dict[int, list[bool]] = {}
        for r in self.model:
            for p in self.pool.page_table(r):
                holders.setdefault(p, []).append(self._evictable(r))
        for lease, _, _ in self.snapshots.values():
            for p in lease.pages:
                holders.setdefault(p, []).append(False)
        return sum(all(hs) for hs in holders.values())

    def _add(self, route: int, k: Arr, v: Arr, durable: int = 0) -> int:
        self.model[route] = (k, v)
        self.durable[route] = durable
        return route

    def _forget(self, route: int) -> None:
        del self.model[route]
        del self.durable[route]
        self.pins.pop(route, None)
        self.protected.discard(route)

    # -- rules -------------------------------------------------------------------

    @rule(target=routes)
    def new_route(self) -> int:
        empty = np.empty((LAYERS, 0, HEADS, DIM), dtype=self.pool.dtype)
        return self._add(self.pool.new_route(), empty, empty.copy())

    @rule(
        route=routes,
        n=st.integers(1, 7),
        seed=st.integers(0, 2**32 - 1),
        checkpointed=st.booleans(),
    )
    def append(self, route: int, n: int, seed: int, checkpointed: bool) -> None:
        if self._alive(route):
            self._append(route, n, seed, checkpointed)

    def _append(self, route: int, n: int, seed: int, checkpointed: bool) -> None:
        k, v = self._tokens(n, seed)
        length = self.pool.length(route)
        table = self.pool.page_table(route)
        cow = length % PS != 0 and self.pool.refcount(table[-1]) > 1
        need = math.ceil((length + n) / PS) - len(table) + int(cow)
        if need > self.pool.free_pages:
            before = self._state()
            with pytest.raises(PoolExhaustedError) as info:
                self.pool.append(route, k, v)
            assert info.value.shortfall == need - self.pool.free_pages
            assert self._state() == before
            return
        self.pool.append(route, k, v)
        mk, mv = self.model[route]
        self.model[route] = (np.concatenate([mk, k], axis=1), np.concatenate([mv, v], axis=1))
        if checkpointed:  # a write-behind checkpoint caught up: the route becomes evictable
            self.pool.mark_durable(route, length + n)
            self.durable[route] = length + n

    @rule(target=routes, route=routes, data=st.data())
    def fork(self, route: int, data: st.DataObject) -> Any:
        if not self._alive(route):
            return multiple()
        mk, mv = self.model[route]
        length = mk.shape[1]
        at = data.draw(st.none() | st.integers(0, length + 2), label="at")
        if at is not None and at > length:
            before = self._state()
            with pytest.raises(ValueError):
                self.pool.fork(route, at=at)
            assert self._state() == before
            return multiple()
        child = self.pool.fork(route, at=at)
        end = length if at is None else at
        return self._add(
            child, mk[:, :end].copy(), mv[:, :end].copy(), min(self.durable[route], end)
        )

    @rule(route=routes, data=st.data())
    def truncate(self, route: int, data: st.DataObject) -> None:
        if not self._alive(route):
            return
        mk, mv = self.model[route]
        n = data.draw(st.integers(0, mk.shape[1]), label="n")
        self.pool.truncate(route, n)
        self.model[route] = (mk[:, :n], mv[:, :n])
        self.durable[route] = min(self.durable[route], n)

    @rule(route=consumes(routes))
    def release(self, route: int) -> None:
        if not self._alive(route):
            return
        self.pool.release(route)
        self._forget(route)

    @rule(
        target=leases,
        route=routes,
        decode=st.integers(0, 6),
        seed=st.integers(0, 2**32 - 1),
        checkpointed=st.booleans(),
    )
    def open_lease(self, route: int, decode: int, seed: int, checkpointed: bool) -> Any:
        if not self._alive(route):
            return multiple()
        lease = self.pool.lease(route)
        mk, mv = self.model[route]
        self.snapshots[id(lease)] = (lease, mk.copy(), mv.copy())
        if decode:  # the route keeps decoding while a capture holds the lease
            self._append(route, decode, seed, checkpointed)
        return lease

    @rule(lease=consumes(leases))
    def close_lease(self, lease: Lease) -> None:
        lease.close()
        del self.snapshots[id(lease)]

    @rule(route=routes, pin=st.booleans())
    def pin_or_unpin(self, route: int, pin: bool) -> None:
        if not self._alive(route):
            return
        if pin:
            self.pool.pin(route)
            self.pins[route] += 1
        elif self.pins[route] == 0:
            with pytest.raises(ValueError):
                self.pool.unpin(route)
        else:
            self.pool.unpin(route)
            self.pins[route] -= 1

    @rule(route=routes, flag=st.booleans())
    def protect(self, route: int, flag: bool) -> None:
        if self._alive(route):
            self.pool.protect(route, flag)
            (self.protected.add if flag else self.protected.discard)(route)

    @rule(route=routes, data=st.data())
    def mark_durable(self, route: int, data: st.DataObject) -> None:
        if not self._alive(route):
            return
        length = self.model[route][0].shape[1]
        # Mostly the whole route: otherwise few routes ever become evictable.
        upto = data.draw(st.just(length) | st.integers(0, length), label="upto")
        self.pool.mark_durable(route, upto)
        self.durable[route] = max(self.durable[route], upto)

    @rule(
        route=routes,
        reuse=st.floats(0.0, 1.0),
        cost=st.floats(0.0, 10.0),
    )
    def set_value(self, route: int, reuse: float, cost: float) -> None:
        if self._alive(route):
            self.pool.set_value(route, reuse, cost)

    # Only with pages in use: an idle evict rule would crowd out the rest.
    @precondition(lambda self: self.pool.free_pages < PAGES)
    @rule(n=st.integers(1, 3) | st.integers(1, PAGES))
    def evict(self, n: int) -> None:
        freeable = self._max_freeable()
        free = self.pool.free_pages
        before = self._state()
        if freeable < n:
            with pytest.raises(PoolExhaustedError) as info:
                self.pool.evict(n)
            assert (info.value.needed, info.value.shortfall) == (n, n - freeable)
            assert self._state() == before
            return
        evicted = self.pool.evict(n)
        assert len(set(evicted)) == len(evicted)
        for r in evicted:
            assert self._evictable(r), (
                f"evicted route {r} was pinned, leased, protected or not durable"
            )
            self._forget(r)
        assert self.pool.free_pages >= free + n

    @rule(
        target=routes,
        n=st.integers(1, 10),
        seed=st.integers(0, 2**32 - 1),
        durable=st.booleans(),
        give_back=st.booleans(),
    )
    def reserve_fill_attach(self, n: int, seed: int, durable: bool, give_back: bool) -> Any:
        need = math.ceil(n / PS)
        if need > self.pool.free_pages:
            before = self._state()
            with pytest.raises(PoolExhaustedError):
                self.pool.reserve_pages(need)
            assert self._state() == before
            return multiple()
        pages = self.pool.reserve_pages(need)
        k, v = self._tokens(n, seed)
        payload = np.stack([k, v], axis=1)  # [L, 2, T, H, D], as a stored chunk
        for i, p in enumerate(pages):
            a, b = i * PS, min((i + 1) * PS, n)
            self.pool.kv[:, :, p, : b - a] = payload[:, :, a:b]
        if give_back:
            self.pool.free_reserved(pages)
            return multiple()
        route = self.pool.new_route()
        self.pool.attach(route, pages, n, durable=durable)
        return self._add(route, k, v, n if durable else 0)

    # -- invariants --------------------------------------------------------------

    @invariant()
    def pool_matches_model(self) -> None:
        pool = self.pool
        pool.check_invariants()
        # A page held twice is never written: every page shared before this
        # step that is still allocated holds the same bytes.
        for p, before in self.shared_before.items():
            if pool.refcount(p) > 0:
                assert pool.kv[:, :, p].tobytes() == before, f"shared page {p} was written"
        assert pool.routes() == sorted(self.model)
        for r, (mk, mv) in self.model.items():
            assert pool.length(r) == mk.shape[1]
            k, v = pool.read(r)
            assert _same(k, mk) and _same(v, mv), f"route {r} does not read its model"
        for lease, sk, sv in self.snapshots.values():
            assert not lease.closed
            k, v = lease.read()
            assert _same(k, sk) and _same(v, sv), f"lease on route {lease.route} changed"
        self.shared_before = {
            p: pool.kv[:, :, p].tobytes() for p in range(PAGES) if pool.refcount(p) > 1
        }

    def teardown(self) -> None:
        for lease, _, _ in self.snapshots.values():
            lease.close()
        for r in list(self.model):
            self.pool.release(r)
        assert self.pool.free_pages == PAGES
        self.pool.check_invariants()


class Bfloat16PoolMachine(PoolMachine):
    dtype = "bfloat16"


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
Bfloat16PoolMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None
)

TestPagePoolFloat16 = PoolMachine.TestCase
TestPagePoolBfloat16 = Bfloat16PoolMachine.TestCase
