"""Positions to page slots: the page-run loop, copies into and out of layer-major pages, and checks of what is copied."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from catalog import AttentionLayout
from restore.errors import InputError

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


def page_runs(
    pages: Sequence[int], start: int, end: int, page_size: int
) -> Iterator[tuple[int, int, int]]:
    """Cut positions `[start, end)` of the page table `pages` into runs that are contiguous in
    the pool's flat slot axis (`page * page_size + slot`, see `flat_slots`): `(first flat
    slot, count, offset from start)` per run, the one loop every copy into or out of pages
    runs. Consecutive pages (a fresh pool hands them out in order) are one run: one copy,
    not one per page."""
    run_at = run_len = run_off = 0
    pos = start
    while pos < end:
        idx, slot = divmod(pos, page_size)
        take = min(page_size - slot, end - pos)
        at = int(pages[idx]) * page_size + slot
        if run_len and at == run_at + run_len:
            run_len += take
        else:
            if run_len:
                yield run_at, run_len, run_off
            run_at, run_len, run_off = at, take, pos - start
        pos += take
    if run_len:
        yield run_at, run_len, run_off


def flat_slots(kv: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The pool's storage `[L, 2, pages, page_size, H, D]` as a view `[L, 2, pages * page_size,
    H, D]` (never a copy: a storage array that cannot be viewed so raises)."""
    layers, two, num_pages, page_size, heads, dim = kv.shape
    return np.reshape(kv, (layers, two, num_pages * page_size, heads, dim), copy=False)


def payload_shape(layout: AttentionLayout, tokens: int) -> tuple[int, int, int, int, int]:
    """The shape of `tokens` positions of `layout` as a blob payload: `[L, 2, T, H, D]`."""
    return (layout.num_layers, 2, tokens, layout.num_kv_heads, layout.head_dim)


def check_payload(
    layout: AttentionLayout, kv: Any, tokens: int, *, what: str = "kv", exact: bool = False
) -> None:
    """Refuse (`InputError`, naming what is wrong) anything but a numpy array of the layout's
    dtype shaped `[L, 2, T, H, D]` with `T == tokens` (`exact`) or `T >= tokens`.

    The seams check this themselves because numpy's assignment would not: it casts another
    dtype silently and broadcasts a layer or head axis of 1 over all of them."""
    want = layout.numpy_dtype
    if not isinstance(kv, np.ndarray):
        raise InputError(f"{what} must be a numpy array of {want}, got {type(kv).__name__}")
    if kv.dtype != want:
        bits = " (bfloat16 travels as its uint16 bit patterns)" if layout.dtype == "bfloat16" else ""
        raise InputError(f"{what} is {kv.dtype}; this {layout.dtype} KV takes {want}{bits}")
    lay = layout
    ok = kv.ndim == 5 and kv.shape[:2] == (lay.num_layers, 2)
    ok = ok and kv.shape[3:] == (lay.num_kv_heads, lay.head_dim)
    if not ok or not (kv.shape[2] == tokens if exact else kv.shape[2] >= tokens):
        raise InputError(
            f"{what} is shaped {list(kv.shape)}; expected [{lay.num_layers} layers, 2 (K, V), "
            f"{'' if exact else '>= '}{tokens} positions, {lay.num_kv_heads} kv heads, "
            f"{lay.head_dim} head dim]"
        )


def check_span(start: Any, count: Any, reserved: int) -> None:
    """Refuse (`InputError`) a write of positions `[start, start + count)` outside the
    `reserved` positions of a destination."""
    start = check_int("start", start)
    count = check_int("count", count)
    if start + count > reserved:
        raise InputError(
            f"positions [{start}, {start + count}) are outside the {reserved} reserved positions"
        )


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
    flat = flat_slots(kv)
    for at, n, s in page_runs(pages, start, start + k.shape[1], page_size):
        flat[:, 0, at : at + n] = k[:, s : s + n]
        flat[:, 1, at : at + n] = v[:, s : s + n]


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
    flat = flat_slots(kv)
    for at, n, s in page_runs(pages, start, end, page_size):
        out[:, :, s : s + n] = flat[:, :, at : at + n]


def page_views(
    kv: np.ndarray[Any, Any], pages: Sequence[int], start: int, end: int, page_size: int
) -> Iterator[np.ndarray[Any, Any]]:
    """Views (no copies) of positions `[start, end)` of the page table `pages`, one per run
    of consecutive slots."""
    flat = flat_slots(kv)
    for at, n, _ in page_runs(pages, start, end, page_size):
        yield flat[:, :, at : at + n]
