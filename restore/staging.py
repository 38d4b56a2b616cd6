"""Staging: a host copy of one sequence's KV, so an engine's memory is released before the publish.

An engine that must get its KV memory back quickly (vLLM frees a finished request's
blocks once its connector reports the save read) copies the positions to publish into
a `StagedKV` once, releases its memory, and hands the copy to `Checkpointer.submit_snapshot`:
the publish (encode, fsync, S3, catalog) then reads host memory only. The checkpointer's
`staging_bytes` budget bounds the staged copies waiting to be published.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from catalog import AttentionLayout
from chunkstore.record import check_finite
from restore.destination import KVSnapshot
from restore.encode import fill_payload
from restore.pages import check_payload, check_range, payload_shape

__all__ = ["StagedKV"]


class StagedKV:
    """Positions `[0, length)` of a slab's KV in host memory, as one record-payload array
    `[L, 2, length, H, D]`: a `KVSnapshot` (and an `InPlaceSnapshot`: chunks are scanned and
    copied out of it in place) that nothing else writes."""

    def __init__(self, layout: AttentionLayout, kv: np.ndarray[Any, Any]) -> None:
        check_payload(layout, kv, 0, what="staged KV")
        self._layout = layout
        self._kv = kv

    @classmethod
    def empty(cls, layout: AttentionLayout, length: int) -> StagedKV:
        """Room for `length` positions (filled by the caller, for example from a device)."""
        return cls(layout, np.empty(payload_shape(layout, length), dtype=layout.numpy_dtype))

    @classmethod
    def copy_of(cls, snapshot: KVSnapshot, length: int) -> StagedKV:
        """Positions `[0, length)` of `snapshot`, copied once."""
        staged = cls.empty(snapshot.layout, length)
        fill_payload(snapshot, staged.kv, 0, length)
        return staged

    @property
    def kv(self) -> np.ndarray[Any, Any]:
        """The staged array itself (`[L, 2, length, H, D]`)."""
        return self._kv

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return int(self._kv.shape[2])

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        start, end = check_range(start, end, self.length)
        return self._kv[:, :, start:end].copy()

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        start, end = check_range(start, end, self.length)
        check_payload(self._layout, out, end - start, what="out", exact=True)
        out[...] = self._kv[:, :, start:end]

    def check_finite(self, start: int, end: int) -> None:
        start, end = check_range(start, end, self.length)
        check_finite(self._kv[:, :, start:end], self._layout.dtype)
