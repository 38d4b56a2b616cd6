"""Pages of SGLang's host KV pool (`kv_buffer`, either host layout) as kvc's destination and
snapshot seams, for the HiCache storage backend (`restore/engines/sglang.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from catalog import AttentionLayout
from chunkstore.record import check_finite
from restore.engines.torch_kv import numpy_view
from restore.errors import InputError, RestoreError
from restore.pages import check_payload, check_range, check_span, payload_shape

LAYOUTS = ("layer_first", "page_first")
# Page -> [L, 2, P, H, D] (a kvc payload) and back, per host layout of kv_buffer.
_TO_PAYLOAD = {"layer_first": (1, 0, 2, 3, 4), "page_first": (2, 0, 1, 3, 4)}
_TO_HOST = {"layer_first": (1, 0, 2, 3, 4), "page_first": (1, 2, 0, 3, 4)}


class HostPages:
    """Some pages of a kv_buffer-shaped tensor as kvc's two seams (`restore.destination`).

    Chain positions `[0, base * P)` are the call's `prefix_keys` (not here: a
    read or write of them fails); page `base + j` is at slot `starts[j]`. A
    range may cross pages (kvc writes a page per chunk; the seam does not ask it).
    `abort` and a `commit` of fewer positions leave what was written in the pages:
    SGLang allocated them for this read and uses only the pages reported loaded.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        host_layout: str,
        layout: AttentionLayout,
        page_size: int,
        base: int,
        starts: list[int],
    ) -> None:
        self._buf = numpy_view(buffer)
        self._host_layout = host_layout
        self._layout = layout
        self._p = page_size
        self._base = base
        self._starts = starts
        self._reserved = 0
        self.committed = 0

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return (self._base + len(self._starts)) * self._p

    def _pieces(self, start: int, end: int) -> Iterator[tuple[np.ndarray[Any, Any], int, int]]:
        """(host memory of a run of positions within one page in host order, its offset from
        `start`, its count) covering `[start, end)`."""
        if start < self._base * self._p and end > start:
            raise RestoreError(
                f"positions {start}..{end} are not pages of this call: "
                "a page before the call's keys is not catalogued in kvc"
            )
        pos = start
        while pos < end:
            j, off = divmod(pos, self._p)
            take = min(self._p - off, end - pos)
            s = self._starts[j - self._base] + off
            if self._host_layout == "layer_first":
                yield self._buf[:, :, s : s + take], pos - start, take
            else:
                yield self._buf[:, s : s + take], pos - start, take
            pos += take

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        start, end = check_range(start, end, self.length)
        out = np.empty(payload_shape(self._layout, end - start), dtype=self._layout.numpy_dtype)
        self.read_kv_into(out, start, end)
        return out

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        start, end = check_range(start, end, self.length)
        check_payload(self._layout, out, end - start, what="out", exact=True)
        for host, at, n in self._pieces(start, end):
            out[:, :, at : at + n] = host.transpose(_TO_PAYLOAD[self._host_layout])

    def check_finite(self, start: int, end: int) -> None:
        start, end = check_range(start, end, self.length)
        for host, _at, _n in self._pieces(start, end):
            check_finite(host, self._layout.dtype)

    def reserve(self, tokens: int) -> None:
        if tokens > self.length:  # the pages exist: SGLang allocated them
            raise InputError(
                f"{tokens} positions do not fit the call's pages (up to position {self.length})"
            )
        self._reserved = tokens
        self.committed = 0

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self._layout, kv, count)
        check_span(start, count, self._reserved)
        for host, at, n in self._pieces(start, start + count):
            host[...] = kv[:, :, at : at + n].transpose(_TO_HOST[self._host_layout])

    def commit(self, tokens: int) -> None:
        self.committed = tokens
        self._reserved = 0

    def abort(self) -> None:
        self.committed = 0
        self._reserved = 0
