"""The two seams between kvc and an engine's KV memory: where verified KV lands, where captured KV comes from.

A restore writes into a `Destination` (reserve, write chunk by chunk, commit
or abort); a checkpoint reads from a `KVSnapshot` (a frozen view of positions
`[0, length)`). The page pool implements both (`PoolDestination`, `Lease`);
an engine adapter implements them over the engine's own cache tensors
(`restore/engines/hf/cache.py`). The pipelines never see more than these methods.

Arrays crossing these seams are numpy, in the layout's numpy dtype (uint16
bit patterns for bfloat16), shaped like the blob payload: `[L, 2, T, H, D]`
(layers of the shard, K then V, positions, kv heads of the shard, head dim).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from catalog import AttentionLayout
from restore.pages import check_payload, check_span
from restore.pool import PagePool

__all__ = ["Destination", "KVSnapshot", "PoolDestination"]


class Destination(Protocol):
    """Where a restore puts verified KV. Nothing is visible to the engine before `commit`.

    The restore calls `reserve` once, then `write` for each verified chunk,
    then, once no write is running, exactly one of `commit` (with the number of
    leading positions that were written and verified; may be fewer than
    reserved, and positions past it may have been written too) or `abort` (on
    any error: the destination frees what it reserved and is left as it was).
    """

    @property
    def layout(self) -> AttentionLayout:
        """Layers, kv heads, head dim and dtype of the slab this destination holds."""
        ...

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` positions; raise (changing nothing) if there is none."""
        ...

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        """Copy `kv[:, :, :count]` (a verified chunk payload) to positions `[start, start + count)`.

        A `kv` of another dtype or shape than the layout's, or positions outside the
        reserved ones, are refused (`InputError`, naming which) before anything is written.
        Called from the restore's worker threads, several at once and in no particular
        order, always for disjoint position ranges.
        """
        ...

    def commit(self, tokens: int) -> None:
        """Make the first `tokens` positions visible (`tokens` > 0) and release the rest."""
        ...

    def abort(self) -> None:
        """Release everything reserved; nothing becomes visible."""
        ...


class KVSnapshot(Protocol):
    """A frozen view of positions `[0, length)` of one sequence's KV, readable while decoding goes on."""

    @property
    def layout(self) -> AttentionLayout:
        """Layers, kv heads, head dim and dtype of the slab this snapshot holds."""
        ...

    @property
    def length(self) -> int: ...

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        """A copy of positions `[start, end)` shaped `[L, 2, end - start, H, D]` (a range outside
        `[0, length)` is refused with a ValueError)."""
        ...


class PoolDestination:
    """Restores into a new route of a `PagePool`: pages are reserved, filled, then attached.

    After `commit`, `route` is the new route's id.
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.route: int | None = None
        self._pages: list[int] = []
        self._reserved = 0

    @property
    def layout(self) -> AttentionLayout:
        return self.pool.layout

    def reserve(self, tokens: int) -> None:
        self._pages = self.pool.reserve_pages(math.ceil(tokens / self.pool.page_size))
        self._reserved = tokens

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self.pool.layout, kv, count)
        check_span(start, count, self._reserved)
        self.pool.write_pages(self._pages, start, kv[:, :, :count])

    def commit(self, tokens: int) -> None:
        keep = math.ceil(tokens / self.pool.page_size)
        pages, rest = self._pages[:keep], self._pages[keep:]
        self._pages = pages
        if rest:
            self.pool.free_reserved(rest)
        route = self.pool.new_route()
        self.pool.attach(route, pages, tokens)
        self._pages = []
        self._reserved = 0
        self.route = route

    def abort(self) -> None:
        pages, self._pages = self._pages, []
        self._reserved = 0
        if pages:
            self.pool.free_reserved(pages)
