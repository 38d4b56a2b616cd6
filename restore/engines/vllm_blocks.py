"""One request's blocks of vLLM's paged KV tensors as kvc's destination and snapshot seams
(`BlockTable`), and vLLM's per-layer tensors viewed K and V apart (`layer_views`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from catalog import AttentionLayout
from chunkstore.record import check_finite
from restore.engines.torch_kv import numpy_view, torch_dtype
from restore.errors import InputError, UnsupportedModelError
from restore.pages import check_payload, check_range, check_span, payload_shape
from restore.staging import StagedKV


class BlockTable:
    """One request's blocks of vLLM's per-layer KV tensors as kvc's two seams: the `Destination`
    a restore writes (positions before `start` left alone) and the `KVSnapshot` a save stages
    (an `InPlaceSnapshot`: CPU blocks are scanned and copied out in place).

    Device blocks are written and read on `stream` (the connector's CUDA stream), each copy
    ordered after `after`, an event recorded on vLLM's forward stream when the step handed the
    work over (so a load never races the zeroing or the last writes of its blocks, and a save
    reads what the forward wrote). `finish` records the end of this table's copies.

    `abort` and a `commit` of fewer positions leave what was written in the request's blocks:
    vLLM allocated them for this load, reads only the positions `restored` reports, and
    recomputes the rest (`get_block_ids_with_load_errors`)."""

    def __init__(
        self,
        layers: list[torch.Tensor],
        layout: AttentionLayout,
        block_size: int,
        block_ids: Iterable[int],
        *,
        start: int = 0,
        length: int = 0,
        stream: torch.cuda.Stream | None = None,
        after: torch.cuda.Event | None = None,
    ) -> None:
        self._layers = layers  # each [blocks, 2, block size, heads, head size] (a view)
        self._layout = layout
        self._block_size = block_size
        self._blocks = list(block_ids)
        self._start = start
        self._length = length
        self._reserved = 0
        self._on_device = layers[0].device.type != "cpu"
        if self._on_device and stream is None:
            raise InputError(
                "vLLM's KV cache is on a device: its copies need the connector's stream"
            )
        self._stream = stream
        self._after = after
        self.restored = 0

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return self._length

    def _spans(self, start: int, end: int) -> Iterable[tuple[int, int, int, int]]:
        """(block id, offset in the block, count, offset from `start`) covering `[start, end)`."""
        p = start
        while p < end:
            idx, off = divmod(p, self._block_size)
            take = min(self._block_size - off, end - p)
            yield self._blocks[idx], off, take, p - start
            p += take

    def _copy_stream(self) -> torch.cuda.Stream:
        """The connector's stream, after everything vLLM's forward stream had enqueued when
        the step handed this work over."""
        assert self._stream is not None
        if self._after is not None:
            self._stream.wait_event(self._after)
        return self._stream

    def finish(self) -> torch.cuda.Event | None:
        """An event recorded after every copy this table enqueued on the stream (None for CPU
        blocks, whose copies are done when they return)."""
        if not self._on_device:
            return None
        assert self._stream is not None
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._stream)
        return done

    # Destination
    def reserve(self, tokens: int) -> None:
        if math.ceil(tokens / self._block_size) > len(self._blocks):
            raise InputError(
                f"{tokens} positions need {math.ceil(tokens / self._block_size)} blocks of "
                f"{self._block_size}; the request holds {len(self._blocks)}"
            )
        self._reserved = tokens

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self._layout, kv, count)
        check_span(start, count, self._reserved)
        lo = max(start, self._start)
        if lo >= start + count:
            return  # vLLM computed these positions itself
        part = kv[:, :, lo - start : count]
        if not self._on_device:
            layers = [numpy_view(t) for t in self._layers]  # the one copy, from the blob
            for block, off, take, s in self._spans(lo, start + count):
                for layer, dst in enumerate(layers):
                    dst[block, :, off : off + take] = part[layer, :, s : s + take]
            return
        # Through pinned host memory, then block by block on the connector's stream (the
        # caching host allocator keeps the pinned buffer until the stream has read it).
        staged = torch.empty(part.shape, dtype=torch_dtype(self._layout.dtype), pin_memory=True)
        numpy_view(staged)[...] = part
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            on_device = staged.to(self._layers[0].device, non_blocking=True)
            for block, off, take, s in self._spans(lo, start + count):
                for layer, blocks in enumerate(self._layers):
                    blocks[block, :, off : off + take] = on_device[layer, :, s : s + take]

    def commit(self, tokens: int) -> None:
        self.restored = tokens
        self._reserved = 0

    def abort(self) -> None:
        self.restored = 0
        self._reserved = 0

    # KVSnapshot (CPU blocks; device blocks are staged whole by `stage`)
    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        start, end = check_range(start, end, self._length)
        out = np.empty(payload_shape(self._layout, end - start), dtype=self._layout.numpy_dtype)
        self.read_kv_into(out, start, end)
        return out

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        """Copy positions `[start, end)` into `out` (`[L, 2, end - start, H, D]`)."""
        start, end = check_range(start, end, self._length)
        check_payload(self._layout, out, end - start, what="out", exact=True)
        if self._on_device:
            out[...] = self._staged_now(start, end).kv
            return
        layers = [numpy_view(t) for t in self._layers]
        for block, off, take, s in self._spans(start, end):
            for layer, src in enumerate(layers):
                out[layer, :, s : s + take] = src[block, :, off : off + take]

    def check_finite(self, start: int, end: int) -> None:
        """Raise ValueError if positions `[start, end)` hold a NaN or an Inf (CPU blocks read in place)."""
        start, end = check_range(start, end, self._length)
        if self._on_device:
            self._staged_now(start, end).check_finite(0, end - start)
            return
        layers = [numpy_view(t) for t in self._layers]
        for block, off, take, _s in self._spans(start, end):
            for src in layers:
                check_finite(src[block, :, off : off + take], self._layout.dtype)

    def stage(
        self, start: int = 0, end: int | None = None
    ) -> tuple[StagedKV, torch.cuda.Event | None]:
        """Positions `[start, end)` (default: all `length`) copied once to host memory, and the
        event after which the copy is complete (None: complete already). CPU blocks are copied
        here; device blocks are gathered on the connector's stream into pinned memory, and
        the event is recorded after that copy (nothing waits for it here)."""
        start, end = check_range(start, end, self._length)
        if not self._on_device:
            staged = StagedKV.empty(self._layout, end - start)
            self.read_kv_into(staged.kv, start, end)
            return staged, None
        host = torch.empty(
            payload_shape(self._layout, end - start),
            dtype=torch_dtype(self._layout.dtype),
            pin_memory=True,
        )
        first, last = start // self._block_size, -(-end // self._block_size)
        skip = start - first * self._block_size
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            index = torch.tensor(self._blocks[first:last], device=self._layers[0].device)
            for layer, src in enumerate(self._layers):
                blocks = src.index_select(0, index)  # [n blocks, 2, block size, H, D]
                rows = blocks.transpose(0, 1).reshape(2, -1, *blocks.shape[3:])
                host[layer].copy_(rows[:, skip : skip + end - start], non_blocking=True)
        return StagedKV(self._layout, numpy_view(host)), self.finish()

    def _staged_now(self, start: int, end: int) -> StagedKV:
        staged, done = self.stage(start, end)
        if done is not None:
            done.synchronize()
        return staged

    def blocks_from(self, position: int, end: int) -> set[int]:
        """The blocks holding positions `[position, end)`."""
        return {block for block, _off, _take, _s in self._spans(position, end)}


def layer_views(
    kv_caches: dict[str, torch.Tensor],
    layer_names: list[str],
    shard_layout: AttentionLayout,
    block_size: int,
) -> list[torch.Tensor]:
    """vLLM's per-layer tensors, in layer order, as `[blocks, 2, block size, heads, head size]` views.

    vLLM's standard view is `[blocks, kv heads, block size, 2 * head size]`, K then V in the
    last dimension (vllm/v1/worker/utils.py); any other shape is refused.
    """
    heads, dim = shard_layout.num_kv_heads, shard_layout.head_dim
    views = []
    for name in layer_names:
        t = kv_caches[name]
        shape = tuple(t.shape)
        if len(shape) != 4 or shape[1:] != (heads, block_size, 2 * dim):
            raise UnsupportedModelError(
                f"vLLM's KV cache for layer {name} is shaped {shape}; the kvc connector reads "
                f"[blocks, {heads} kv heads, {block_size} block size, {2 * dim} (K and V packed)]"
            )
        if t.dtype != torch_dtype(shard_layout.dtype):
            raise UnsupportedModelError(
                f"vLLM's KV cache for layer {name} is {t.dtype}; the model's KV is {shard_layout.dtype}"
            )
        views.append(t.view(shape[0], heads, block_size, 2, dim).permute(0, 3, 2, 1, 4))
    return views
