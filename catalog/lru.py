"""A small thread-safe LRU map: the catalog's caches of immutable rows, bounded by entry count
and, optionally, by a weight (bytes) per entry."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `maxsize` entries (and `max_weight` summed `weigh(value)`, if given); adding
    one more forgets the least recently used. A value heavier than `max_weight` is not kept."""

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Callable[[V], int] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize!r}")
        if (max_weight is None) != (weigh is None):
            raise ValueError("max_weight and weigh go together")
        self.maxsize = maxsize
        self.max_weight = max_weight
        self._weigh = weigh
        self._weights: dict[K, int] = {}
        self.weight = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._data.get(key)
            if found is not None:
                self._data.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        w = 0 if self._weigh is None else self._weigh(value)
        with self._lock:
            self._forget(key)
            if self.max_weight is not None and w > self.max_weight:
                return
            self._data[key] = value
            self._weights[key] = w
            self.weight += w
            while len(self._data) > self.maxsize or (
                self.max_weight is not None and self.weight > self.max_weight
            ):
                self._forget(next(iter(self._data)))

    def _forget(self, key: K) -> None:
        if key in self._data:
            del self._data[key]
            self.weight -= self._weights.pop(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
