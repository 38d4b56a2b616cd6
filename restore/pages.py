"""Positions to page slots: the page-span loop, copies into and out of layer-major pages, and checks of what is copied."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from catalog import AttentionLayout

# A bfloat16 whose exponent bits are all ones is an Inf or a NaN.
_BF16_EXPONENT = 0x7F80


def check_int(name: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def check_range(start: int, end: int | None, length: int) -> tuple[int, int]:
    end = length if end is None else end
    start = check_int("start", start)
    end = check_int("end", end)
    if not start <= end <= length:
        raise ValueError(f"range [{start}, {end}) is not within [0, {length})")
    return start, end


def page_spans(start: int, end: int, page_size: int) -> Iterator[tuple[int, int, int, int]]:
    """Cut positions `[start, end)` at page boundaries: `(table index, first slot, count,
    offset from start)` per piece, the one loop every copy into or out of pages runs."""
    pos = start
    while pos < end:
        idx, slot = divmod(pos, page_size)
        take = min(page_size - slot, end - pos)
        yield idx, slot, take, pos - start
        pos += take


def check_tokens(layout: AttentionLayout, k: np.ndarray[Any, Any], v: np.ndarray[Any, Any]) -> int:
    """The number of positions in `k` and `v` (`[num_layers, n, num_kv_heads, head_dim]` of the
    layout's dtype, no NaN or Inf), or ValueError naming what is wrong."""
    lay = layout
    dtype = layout.numpy_dtype
    want = f"[num_layers={lay.num_layers}, n_tokens, num_kv_heads={lay.num_kv_heads}, head_dim={lay.head_dim}] of {dtype}"
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise ValueError(f"{name} must be a numpy array shaped {want}, got {type(x).__name__}")
        ok = (
            x.ndim == 4
            and x.shape[0] == lay.num_layers
            and x.shape[2:] == (lay.num_kv_heads, lay.head_dim)
            and x.dtype == dtype
        )
        if not ok:
            raise ValueError(f"{name} must be shaped {want}, got {list(x.shape)} of {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}"
        )
    for name, x in (("k", k), ("v", v)):
        if lay.dtype == "bfloat16":
            bad = bool(((x & _BF16_EXPONENT) == _BF16_EXPONENT).any())
        else:
            bad = not bool(np.isfinite(x).all())
        if bad:
            raise ValueError(f"{name} contains NaN or Inf ({lay.dtype})")
    return int(k.shape[1])


def copy_in(
    kv: np.ndarray[Any, Any],
    pages: Sequence[int],
    start: int,
    k: np.ndarray[Any, Any],
    v: np.ndarray[Any, Any],
    page_size: int,
) -> None:
    """Copy `k` and `v` (`[L, n, H, D]`) to positions `[start, start + n)` of the page table `pages`."""
    for idx, slot, take, s in page_spans(start, start + k.shape[1], page_size):
        kv[:, 0, pages[idx], slot : slot + take] = k[:, s : s + take]
        kv[:, 1, pages[idx], slot : slot + take] = v[:, s : s + take]


def copy_out_kv(
    kv: np.ndarray[Any, Any],
    layout: AttentionLayout,
    pages: Sequence[int],
    start: int,
    end: int,
    page_size: int,
) -> np.ndarray[Any, Any]:
    """A copy of positions `[start, end)` of the page table `pages`, shaped `[L, 2, end-start, H, D]`."""
    out = np.empty(
        (layout.num_layers, 2, end - start, layout.num_kv_heads, layout.head_dim), dtype=kv.dtype
    )
    copy_out_into(out, kv, pages, start, end, page_size)
    return out


def copy_out_into(
    out: np.ndarray[Any, Any],
    kv: np.ndarray[Any, Any],
    pages: Sequence[int],
    start: int,
    end: int,
    page_size: int,
) -> None:
    """Copy positions `[start, end)` of the page table `pages` into `out` (`[L, 2, end-start, H, D]`)."""
    want = (kv.shape[0], 2, end - start, kv.shape[4], kv.shape[5])
    if out.shape != want or out.dtype != kv.dtype:
        raise ValueError(f"out must be shaped {list(want)} of {kv.dtype}, got {list(out.shape)} of {out.dtype}")
    for idx, slot, take, s in page_spans(start, end, page_size):
        out[:, :, s : s + take] = kv[:, :, pages[idx], slot : slot + take]


def page_views(
    kv: np.ndarray[Any, Any], pages: Sequence[int], start: int, end: int, page_size: int
) -> Iterator[np.ndarray[Any, Any]]:
    """Views (no copies) of positions `[start, end)` of the page table `pages`, one per page piece."""
    for idx, slot, take, _ in page_spans(start, end, page_size):
        yield kv[:, :, pages[idx], slot : slot + take]
