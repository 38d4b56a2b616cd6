"""Leases: frozen snapshots of a page-pool route, readable while the route moves on."""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from catalog import AttentionLayout
from chunkstore.record import check_finite
from restore.errors import RestoreError
from restore.pages import check_range, copy_out_into, copy_out_kv, page_views

if TYPE_CHECKING:
    from restore.pool import PagePool

__all__ = ["Lease", "LeaseState"]


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What a lease holds: the route it snapshots, that route's pages then, and its length."""

    route: int
    pages: tuple[int, ...]
    length: int


class Lease:
    """A frozen snapshot of a route's first `length` positions, readable while the route moves on.

    The lease holds a reference on every page of the snapshot, so the route may
    append (its shared tail page is copied first), truncate or be released
    without the snapshot changing. Use it as a context manager, or call
    `close()`; do not close it while another thread is reading from it.
    """

    __slots__ = ("_id", "_pool", "length", "pages", "route")

    def __init__(self, pool: PagePool, lease_id: int, state: LeaseState) -> None:
        self._pool = pool
        self._id = lease_id
        self.route = state.route
        self.pages = state.pages
        self.length = state.length

    @property
    def closed(self) -> bool:
        return self._pool._lease_closed(self._id)

    @property
    def layout(self) -> AttentionLayout:
        return self._pool.layout

    def read(
        self, start: int = 0, end: int | None = None
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """K and V copies of snapshot positions `[start, end)`, each `[num_layers, end-start, H, D]`."""
        kv = self.read_kv(start, end)
        return kv[:, 0], kv[:, 1]

    def read_kv(self, start: int = 0, end: int | None = None) -> np.ndarray[Any, Any]:
        """A copy of snapshot positions `[start, end)` shaped `[num_layers, 2, end-start, H, D]`."""
        if self.closed:
            raise RestoreError(f"lease {self._id} on route {self.route} is closed")
        start, end = check_range(start, end, self.length)
        # No pool lock while copying: the lease's references keep every writer
        # off these pages, and a capture must not stall the decoding thread.
        pool = self._pool
        return copy_out_kv(pool.kv, pool.layout, self.pages, start, end, pool.page_size)

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        """Copy snapshot positions `[start, end)` into `out`, shaped `[num_layers, 2, end-start, H, D]`
        (e.g. a record's payload: the checkpoint's one copy of the KV)."""
        pool = self._open_pool()
        start, end = check_range(start, end, self.length)
        copy_out_into(out, pool.kv, self.pages, start, end, pool.page_size)

    def check_finite(self, start: int, end: int) -> None:
        """Raise ValueError if snapshot positions `[start, end)` hold a NaN or an Inf; reads the
        pages in place."""
        pool = self._open_pool()
        start, end = check_range(start, end, self.length)
        for piece in page_views(pool.kv, self.pages, start, end, pool.page_size):
            check_finite(piece, pool.layout.dtype)

    def _open_pool(self) -> PagePool:
        if self.closed:
            raise RestoreError(f"lease {self._id} on route {self.route} is closed")
        return self._pool

    def close(self) -> None:
        """Drop the snapshot's page references (idempotent)."""
        self._pool._close_lease(self._id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lease(route={self.route}, length={self.length}, pages={self.pages})"
