"""A DynamicCache's tensors as kvc's two seams: the `KVSnapshot` a checkpoint reads, the `Destination` a restore fills."""

from __future__ import annotations

import collections
import math
import mmap
import threading
import weakref
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from catalog import AttentionLayout
from catalog.models import Shard
from chunkstore.record import check_finite
from restore.engines.hf.identity import attention_layers, check_window
from restore.engines.torch_kv import numpy_view, torch_dtype
from restore.errors import InputError, UnsupportedModelError
from restore.pages import check_payload, check_range, check_span, payload_shape

_T = TypeVar("_T")


class CacheSnapshot:
    """A `KVSnapshot` of a DynamicCache's slab: positions `[0, length)` of its layers and heads.

    CPU tensors are read in place. transformers' DynamicLayer never writes into
    its tensors (appending concatenates into new ones), so holding references
    freezes them while decoding goes on. A GPU cache is copied once into pinned
    host memory.
    """

    def __init__(
        self, cache_layers: list[DynamicLayer], layout: AttentionLayout, shard: Shard, length: int
    ) -> None:
        self._layout = layout
        self._length = length
        layers = cache_layers[shard.layer_lo : shard.layer_hi]
        if len(layers) != layout.num_layers:
            raise InputError(
                f"the cache has {len(cache_layers)} layers; this worker's shard is {shard}"
            )
        want = (1, layout.num_kv_heads, layout.head_dim)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(layers):
            if not layer.is_initialized or layer.keys is None or layer.values is None:
                raise InputError(f"cache layer {shard.layer_lo + i} holds no KV")
            check_window(layer, shard.layer_lo + i)
            k, v = layer.keys.detach(), layer.values.detach()
            for name, t in (("keys", k), ("values", v)):
                got = (t.shape[0], t.shape[1], t.shape[3]) if t.dim() == 4 else tuple(t.shape)
                if t.dim() != 4 or got != want:
                    raise UnsupportedModelError(
                        f"cache layer {shard.layer_lo + i} {name} are shaped {tuple(t.shape)}, "
                        f"expected [1, {layout.num_kv_heads}, T, {layout.head_dim}] "
                        "(one sequence; K and V of one head dim)"
                    )
                if t.shape[2] < length:
                    raise InputError(
                        f"cache layer {shard.layer_lo + i} holds {t.shape[2]} positions, "
                        f"fewer than the {length} to store"
                    )
                if t.dtype != torch_dtype(layout.dtype):
                    raise UnsupportedModelError(
                        f"cache layer {shard.layer_lo + i} {name} are {t.dtype}, "
                        f"the model's KV dtype is {layout.dtype}"
                    )
            pairs.append((k[0, :, :length], v[0, :, :length]))
        if pairs and pairs[0][0].device.type != "cpu":
            pairs = _to_pinned_host(pairs)
        self._kv = [(numpy_view(k), numpy_view(v)) for k, v in pairs]

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return self._length

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        start, end = check_range(start, end, self._length)
        lay = self._layout
        out = np.empty(payload_shape(lay, end - start), dtype=lay.numpy_dtype)
        self.read_kv_into(out, start, end)
        return out

    def read_kv_into(self, out: np.ndarray[Any, Any], start: int, end: int) -> None:
        """Copy positions `[start, end)` into `out` (`[L, 2, end - start, H, D]`, e.g. a record's
        payload): the one copy a checkpoint makes of the cache."""
        start, end = check_range(start, end, self._length)
        check_payload(self._layout, out, end - start, what="out", exact=True)
        for i, (k, v) in enumerate(self._kv):
            out[i, 0] = k[:, start:end].transpose(1, 0, 2)
            out[i, 1] = v[:, start:end].transpose(1, 0, 2)

    def check_finite(self, start: int, end: int) -> None:
        """Raise ValueError if positions `[start, end)` hold a NaN or an Inf (read in place)."""
        start, end = check_range(start, end, self._length)
        for k, v in self._kv:
            check_finite(k[:, start:end], self._layout.dtype)
            check_finite(v[:, start:end], self._layout.dtype)


def _to_pinned_host(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy device tensors into one pinned host buffer (asynchronously, then one synchronize)."""
    k0 = pairs[0][0]
    host = torch.empty((len(pairs), 2, *k0.shape), dtype=k0.dtype, pin_memory=True)
    for i, (k, v) in enumerate(pairs):
        host[i, 0].copy_(k, non_blocking=True)
        host[i, 1].copy_(v, non_blocking=True)
    torch.cuda.synchronize(k0.device)
    return [(host[i, 0], host[i, 1]) for i in range(len(pairs))]


_HUGE_PAGE = 2 << 20


class HostBuffers:
    """CPU memory that restores land in, taken back once nothing uses it and handed to the next.

    Memory the kernel maps for the first time is zeroed page by page on its first write,
    so a restore's one copy into it runs at a fraction of the speed of a copy into memory
    written before (on the 2-core VM: 2.1 GB/s in 4 KiB pages, 6.6 GB/s in huge pages,
    13 GB/s into memory already touched). The tensors of a restored cache are views of
    one buffer, and transformers replaces them on its first forward (it concatenates
    into new tensors), so the buffer is free again by the next restore: when the last
    view is gone it comes back here, and at most `keep_bytes` of idle buffers are kept
    (the least recently given back are dropped first).
    New buffers are mapped in huge pages where the kernel can. Buffers under 2 MiB are
    malloc's, which recycles them itself. Thread-safe: a buffer comes back on whatever
    thread drops its last view.
    """

    def __init__(self, keep_bytes: int) -> None:
        if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise InputError(f"keep_bytes must be an int >= 0, got {keep_bytes!r}")
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._idle: list[mmap.mmap] = []
        # Buffers given back and not yet sorted in: a buffer comes back from a finalizer,
        # which may run inside any allocation (a garbage collection), this class's included.
        self._returned: collections.deque[mmap.mmap] = collections.deque()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._sort_in()
            return sum(len(m) for m in self._idle)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of `shape`, in a kept buffer when one fits."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _HUGE_PAGE:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        memory = self._take(size)
        if memory is None:
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                memory.madvise(mmap.MADV_HUGEPAGE)
        view = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
        # Only the tensor (through torch.from_numpy) holds `view`: once the last tensor on
        # this memory is gone, so is `view`, and the memory comes back.
        weakref.finalize(view, self._give_back, memory).atexit = False
        return torch.from_numpy(view).view(dtype).view(shape)

    def _take(self, size: int) -> mmap.mmap | None:
        """The smallest idle buffer of `size` to twice `size` bytes (a larger one would hold
        memory the restore does not use)."""
        with self._lock:
            self._sort_in()
            fits = [m for m in self._idle if size <= len(m) <= 2 * size]
            if not fits:
                return None
            memory = min(fits, key=len)
            self._idle.remove(memory)
            return memory

    def _give_back(self, memory: mmap.mmap) -> None:
        self._returned.append(memory)  # atomic: never waits, whatever this thread holds
        if self._lock.acquire(blocking=False):  # else the holder or the next caller sorts it in
            try:
                self._sort_in()
            finally:
                self._lock.release()

    def _sort_in(self) -> None:
        """Move given-back buffers to the idle ones, newest last, then drop the least recently
        given back until they fit `keep_bytes` (under the lock).

        Least recently used, not largest first: prompts of one size come back, so the buffer
        given back last is the likeliest to be asked for next. (Dropping the largest made
        every 16k-token restore map new memory once two 4k and two 1k buffers sat idle
        beside its 192 MiB: 178 instead of 55 ms.) A buffer larger than `keep_bytes` on its
        own is not kept, and does not push out the others."""
        while self._returned:
            memory = self._returned.popleft()
            if len(memory) <= self.keep_bytes:
                self._idle.append(memory)
        idle = sum(len(m) for m in self._idle)
        while idle > self.keep_bytes:
            idle -= len(self._idle.pop(0))

    def clear(self) -> None:
        """Drop the idle buffers (buffers in use come back and are kept as before)."""
        with self._lock:
            self._returned.clear()
            self._idle.clear()


class CacheBuilder:
    """What every restore into one model's DynamicCache shares: the slab it holds, the host
    buffers restores land in, and an empty cache built from the model's config once.

    Building a DynamicCache from the config (layer types from the config, then a lazy
    initialisation per layer) costs more than a small restore's copy; copying the empty
    one costs a few microseconds per layer. Only layers that keep per-position KV are accepted
    (`attention_layers`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layout: AttentionLayout,
        shard: Shard,
        buffers: HostBuffers,
    ) -> None:
        self.model = model
        self.layout = layout
        self.shard = shard
        self.buffers = buffers
        # What `model.device` reads (its first parameter's device), kept to read it without
        # walking the module tree on every restore (about 0.1 ms with cold caches, twice per
        # restore); `model.to(...)` moves a parameter's data in place, so this follows it.
        self._first_parameter = next(model.parameters())
        self._empty = DynamicCache(config=model.config)
        layers = attention_layers(self._empty)
        # The slab's layers as transformers initialises them (dtype, device, and whatever
        # else), so a restored layer is a copy of one with its keys and values set.
        nothing = torch.empty(
            (1, layout.num_kv_heads, 0, layout.head_dim),
            dtype=torch_dtype(layout.dtype),
            device=model.device,
        )
        self._ready = [_copy(layers[shard.layer_lo + i]) for i in range(layout.num_layers)]
        for layer in self._ready:
            layer.lazy_initialization(nothing, nothing)
        # Per slab layer: its window (positions it keeps past the newest) or None for all.
        self._windows = [
            layer.sliding_window - 1 if isinstance(layer, DynamicSlidingWindowLayer) else None
            for layer in self._ready
        ]

    @property
    def device(self) -> torch.device:
        """The model's device, as `model.device` says."""
        return self._first_parameter.device

    def destination(self) -> CacheDestination:
        return CacheDestination(self)

    def cache(self, kv: torch.Tensor, tokens: int) -> DynamicCache:
        """A DynamicCache whose slab layers hold positions `[0, tokens)` of `kv` (`[L, 2, T, H,
        D]`) as `[1, H, tokens, D]` views; the other layers are empty."""
        cache = _copy(self._empty)
        lo, hi = self.shard.layer_lo, self.shard.layer_hi
        empty = self._empty.layers
        # [L, 2, T, H, D] -> 2L views [1, H, T, D] (K, V, K, V, ...) in one call.
        views = kv[:, :, :tokens].transpose(2, 3).unsqueeze(2).flatten(0, 1).unbind(0)
        slab = []
        for i, (ready, window) in enumerate(zip(self._ready, self._windows, strict=True)):
            layer = _copy(ready)
            keys, values = views[2 * i], views[2 * i + 1]
            if window is not None:
                # What the layer's own `update` leaves after `tokens` positions: the last
                # `sliding_window - 1` of them, and the count of every position it has seen.
                start = max(tokens - window, 0)
                keys, values = keys[:, :, start:], values[:, :, start:]
                layer.cumulative_length = tokens
            layer.keys, layer.values = keys, values
            slab.append(layer)
        cache.layers = [
            *(_copy(layer) for layer in empty[:lo]),
            *slab,
            *(_copy(layer) for layer in empty[hi:]),
        ]
        return cache


def _copy(obj: _T) -> _T:
    """A shallow copy of a plain object (what `copy.copy` does, in a third of its time)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


class CacheDestination:
    """A `Destination` that becomes a DynamicCache: verified chunks land in one host buffer
    laid out like the blob payload, `[L, 2, T, H, D]` (pinned for a GPU model; from the
    builder's `HostBuffers` on the CPU), so each chunk is one plain copy; the layers' tensors
    are `[1, H, T, D]` views of it (strided: transformers' first append concatenates them
    into new tensors anyway, and the buffer goes back to `HostBuffers`)."""

    def __init__(self, builder: CacheBuilder) -> None:
        self._builder = builder
        self._host: torch.Tensor | None = None
        self._view: np.ndarray[Any, Any] | None = None
        self.cache: DynamicCache | None = None

    @property
    def layout(self) -> AttentionLayout:
        return self._builder.layout

    def reserve(self, tokens: int) -> None:
        lay = self._builder.layout
        shape = (lay.num_layers, 2, tokens, lay.num_kv_heads, lay.head_dim)
        dtype = torch_dtype(lay.dtype)
        if self._builder.device.type == "cuda":
            self._host = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            self._host = self._builder.buffers.tensor(shape, dtype)
        self._view = numpy_view(self._host)

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self._builder.layout, kv, count)
        check_span(start, count, 0 if self._view is None else self._view.shape[2])
        assert self._view is not None
        self._view[:, :, start : start + count] = kv[:, :, :count]  # the one copy from the blob

    def commit(self, tokens: int) -> None:
        host = self._host
        assert host is not None
        self._host = self._view = None
        device = self._builder.device
        kv = host if device.type == "cpu" else host.to(device, non_blocking=True)
        self.cache = self._builder.cache(kv, tokens)

    def abort(self) -> None:
        self._host = self._view = None
