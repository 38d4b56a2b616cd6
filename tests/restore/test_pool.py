"""Page pool: routes, copy-on-write forks and leases, reserve/attach, eviction, refusal of bad input."""

from __future__ import annotations

import itertools
import pickle
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import AttentionLayout
from restore.errors import PoolExhaustedError, RestoreError, UnknownRouteError
from restore.pages import flat_slots, page_runs
from restore.pool import PagePool

LAYERS, HEADS, DIM, PS = 2, 2, 4, 4
LAYOUT = AttentionLayout(LAYERS, HEADS, DIM, "float16")
F16 = np.dtype(np.float16)


def _pool(num_pages: int = 8, dtype: str = "float16") -> PagePool:
    return PagePool(AttentionLayout(LAYERS, HEADS, DIM, dtype), page_size=PS, num_pages=num_pages)  # type: ignore[arg-type]


def _tokens(n: int, seed: int, dtype: np.dtype = F16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, n, HEADS, DIM)
    if dtype == np.uint16:  # bfloat16 bits with a finite exponent

        def gen() -> np.ndarray:
            return (rng.integers(0, 0x10000, size=shape) & ~0x4000).astype(np.uint16)

        return gen(), gen()
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def _filled(pool: PagePool, n: int, seed: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
    r = pool.new_route()
    k, v = _tokens(n, seed, pool.dtype)
    pool.append(r, k, v)
    return r, k, v


def _assert_reads(pool: PagePool, route: int, k: np.ndarray, v: np.ndarray) -> None:
    gk, gv = pool.read(route)
    assert gk.shape == k.shape
    assert np.array_equal(gk.view(np.uint8), k.view(np.uint8))
    assert np.array_equal(gv.view(np.uint8), v.view(np.uint8))


def _state(pool: PagePool) -> tuple[object, ...]:
    routes = pool.routes()
    return (
        pool.free_pages,
        tuple((r, pool.length(r), pool.page_table(r)) for r in routes),
        pool.kv.tobytes(),
    )


# -- construction and layout -------------------------------------------------------


def test_storage_is_one_layer_major_array_touched_at_construction() -> None:
    pool = _pool(num_pages=5)
    assert pool.kv.shape == (LAYERS, 2, 5, PS, HEADS, DIM)
    assert pool.kv.dtype == np.float16
    assert not pool.kv.any()
    assert (pool.page_size, pool.num_pages, pool.free_pages, pool.layout) == (PS, 5, 5, LAYOUT)


def test_append_lands_at_page_table_slots_of_kv() -> None:
    pool = _pool()
    r, k, v = _filled(pool, 6)
    table = pool.page_table(r)
    assert len(table) == 2
    for pos in range(6):
        page, slot = table[pos // PS], pos % PS
        assert np.array_equal(pool.kv[:, 0, page, slot], k[:, pos])
        assert np.array_equal(pool.kv[:, 1, page, slot], v[:, pos])


@pytest.mark.parametrize("bad", [{"page_size": 0}, {"num_pages": 0}, {"num_pages": True}])
def test_bad_geometry_is_refused(bad: dict[str, int]) -> None:
    kwargs = {"page_size": 4, "num_pages": 4} | bad
    with pytest.raises(ValueError):
        PagePool(LAYOUT, **kwargs)


# -- append / read -----------------------------------------------------------------


def test_appends_in_pieces_read_back_exactly() -> None:
    pool = _pool()
    r = pool.new_route()
    k, v = _tokens(11, 1)
    for a, b in [(0, 1), (1, 4), (4, 9), (9, 11)]:
        pool.append(r, k[:, a:b], v[:, a:b])
    assert pool.length(r) == 11
    assert pool.free_pages == 8 - 3
    _assert_reads(pool, r, k, v)
    gk, gv = pool.read(r, 3, 10)
    assert np.array_equal(gk, k[:, 3:10]) and np.array_equal(gv, v[:, 3:10])
    assert pool.read(r, 5, 5)[0].shape == (LAYERS, 0, HEADS, DIM)
    with pytest.raises(ValueError):
        pool.read(r, 0, 12)
    pool.check_invariants()


def test_read_returns_copies() -> None:
    pool = _pool()
    r, k, _ = _filled(pool, 3)
    gk, _ = pool.read(r)
    gk[...] = 0
    assert np.array_equal(pool.read(r)[0], k)


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((LAYERS, 2, HEADS), np.float16, "got \\[2, 2, 2\\]"),
        ((LAYERS + 1, 2, HEADS, DIM), np.float16, "num_layers=2"),
        ((LAYERS, 2, HEADS, DIM + 1), np.float16, "head_dim=4"),
        ((LAYERS, 2, HEADS, DIM), np.float32, "of float32"),
    ],
)
def test_bad_shapes_and_dtypes_are_refused_naming_expected_and_got(
    shape: tuple[int, ...], dtype: type, match: str
) -> None:
    pool = _pool()
    r = pool.new_route()
    bad = np.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        pool.append(r, bad, bad)
    assert pool.length(r) == 0 and pool.free_pages == 8


def test_k_and_v_must_agree() -> None:
    pool = _pool()
    r = pool.new_route()
    k, v = _tokens(3, 0)
    with pytest.raises(ValueError, match="same shape"):
        pool.append(r, k, v[:, :2])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nan_and_inf_are_refused(value: float, dtype: str) -> None:
    pool = _pool(dtype=dtype)
    r = pool.new_route()
    k, v = _tokens(3, 0, pool.dtype)
    v[1, 2, 0, 3] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        pool.append(r, k, v)
    assert pool.length(r) == 0 and pool.free_pages == 8


def test_bfloat16_travels_as_raw_uint16_bits() -> None:
    pool = _pool(dtype="bfloat16")
    assert pool.dtype == np.uint16 and pool.kv.dtype == np.uint16
    r, k, v = _filled(pool, 7)
    _assert_reads(pool, r, k, v)
    for bits in (0x7F80, 0xFF80, 0x7FC1):  # +Inf, -Inf, a NaN
        bad = k.copy()
        bad[0, 0, 0, 0] = bits
        with pytest.raises(ValueError, match="NaN or Inf"):
            pool.append(r, bad, v)
    with pytest.raises(ValueError, match="of uint16"):
        pool.append(r, k.astype(np.float16), v.astype(np.float16))
    assert pool.length(r) == 7


def test_unknown_route_is_a_lookup_error() -> None:
    pool = _pool()
    r = pool.new_route()
    pool.release(r)
    with pytest.raises(UnknownRouteError):
        pool.length(r)
    with pytest.raises(LookupError):
        pool.read(12345)


# -- exhaustion --------------------------------------------------------------------


def test_append_beyond_free_pages_fails_atomically_with_shortfall() -> None:
    pool = _pool(num_pages=3)
    r, _, _ = _filled(pool, 6)
    k, v = _tokens(7, 2)  # positions 6..12 need pages 2 and 3 (one more than is free)
    before = _state(pool)
    with pytest.raises(PoolExhaustedError) as info:
        pool.append(r, k, v)
    assert (info.value.needed, info.value.available, info.value.shortfall) == (2, 1, 1)
    assert "shortfall 1" in str(info.value)
    assert _state(pool) == before
    pool.check_invariants()


def test_exhaustion_counts_the_copy_of_a_shared_tail() -> None:
    pool = _pool(num_pages=2)
    r, _, _ = _filled(pool, 2)
    pool.fork(r)
    k, v = _tokens(1, 3)
    pool.append(r, k, v)  # copies the shared tail into the last free page
    with pytest.raises(PoolExhaustedError, match="shared tail"):
        pool.append(pool.fork(r), k, v)


def test_pool_exhausted_error_pickles_with_its_fields() -> None:
    err = PoolExhaustedError("x", needed=5, available=2)
    back = pickle.loads(pickle.dumps(err))
    assert (back.needed, back.available, back.shortfall, str(back)) == (5, 2, 3, "x")
    assert isinstance(back, RestoreError)


# -- fork and copy-on-write --------------------------------------------------------


def test_fork_shares_full_pages_and_copies_shared_tail_on_first_append() -> None:
    pool = _pool()
    a, k, v = _filled(pool, 6)
    b = pool.fork(a)
    assert pool.page_table(b) == pool.page_table(a)
    assert pool.free_pages == 6
    tail = pool.page_table(a)[1]
    tail_bytes = pool.kv[:, :, tail].tobytes()
    assert pool.refcount(tail) == 2

    k2, v2 = _tokens(3, 5)
    pool.append(b, k2, v2)
    # The fork got a private copy of the tail; the shared page was not written.
    assert pool.page_table(b)[0] == pool.page_table(a)[0]
    assert pool.page_table(b)[1] != tail
    assert pool.kv[:, :, tail].tobytes() == tail_bytes
    assert pool.refcount(tail) == 1
    _assert_reads(pool, a, k, v)
    _assert_reads(pool, b, np.concatenate([k, k2], 1), np.concatenate([v, v2], 1))

    # The original now holds its tail alone and appends in place.
    k3, v3 = _tokens(1, 6)
    pool.append(a, k3, v3)
    assert pool.page_table(a)[1] == tail
    _assert_reads(pool, a, np.concatenate([k, k3], 1), np.concatenate([v, v3], 1))
    pool.check_invariants()


def test_fork_at_a_position_and_at_zero() -> None:
    pool = _pool()
    a, k, v = _filled(pool, 9)
    b = pool.fork(a, at=5)
    assert pool.length(b) == 5 and pool.page_table(b) == pool.page_table(a)[:2]
    _assert_reads(pool, b, k[:, :5], v[:, :5])
    c = pool.fork(a, at=0)
    assert pool.length(c) == 0 and pool.page_table(c) == ()
    k2, v2 = _tokens(2, 7)
    pool.append(a, k2, v2)  # the original's partial tail is not shared: in place
    pool.append(b, k2, v2)  # the fork's partial tail is shared: copied
    _assert_reads(pool, b, np.concatenate([k[:, :5], k2], 1), np.concatenate([v[:, :5], v2], 1))
    _assert_reads(pool, a, np.concatenate([k, k2], 1), np.concatenate([v, v2], 1))
    with pytest.raises(ValueError, match="at 12"):
        pool.fork(a, at=12)
    pool.check_invariants()


def test_fork_of_page_aligned_route_appends_into_fresh_pages() -> None:
    pool = _pool()
    a, k, v = _filled(pool, 8)
    b = pool.fork(a)
    k2, v2 = _tokens(2, 8)
    pool.append(b, k2, v2)
    assert pool.page_table(b)[:2] == pool.page_table(a)
    _assert_reads(pool, a, k, v)


# -- truncate and release ----------------------------------------------------------


def test_truncate_frees_unneeded_pages_and_keeps_shared_ones() -> None:
    pool = _pool()
    a, k, v = _filled(pool, 10)
    b = pool.fork(a)
    pool.truncate(a, 3)
    assert pool.length(a) == 3 and len(pool.page_table(a)) == 1
    assert pool.free_pages == 5  # pages 2 and 3 are still b's
    _assert_reads(pool, b, k, v)
    pool.truncate(b, 4)
    assert pool.free_pages == 7
    pool.truncate(b, 4)  # no-op
    with pytest.raises(ValueError):
        pool.truncate(b, 5)
    # a's tail is shared with b: appending to a copies it, b keeps its bytes.
    k2, v2 = _tokens(3, 9)
    pool.append(a, k2, v2)
    _assert_reads(pool, b, k[:, :4], v[:, :4])
    _assert_reads(pool, a, np.concatenate([k[:, :3], k2], 1), np.concatenate([v[:, :3], v2], 1))
    pool.truncate(a, 0)
    assert pool.page_table(a) == ()
    pool.check_invariants()


def test_release_drops_references() -> None:
    pool = _pool()
    a, k, v = _filled(pool, 6)
    b = pool.fork(a, at=5)
    pool.release(a)
    assert pool.routes() == [b] and pool.free_pages == 6
    _assert_reads(pool, b, k[:, :5], v[:, :5])
    pool.release(b)
    assert pool.free_pages == 8 and pool.routes() == []
    with pytest.raises(UnknownRouteError):
        pool.release(b)
    pool.check_invariants()


def test_freed_pages_come_back_in_their_old_order_so_tables_stay_contiguous() -> None:
    """A route's pages, freed by release, truncate, a lease's close or free_reserved, are
    handed out again in the same order: a pool that restores and releases routes all day
    keeps giving chunks consecutive pages (one copy per chunk, not one per page)."""
    pool = _pool(num_pages=8)
    a, _, _ = _filled(pool, 4 * PS)
    first = pool.page_table(a)
    assert first == (0, 1, 2, 3)
    pool.release(a)
    b, _, _ = _filled(pool, 4 * PS, seed=1)
    assert pool.page_table(b) == first

    pool.truncate(b, PS)
    c, _, _ = _filled(pool, 3 * PS, seed=2)
    assert pool.page_table(c) == first[1:]

    pool.release(c)
    pool.release(b)  # freed last, handed out first: 0, then c's 1, 2, 3
    d, _, _ = _filled(pool, 4 * PS, seed=3)
    assert pool.page_table(d) == first
    with pool.lease(d):
        pool.release(d)
    assert pool.reserve_pages(4) == list(first)
    pool.free_reserved(first)
    assert pool.reserve_pages(4) == list(first)
    pool.check_invariants()


# -- leases ------------------------------------------------------------------------


def test_lease_snapshot_survives_append_truncate_and_release() -> None:
    pool = _pool()
    r, k, v = _filled(pool, 6)
    with pool.lease(r) as snap:
        assert (snap.length, snap.pages) == (6, pool.page_table(r))
        tail = snap.pages[1]
        k2, v2 = _tokens(3, 10)
        pool.append(r, k2, v2)
        assert pool.page_table(r)[1] != tail  # copy-on-write of the leased tail
        pool.truncate(r, 2)
        pool.append(r, k2, v2)
        pool.release(r)
        gk, gv = snap.read()
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
        gk, _ = snap.read(2, 5)
        assert np.array_equal(gk, k[:, 2:5])
        assert pool.free_pages == 6
    assert snap.closed and pool.free_pages == 8
    with pytest.raises(RestoreError, match="closed"):
        snap.read()
    snap.close()  # idempotent
    pool.check_invariants()


def test_lease_usable_as_explicit_context_manager_protocol() -> None:
    # The write-behind checkpointer enters the lease on one thread and exits it on another.
    pool = _pool()
    r, k, _ = _filled(pool, 5)
    cm = pool.lease(r)
    snap = cm.__enter__()
    pool.release(r)
    done = threading.Event()

    def capture() -> None:
        assert np.array_equal(snap.read()[0], k)
        cm.__exit__(None, None, None)
        done.set()

    t = threading.Thread(target=capture)
    t.start()
    t.join(timeout=10)
    assert done.is_set() and pool.free_pages == 8


# -- reserve / attach --------------------------------------------------------------


def test_reserve_fill_attach_makes_a_complete_route() -> None:
    pool = _pool()
    pages = pool.reserve_pages(3)
    assert len(set(pages)) == 3 and pool.free_pages == 5
    assert all(pool.refcount(p) == 1 for p in pages)
    pool.check_invariants()
    k, v = _tokens(10, 11)
    payload = np.stack([k, v], axis=1)  # [L, 2, T, H, D] as a stored chunk
    for i, p in enumerate(pages):
        a, b = i * PS, min((i + 1) * PS, 10)
        pool.kv[:, :, p, : b - a] = payload[:, :, a:b]
    r = pool.new_route()
    pool.attach(r, pages, 10)
    assert pool.page_table(r) == tuple(pages) and pool.length(r) == 10
    _assert_reads(pool, r, k, v)
    pool.check_invariants()
    with pytest.raises(ValueError, match="empty route"):
        pool.attach(r, [], 0)


def test_attach_refuses_unreserved_duplicate_or_misfit_pages() -> None:
    pool = _pool()
    pages = pool.reserve_pages(2)
    r = pool.new_route()
    with pytest.raises(ValueError, match="not reserved"):
        pool.attach(r, [pages[0], 7 - pages[1]], 8)
    with pytest.raises(ValueError, match="duplicates"):
        pool.attach(r, [pages[0], pages[0]], 8)
    with pytest.raises(ValueError, match="need 3 pages"):
        pool.attach(r, pages, 9)
    with pytest.raises(ValueError, match="need 1 pages"):
        pool.attach(r, pages, 4)
    assert pool.length(r) == 0 and pool.free_pages == 6
    pool.check_invariants()
    pool.free_reserved(pages)
    assert pool.free_pages == 8
    with pytest.raises(ValueError, match="not reserved"):
        pool.free_reserved(pages)
    pool.check_invariants()


def test_reserve_beyond_free_pages_fails_with_shortfall() -> None:
    pool = _pool(num_pages=4)
    pool.reserve_pages(3)
    with pytest.raises(PoolExhaustedError) as info:
        pool.reserve_pages(2)
    assert info.value.shortfall == 1 and pool.free_pages == 1
    assert pool.reserve_pages(0) == []


def test_attached_route_is_durable_unless_told_otherwise() -> None:
    pool = _pool(num_pages=4)
    r = pool.new_route()
    pool.attach(r, pool.reserve_pages(2), 8)
    s = pool.new_route()
    pool.attach(s, pool.reserve_pages(2), 5, durable=False)
    assert pool.evict(2) == [r]
    with pytest.raises(PoolExhaustedError):
        pool.evict(1)


# -- eviction ----------------------------------------------------------------------


def _durable(pool: PagePool, n: int, seed: int = 0) -> int:
    r, _, _ = _filled(pool, n, seed)
    pool.mark_durable(r, n)
    return r


def test_eviction_takes_lowest_value_per_freed_page_first() -> None:
    pool = _pool(num_pages=12)
    cheap = _durable(pool, 8)  # value 0.1 * 8 * 1 / 2 pages = 0.4 per page
    dear = _durable(pool, 8)  # 0.9 * 8 * 1 / 2 = 3.6
    mid = _durable(pool, 4)  # 0.5 * 4 * 1 / 1 = 2.0
    pool.set_value(cheap, 0.1, 1.0)
    pool.set_value(dear, 0.9, 1.0)
    pool.set_value(mid, 0.5, 1.0)
    assert pool.evict(1) == [cheap]
    assert pool.evict(2) == [mid, dear]
    pool.check_invariants()


def test_eviction_breaks_ties_by_least_recent_use() -> None:
    pool = _pool(num_pages=12)
    a, b, c = (_durable(pool, 4, s) for s in range(3))
    pool.read(a)  # a is now the most recently used
    assert pool.evict(2) == [b, c]
    assert pool.routes() == [a]


def test_demand_adds_to_the_eviction_value_so_a_demanded_route_outlives_an_older_one() -> None:
    pool = _pool(num_pages=12)
    a, b, c = (_durable(pool, 4, s) for s in range(3))
    pool.set_demand(a, 2.0)  # the least recently used, but needed elsewhere
    pool.set_value(b, 0.5, 1.0)  # 0.5 * 4 < c's (0 + 1.0) * 4 < a's 2.0 * 4
    pool.set_demand(c, 1.0)
    assert pool.evict(2) == [b, c]
    assert pool.routes() == [a]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="demand"):
            pool.set_demand(a, bad)
    with pytest.raises(UnknownRouteError):
        pool.set_demand(b, 1.0)


def test_eviction_value_counts_only_pages_it_would_free() -> None:
    pool = _pool(num_pages=12)
    parent = _durable(pool, 8)
    child = pool.fork(parent, at=8)
    k, v = _tokens(4, 1)
    pool.append(child, k, v)
    pool.mark_durable(child, 12)  # frees 1 page: 0.5 * 12 / 1 = 6 per page
    loner = _durable(pool, 8)  # frees 2 pages: 0.9 * 8 / 2 = 3.6 per page
    pool.set_value(parent, 0.01, 1.0)  # frees nothing while child shares its pages
    pool.set_value(child, 0.5, 1.0)
    pool.set_value(loner, 0.9, 1.0)
    assert pool.evict(2) == [loner]
    # The parent frees nothing until the child, which frees its own page, is gone.
    assert pool.evict(3) == [child, parent]
    assert pool.free_pages == 12


def test_eviction_can_free_pages_only_a_group_of_routes_holds() -> None:
    pool = _pool(num_pages=4)
    parent = _durable(pool, 6)
    child = pool.fork(parent)  # shares both pages: neither frees anything alone
    other = pool.fork(parent, at=4)
    pool.pin(other)  # keeps the first page alive whatever happens
    pool.set_value(parent, 0.9, 1.0)
    pool.set_value(child, 0.1, 1.0)
    assert pool.evict(1) == [child, parent]
    assert pool.routes() == [other] and pool.free_pages == 3
    with pytest.raises(PoolExhaustedError):
        pool.evict(4)


def test_eviction_never_touches_pinned_leased_protected_or_not_durable_routes() -> None:
    pool = _pool(num_pages=10)
    pinned, leased, protected = (_durable(pool, 4, s) for s in range(3))
    not_durable = _durable(pool, 4, 3)
    k, v = _tokens(1, 4)
    pool.append(not_durable, k, v)  # now a position past the durable mark
    victim = _durable(pool, 4, 5)
    pool.pin(pinned)
    pool.protect(protected)
    lease = pool.lease(leased)
    pool.append(leased, k, v)  # a page only the leased route holds: evicting it would free one
    pool.mark_durable(leased, 5)
    assert pool.free_pages == 3

    before = _state(pool)
    with pytest.raises(PoolExhaustedError) as info:
        pool.evict(6)
    assert (info.value.needed, info.value.available, info.value.shortfall) == (6, 1, 5)
    assert "shortfall 5" in str(info.value)
    assert _state(pool) == before

    assert pool.evict(1) == [victim]
    lease.close()
    pool.unpin(pinned)
    pool.protect(protected, False)
    pool.mark_durable(not_durable, 5)
    assert sorted(pool.evict(6)) == sorted([pinned, leased, protected, not_durable])
    assert pool.free_pages == 10
    pool.check_invariants()


def test_pins_nest_and_unpin_without_pin_is_refused() -> None:
    pool = _pool()
    r = _durable(pool, 4)
    pool.pin(r)
    pool.pin(r)
    pool.unpin(r)
    with pytest.raises(PoolExhaustedError):
        pool.evict(1)
    pool.unpin(r)
    with pytest.raises(ValueError):
        pool.unpin(r)
    assert pool.evict(1) == [r]


def test_durable_mark_follows_truncate_and_fork() -> None:
    pool = _pool()
    r = _durable(pool, 6)
    child = pool.fork(r, at=3)
    k, v = _tokens(1, 1)
    pool.append(child, k, v)  # position 3 of the fork is not checkpointed
    pool.truncate(r, 2)
    pool.append(r, k, v)  # durable mark was pulled back to 2: position 2 is new
    with pytest.raises(PoolExhaustedError):
        pool.evict(1)
    with pytest.raises(ValueError):
        pool.mark_durable(r, 4)
    pool.mark_durable(child, 4)
    assert pool.evict(1) == [child]


def test_set_value_validates() -> None:
    pool = _pool()
    r = pool.new_route()
    for reuse, cost in [
        (-0.1, 1.0),
        (1.5, 1.0),
        (0.5, -1.0),
        (0.5, float("inf")),
        (float("nan"), 1),
    ]:
        with pytest.raises(ValueError):
            pool.set_value(r, reuse, cost)
    assert pool.evict(0) == []
    with pytest.raises(ValueError):
        pool.evict(-1)


# -- concurrency -------------------------------------------------------------------


def test_concurrent_appends_forks_and_leases_keep_invariants() -> None:
    pool = _pool(num_pages=64)
    base, k, v = _filled(pool, 5)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(20):
                child = pool.fork(base, at=(seed + i) % 6)
                n = pool.length(child)
                k2, v2 = _tokens(3, seed * 100 + i)
                with pool.lease(base) as snap:
                    pool.append(child, k2, v2)
                    assert np.array_equal(snap.read()[0], k)
                gk, gv = pool.read(child)
                assert np.array_equal(gk, np.concatenate([k[:, :n], k2], 1))
                assert np.array_equal(gv, np.concatenate([v[:, :n], v2], 1))
                pool.release(child)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    _assert_reads(pool, base, k, v)
    assert pool.free_pages == 62
    pool.check_invariants()


# -- page runs: the one loop of every copy into or out of pages --------------


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda size: st.tuples(
            st.just(size),
            st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
            st.integers(0, 8 * 12),
            st.integers(0, 8 * 12),
        )
    )
)
def test_page_runs_cover_every_position_at_its_slot_in_maximal_runs(
    case: tuple[int, list[int], int, int],
) -> None:
    size, table, a, b = case
    start, end = sorted((min(a, len(table) * size), min(b, len(table) * size)))
    runs = list(page_runs(table, start, end, size))
    slots = [table[p // size] * size + p % size for p in range(start, end)]
    # Each run is its positions' slots, in order, with nothing left out or repeated ...
    assert [at + i for at, n, _ in runs for i in range(n)] == slots
    counts = [n for _, n, _ in runs]
    assert [off for _, _, off in runs] == [0, *itertools.accumulate(counts)][: len(runs)]
    # ... and no two neighbours could have been one copy.
    assert all(at2 != at1 + n1 for (at1, n1, _), (at2, _, _) in itertools.pairwise(runs))
    assert all(n > 0 for _, n, _ in runs)


def test_copies_through_a_scattered_table_land_in_their_pages() -> None:
    pool = PagePool(LAYOUT, page_size=4, num_pages=12)
    pages = pool.reserve_pages(6)
    scattered = [pages[i] for i in (3, 4, 5, 0, 2, 1)]  # a run of three, then single pages
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((LAYERS, 2, 22, HEADS, DIM)).astype(F16)
    pool.write_pages(scattered, 1, kv)  # starts mid-page, ends mid-page
    for pos in range(1, 23):
        page, slot = scattered[pos // 4], pos % 4
        np.testing.assert_array_equal(pool.kv[:, :, page, slot], kv[:, :, pos - 1])
    route = pool.new_route()
    pool.attach(route, scattered, 23)
    k, v = pool.read(route, 1, 23)
    np.testing.assert_array_equal(np.stack([k, v], axis=1), kv)


def test_flat_slots_is_a_view_or_an_error() -> None:
    pool = PagePool(LAYOUT, page_size=4, num_pages=3)
    flat = flat_slots(pool.kv)
    flat[0, 1, 5] = 1
    assert (pool.kv[0, 1, 1, 1] == 1).all()
    with pytest.raises(ValueError):
        flat_slots(pool.kv[:, :, ::2])  # every other page cannot be viewed flat
