"""A DynamicCache's tensors as kvc's two seams: the `KVSnapshot` a checkpoint reads, the `Destination` a restore fills."""

from __future__ import annotations

import math
import mmap
from typing import Any

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


def _fresh_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory the kernel backs with huge pages where it
    can: the restore's one copy writes into never-touched memory, and faulting it in by 4 KiB
    pages runs at about a third of the speed (measured: 2.1 vs 6.6 GB/s here)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping; it is unmapped when the last view is gone.
    return torch.frombuffer(memory, dtype=dtype).view(shape)


class CacheDestination:
    """A `Destination` that becomes a DynamicCache: verified chunks land in one host buffer
    laid out like the blob payload, `[L, 2, T, H, D]` (pinned for a GPU model), so each
    chunk is one plain copy; the layers' tensors are `[1, H, T, D]` views of it (strided:
    transformers' first append concatenates them into new tensors anyway)."""

    def __init__(self, model: PreTrainedModel, layout: AttentionLayout, shard: Shard) -> None:
        self._model = model
        self._layout = layout
        self._shard = shard
        self._host: torch.Tensor | None = None
        self._view: np.ndarray[Any, Any] | None = None
        self.cache: DynamicCache | None = None

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    def reserve(self, tokens: int) -> None:
        lay = self._layout
        shape = (lay.num_layers, 2, tokens, lay.num_kv_heads, lay.head_dim)
        dtype = torch_dtype(lay.dtype)
        if self._model.device.type == "cuda":
            self._host = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            self._host = _fresh_host_tensor(shape, dtype)
        self._view = numpy_view(self._host)

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        check_payload(self._layout, kv, count)
        check_span(start, count, 0 if self._view is None else self._view.shape[2])
        assert self._view is not None
        self._view[:, :, start : start + count] = kv[:, :, :count]  # the one copy from the blob

    def commit(self, tokens: int) -> None:
        host = self._host
        assert host is not None
        self._host = self._view = None
        device = self._model.device
        kv = host if device.type == "cpu" else host.to(device, non_blocking=True)
        cache = DynamicCache(config=self._model.config)
        layers = attention_layers(cache)
        for i in range(self._layout.num_layers):
            layer = layers[self._shard.layer_lo + i]
            start = 0
            if isinstance(layer, DynamicSlidingWindowLayer):
                # What the layer's own `update` leaves after `tokens` positions: the last
                # `sliding_window - 1` of them, and the count of every position it has seen.
                start = max(tokens - (layer.sliding_window - 1), 0)
                layer.cumulative_length = tokens
            k = kv[i, 0, start:tokens].transpose(0, 1).unsqueeze(0)
            v = kv[i, 1, start:tokens].transpose(0, 1).unsqueeze(0)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        self.cache = cache

    def abort(self) -> None:
        self._host = self._view = None
