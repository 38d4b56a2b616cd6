"""One behaviour suite for every `Destination` / `KVSnapshot`: the page pool, the transformers cache,
a vLLM request's blocks and SGLang's host pool pages, on CPU tensors in each engine's own layout.

Each `Engine` below builds the seam's objects the way its adapter does (`PoolDestination` and
`Lease` over a `PagePool`; `CacheDestination` and `CacheSnapshot` over a tiny Llama's
`DynamicCache`; `BlockTable` over `layer_views` of vLLM's `[blocks, kv heads, block size,
2 * head size]` tensors; `HostPages` over an MHA host pool's `kv_buffer` in both of SGLang's
layouts) and reads what the engine would see through the engine's own objects, never through the
seam under test. SGLang's host pool is its real `MHATokenToKVPoolHost` (tests/sglang/harness.py):
the SGLang cases run in SGLang's own environment (`./scripts/test` runs this file there with
`-k sglang`); nothing is a stand-in.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from catalog import AttentionLayout  # noqa: E402
from catalog.models import Shard  # noqa: E402
from restore.destination import Destination, KVSnapshot, PoolDestination  # noqa: E402
from restore.encode import InPlaceSnapshot  # noqa: E402
from restore.engines.hf.cache import (  # noqa: E402
    CacheBuilder,
    CacheDestination,
    CacheSnapshot,
    HostBuffers,
)
from restore.engines.torch_kv import numpy_view, torch_dtype  # noqa: E402
from restore.errors import InputError, RestoreError  # noqa: E402
from restore.pool import PagePool  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 8
TOKENS = 37  # not a multiple of any page, block or chunk size below
DTYPES = ("float16", "bfloat16", "float32")
_UINT = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32}
_EXPONENT = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000}


def layout_of(dtype: str) -> AttentionLayout:
    return AttentionLayout(LAYERS, HEADS, DIM, dtype)  # type: ignore[arg-type]


def random_kv(layout: AttentionLayout, tokens: int, seed: int) -> np.ndarray[Any, Any]:
    """`[L, 2, T, H, D]` of random bit patterns (signs, zeros, subnormals), all finite."""
    uint = _UINT[layout.dtype]
    exp = _EXPONENT[layout.dtype]
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(uint).max, size=(LAYERS, 2, tokens, HEADS, DIM), dtype=uint)
    bits[(bits & exp) == exp] ^= uint(exp & -exp)  # an all-ones exponent loses its lowest bit
    return bits.view(layout.numpy_dtype)


def nan_bits(dtype: str) -> Any:
    return {
        "float16": np.uint16(0x7E00),
        "bfloat16": np.uint16(0x7FC0),
        "float32": np.uint32(0x7FC00000),
    }[dtype]


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def torch_of(a: np.ndarray[Any, Any], dtype: str) -> torch.Tensor:
    """A torch tensor holding `a`'s bits (bfloat16 from its uint16 patterns)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def as_bits(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return numpy_view(t.contiguous())


class Engine(abc.ABC):
    """One implementation of the seams, built on CPU tensors in its engine's layout."""

    capacity: int | None  # positions one destination can hold here (None: any)
    snapshot_tokens = TOKENS

    def __init__(self, dtype: str) -> None:
        self.layout = layout_of(dtype)
        self.dtype = dtype

    @abc.abstractmethod
    def destination(self) -> Destination:
        """A fresh destination (the engine's memory holds other data around it)."""

    @abc.abstractmethod
    def visible(self, dest: Destination) -> np.ndarray[Any, Any]:
        """What the engine now sees through `dest`, read from the engine's own objects:
        `[L, 2, T, H, D]`, T = 0 when nothing became visible."""

    @abc.abstractmethod
    def untouched(self) -> Any:
        """A copy of the engine's state a destination must never change (other sequences'
        KV, free pages, memory outside its slots)."""

    @abc.abstractmethod
    def snapshot(self, kv: np.ndarray[Any, Any]) -> KVSnapshot:
        """`kv` put in the engine's memory by the engine's own means, then snapshotted."""

    @abc.abstractmethod
    def poison(self, position: int) -> None:
        """Write a NaN into the engine's memory at `position` of the last snapshot."""

    def bookkeeping(self) -> Any:
        """What a reservation holds and an abort or a refusal gives back (free pages, routes)."""
        return None

    def check(self) -> None:  # noqa: B027 - most engines keep no bookkeeping to check
        """Engine bookkeeping invariants."""


def _nothing(layout: AttentionLayout) -> np.ndarray[Any, Any]:
    return np.empty((LAYERS, 2, 0, HEADS, DIM), dtype=layout.numpy_dtype)


class PoolEngine(Engine):
    """A `PagePool` whose free pages are scattered among other routes."""

    capacity = 10 * 8  # 14 pages, 4 held by other routes

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        self.pool = PagePool(self.layout, page_size=8, num_pages=14)
        routes = []
        for seed in range(6):
            route = self.pool.new_route()
            kv = random_kv(self.layout, 8 if seed != 5 else 5, 100 + seed)
            self.pool.append(route, kv[:, 0], kv[:, 1])
            routes.append(route)
        for route in routes[1:5:2]:
            self.pool.release(route)  # free pages 1 and 3 first, then 6..13
        self.others = self.pool.routes()

    def destination(self) -> Destination:
        return PoolDestination(self.pool)

    def visible(self, dest: Destination) -> np.ndarray[Any, Any]:
        assert isinstance(dest, PoolDestination)
        if dest.route is None:
            assert self.pool.routes() == self.others, "a route appeared without a commit"
            return _nothing(self.layout)
        assert self.pool.routes() == [*self.others, dest.route]
        k, v = self.pool.read(dest.route)
        return np.stack([k, v], axis=1)

    def untouched(self) -> Any:
        return [np.stack(self.pool.read(r), axis=1).tobytes() for r in self.others]

    def bookkeeping(self) -> Any:
        return self.pool.free_pages, self.pool.routes()

    def snapshot(self, kv: np.ndarray[Any, Any]) -> KVSnapshot:
        route = self.pool.new_route()
        for a, b in ((0, 3), (3, 20), (20, kv.shape[2])):  # appended as a decoder would
            self.pool.append(route, kv[:, 0, a:b], kv[:, 1, a:b])
        self.lease = self.pool.lease(route)
        self.pool.append(route, kv[:, 0, :2], kv[:, 1, :2])  # the route moves on: copy-on-write
        return self.lease

    def poison(self, position: int) -> None:
        page = self.lease.pages[position // self.pool.page_size]
        uint = _UINT[self.dtype]
        self.pool.kv.view(uint)[1, 1, page, position % self.pool.page_size, 0, 0] = nan_bits(
            self.dtype
        )

    def check(self) -> None:
        self.pool.check_invariants()


class HFEngine(Engine):
    """transformers: `CacheDestination` becomes a `DynamicCache`; `CacheSnapshot` reads one."""

    capacity = None
    _model: Any = None

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        if HFEngine._model is None:
            config = LlamaConfig(
                vocab_size=64,
                hidden_size=HEADS * DIM,
                intermediate_size=32,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                num_key_value_heads=HEADS,
                head_dim=DIM,
            )
            torch.manual_seed(0)
            HFEngine._model = LlamaForCausalLM(config).eval()
        self.model = HFEngine._model
        self.held: list[Any] = []

    def destination(self) -> Destination:
        shard = Shard(0, LAYERS, 0, HEADS)
        return CacheBuilder(self.model, self.layout, shard, HostBuffers(0)).destination()

    def visible(self, dest: Destination) -> np.ndarray[Any, Any]:
        assert isinstance(dest, CacheDestination)
        if dest.cache is None:
            return _nothing(self.layout)
        layers = dest.cache.layers
        kv = [
            [as_bits(t[0].transpose(0, 1)) for t in (layer.keys, layer.values)] for layer in layers
        ]
        return np.stack([np.stack(pair) for pair in kv])

    def untouched(self) -> Any:
        return None  # a restore builds a new cache: there is nothing else to touch

    def snapshot(self, kv: np.ndarray[Any, Any]) -> KVSnapshot:
        cache = DynamicCache(config=self.model.config)
        for a, b in ((0, 5), (5, kv.shape[2])):  # a prefill, then more positions (concatenated)
            for i in range(LAYERS):
                k, v = (
                    torch_of(kv[i, j, a:b].transpose(1, 0, 2), self.dtype)[None] for j in (0, 1)
                )
                cache.update(k, v, i)
        snap = CacheSnapshot(cache.layers, self.layout, Shard(0, LAYERS, 0, HEADS), kv.shape[2])
        self.held = [layer.values for layer in cache.layers]  # what the snapshot reads
        k, v = (torch_of(kv[:, j, :1].transpose(0, 2, 1, 3), self.dtype) for j in (0, 1))
        for i in range(LAYERS):  # decoding goes on: the snapshot does not move
            cache.update(k[i : i + 1], v[i : i + 1], i)
        return snap

    def poison(self, position: int) -> None:
        numpy_view(self.held[0]).view(_UINT[self.dtype])[0, 1, position, 3] = nan_bits(self.dtype)


class VllmEngine(Engine):
    """vLLM: a request's `BlockTable` over `layer_views` of per-layer `[blocks, H, block, 2D]` tensors."""

    BLOCK = 16
    BLOCKS = 9
    TABLE = (6, 1, 4)  # the request's blocks, out of order
    capacity = BLOCK * len(TABLE)

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        g = torch.Generator().manual_seed(7)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.raw = {
            name: torch.randn((self.BLOCKS, HEADS, self.BLOCK, 2 * DIM), generator=g).to(
                torch_dtype(dtype)
            )
            for name in self.names
        }

    def _table(self, **kw: Any) -> Any:
        from restore.engines.vllm_blocks import BlockTable, layer_views

        views = layer_views(self.raw, self.names, self.layout, self.BLOCK)
        return BlockTable(views, self.layout, self.BLOCK, self.TABLE, **kw)

    def destination(self) -> Destination:
        return self._table()  # type: ignore[no-any-return]

    def read_raw(self, tokens: int) -> np.ndarray[Any, Any]:
        """Positions `[0, tokens)` of the table, decoded from vLLM's packed layout by hand."""
        layers = []
        for name in self.names:
            a = as_bits(self.raw[name])[list(self.TABLE)]  # [n, H, block, 2D]
            a = a.transpose(0, 2, 1, 3).reshape(-1, HEADS, 2 * DIM)[:tokens]
            layers.append(np.stack([a[..., :DIM], a[..., DIM:]]))
        return np.stack(layers)

    def write_raw(self, kv: np.ndarray[Any, Any]) -> None:
        for i, name in enumerate(self.names):
            bits = as_bits(self.raw[name])
            t = kv.shape[2]
            for p in range(t):
                block, off = self.TABLE[p // self.BLOCK], p % self.BLOCK
                bits[block, :, off, :DIM] = kv[i, 0, p]
                bits[block, :, off, DIM:] = kv[i, 1, p]
            numpy_view(self.raw[name])[...] = bits

    def visible(self, dest: Destination) -> np.ndarray[Any, Any]:
        restored: int = dest.restored  # type: ignore[attr-defined]
        return self.read_raw(restored)

    def untouched(self) -> Any:
        others = [b for b in range(self.BLOCKS) if b not in self.TABLE]
        return [as_bits(self.raw[name])[others].tobytes() for name in self.names]

    def snapshot(self, kv: np.ndarray[Any, Any]) -> KVSnapshot:
        self.write_raw(kv)
        return self._table(length=kv.shape[2])  # type: ignore[no-any-return]

    def poison(self, position: int) -> None:
        block, off = self.TABLE[position // self.BLOCK], position % self.BLOCK
        raw = numpy_view(self.raw[self.names[1]]).view(_UINT[self.dtype])
        raw[block, 1, off, DIM + 3] = nan_bits(self.dtype)


class SGLangEngine(Engine):
    """SGLang: the backend's `HostPages` over an MHA host pool's `kv_buffer`."""

    host_layout = "layer_first"
    PAGE = 8
    STARTS = (40, 8, 72, 24, 56)  # the call's pages, out of order
    capacity = PAGE * len(STARTS)
    snapshot_tokens = capacity  # a snapshot is whole pages

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        from tests.sglang.harness import host_pool

        _, self.host = host_pool(
            self.host_layout, dtype=torch_dtype(dtype), page_size=self.PAGE, device_tokens=48
        )
        assert (self.host.layer_num, self.host.head_num, self.host.head_dim) == (LAYERS, HEADS, DIM)
        g = torch.Generator().manual_seed(3)
        self.host.kv_buffer.copy_(torch.randn(self.host.kv_buffer.shape, generator=g))

    def _pages(self) -> Any:
        from restore.engines.sglang_pages import HostPages

        return HostPages(
            self.host.kv_buffer, self.host_layout, self.layout, self.PAGE, 0, list(self.STARTS)
        )

    def destination(self) -> Destination:
        return self._pages()  # type: ignore[no-any-return]

    def _slots(self, tokens: int) -> list[int]:
        return [self.STARTS[p // self.PAGE] + p % self.PAGE for p in range(tokens)]

    def read_raw(self, tokens: int) -> np.ndarray[Any, Any]:
        buf = numpy_view(self.host.kv_buffer)
        if self.host_layout == "layer_first":  # [2, L, slots, H, D]
            return buf[:, :, self._slots(tokens)].transpose(1, 0, 2, 3, 4)
        return buf[:, self._slots(tokens)].transpose(2, 0, 1, 3, 4)  # [2, slots, L, H, D]

    def visible(self, dest: Destination) -> np.ndarray[Any, Any]:
        committed: int = dest.committed  # type: ignore[attr-defined]
        return np.ascontiguousarray(self.read_raw(committed))

    def untouched(self) -> Any:
        buf = numpy_view(self.host.kv_buffer)
        mine = set(self._slots(self.capacity))
        others = [s for s in range(self.host.size) if s not in mine]
        if self.host_layout == "layer_first":
            return buf[:, :, others].tobytes()
        return buf[:, others].tobytes()

    def snapshot(self, kv: np.ndarray[Any, Any]) -> KVSnapshot:
        buf = numpy_view(self.host.kv_buffer)
        slots = self._slots(kv.shape[2])
        if self.host_layout == "layer_first":
            buf[:, :, slots] = kv.transpose(1, 0, 2, 3, 4)
        else:
            buf[:, slots] = kv.transpose(1, 2, 0, 3, 4)
        return self._pages()  # type: ignore[no-any-return]

    def poison(self, position: int) -> None:
        buf = numpy_view(self.host.kv_buffer).view(_UINT[self.dtype])
        slot = self._slots(position + 1)[position]
        if self.host_layout == "layer_first":
            buf[1, 0, slot, 1, 2] = nan_bits(self.dtype)
        else:
            buf[1, slot, 0, 1, 2] = nan_bits(self.dtype)


class SGLangPageFirstEngine(SGLangEngine):
    host_layout = "page_first"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


ENGINES: dict[str, tuple[type[Engine], str | None]] = {
    "pool": (PoolEngine, None),
    "transformers": (HFEngine, None),
    "vllm": (VllmEngine, "restore.engines.vllm"),
    "sglang-layer_first": (SGLangEngine, "restore.engines.sglang"),
    "sglang-page_first": (SGLangPageFirstEngine, "restore.engines.sglang"),
}


@pytest.fixture(
    params=[
        pytest.param(
            (name, dtype),
            id=f"{name}-{dtype}",
            marks=pytest.mark.skipif(
                module is not None and not _importable(module), reason=f"{module} not importable"
            ),
        )
        for name, (_cls, module) in ENGINES.items()
        for dtype in DTYPES
    ]
)
def engine(request: pytest.FixtureRequest) -> Engine:
    name, dtype = request.param
    return ENGINES[name][0](dtype)


def spans(tokens: int, sizes: list[int]) -> Iterator[tuple[int, int]]:
    """`[0, tokens)` cut into consecutive spans of `sizes` (cycled); the last is a tail."""
    at, i = 0, 0
    while at < tokens:
        end = min(at + sizes[i % len(sizes)], tokens)
        yield at, end
        at, i = end, i + 1


def write_all(
    dest: Destination,
    kv: np.ndarray[Any, Any],
    sizes: list[int],
    *,
    order: int = 0,
    threads: int = 1,
) -> None:
    """Write `kv` as chunk payloads of `sizes`, each followed by positions of garbage the chunk
    does not use (a stored chunk served in part), in shuffled order from `threads` threads."""
    cut = list(spans(kv.shape[2], sizes))
    random.Random(order).shuffle(cut)
    garbage = random_kv(dest.layout, 7, 999)

    def one(span: tuple[int, int]) -> None:
        a, b = span
        dest.write(np.concatenate([kv[:, :, a:b], garbage], axis=2), a, b - a)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, cut))


def test_a_round_trip_is_bit_exact(engine: Engine) -> None:
    before = engine.untouched()
    kv = random_kv(engine.layout, TOKENS, 1)
    dest = engine.destination()
    assert dest.layout == engine.layout
    dest.reserve(TOKENS)
    write_all(dest, kv, [13], threads=4)
    dest.commit(TOKENS)
    assert same_bits(engine.visible(dest), kv)
    assert engine.untouched() == before
    engine.check()


@pytest.mark.parametrize(
    "sizes", [[1], [3, 5], [7], [8], [9, 2], [16], [17, 1, 30], [TOKENS]], ids=str
)
def test_writes_land_at_any_offset_in_any_length(engine: Engine, sizes: list[int]) -> None:
    """Chunk boundaries not aligned to pages or blocks, single positions, spans crossing several
    pages, a tail; the positions of a payload past `count` never land."""
    before = engine.untouched()
    kv = random_kv(engine.layout, TOKENS, 2)
    dest = engine.destination()
    dest.reserve(TOKENS)
    write_all(dest, kv, sizes, order=len(sizes))
    dest.commit(TOKENS)
    assert same_bits(engine.visible(dest), kv)
    assert engine.untouched() == before


def test_a_commit_of_fewer_positions_shows_only_those(engine: Engine) -> None:
    kv = random_kv(engine.layout, TOKENS, 3)
    dest = engine.destination()
    dest.reserve(TOKENS)
    write_all(dest, kv, [10])
    dest.commit(21)  # the restore's longest verified prefix: positions past it were written too
    assert same_bits(engine.visible(dest), np.ascontiguousarray(kv[:, :, :21]))
    engine.check()


def test_abort_leaves_nothing_visible_and_everything_as_it_was(engine: Engine) -> None:
    before, held = engine.untouched(), engine.bookkeeping()
    kv = random_kv(engine.layout, TOKENS, 4)
    dest = engine.destination()
    dest.reserve(TOKENS)
    write_all(dest, kv[:, :, :25], [6], threads=2)
    dest.abort()
    assert engine.visible(dest).shape[2] == 0
    assert engine.untouched() == before
    assert engine.bookkeeping() == held
    engine.check()
    again = engine.destination()  # what the abort gave back serves the next restore
    again.reserve(TOKENS)
    write_all(again, kv, [TOKENS])
    again.commit(TOKENS)
    assert same_bits(engine.visible(again), kv)


@pytest.mark.parametrize("other", [*DTYPES, "float64"])
def test_a_payload_of_another_dtype_is_refused_by_name(engine: Engine, other: str) -> None:
    if other == engine.dtype:
        pytest.skip("the destination's own dtype")
    kv = random_kv(engine.layout, TOKENS, 5)
    wrong = (
        random_kv(layout_of(other), TOKENS, 6)
        if other in DTYPES
        else kv.view(engine.layout.numpy_dtype).astype(np.float64)
    )
    dest = engine.destination()
    dest.reserve(TOKENS)
    write_all(dest, kv, [TOKENS])
    with pytest.raises(InputError, match=f"is {wrong.dtype}.*takes {engine.layout.numpy_dtype}"):
        dest.write(wrong, 0, TOKENS)
    dest.commit(TOKENS)
    assert same_bits(engine.visible(dest), kv)  # the refused write changed nothing


WRONG_SHAPES = {
    "one layer (numpy would broadcast it)": lambda kv: kv[:1],
    "one kv head (numpy would broadcast it)": lambda kv: kv[:, :, :, :1],
    "another head dim": lambda kv: np.concatenate([kv, kv[..., :1]], axis=4),
    "no K/V axis": lambda kv: kv[:, 0],
    "K only": lambda kv: kv[:, :1],
    "fewer positions than count": lambda kv: kv[:, :, :-1],
}


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_a_payload_of_another_shape_is_refused_by_name(engine: Engine, case: str) -> None:
    kv = random_kv(engine.layout, TOKENS, 7)
    dest = engine.destination()
    dest.reserve(TOKENS)
    write_all(dest, kv, [TOKENS])
    wrong = WRONG_SHAPES[case](random_kv(engine.layout, TOKENS, 8))
    lay = engine.layout
    named = (
        rf"shaped \[{', '.join(map(str, wrong.shape))}\].*{lay.num_layers} layers.*"
        rf"{lay.num_kv_heads} kv heads.*{lay.head_dim} head dim"
    )
    with pytest.raises(InputError, match=named):
        dest.write(wrong, 0, TOKENS)
    dest.commit(TOKENS)
    assert same_bits(engine.visible(dest), kv)


def test_writes_outside_the_reservation_are_refused(engine: Engine) -> None:
    before, held = engine.untouched(), engine.bookkeeping()
    kv = random_kv(engine.layout, TOKENS, 9)
    dest = engine.destination()
    with pytest.raises(InputError, match="reserved"):
        dest.write(kv, 0, 5)  # nothing reserved yet
    dest.reserve(20)
    with pytest.raises(InputError, match=r"\[15, 25\).*20 reserved"):
        dest.write(kv, 15, 10)
    with pytest.raises(ValueError, match="start"):
        dest.write(kv, -1, 5)
    dest.abort()
    assert engine.visible(dest).shape[2] == 0
    assert engine.untouched() == before
    assert engine.bookkeeping() == held


def test_reserving_more_than_it_holds_is_refused_and_changes_nothing(engine: Engine) -> None:
    if engine.capacity is None:
        pytest.skip("this destination allocates what it is asked for")
    before, held = engine.untouched(), engine.bookkeeping()
    dest = engine.destination()
    with pytest.raises(RestoreError, match=r"free|holds|fit"):  # each says what it has
        dest.reserve(engine.capacity + 1)
    assert engine.bookkeeping() == held
    assert engine.untouched() == before
    dest.reserve(engine.capacity)  # all of it is there
    dest.abort()
    assert engine.bookkeeping() == held


RANGES = [(0, None), (0, 1), (3, 20), (7, 9), (8, 16), (15, 33), (-1, None), (None, None)]


def ranges(tokens: int) -> list[tuple[int, int]]:
    """`RANGES` with None as `tokens` and -1 as `tokens - 1`: whole, single, misaligned, empty."""
    fix = {None: tokens, -1: tokens - 1}
    return [(fix.get(a, a), fix.get(b, b)) for a, b in RANGES]  # type: ignore[arg-type]


def test_a_snapshot_reads_back_what_is_there_in_ranges(engine: Engine) -> None:
    t = engine.snapshot_tokens
    kv = random_kv(engine.layout, t, 10)
    snap = engine.snapshot(kv)
    assert snap.layout == engine.layout
    assert snap.length == t
    for a, b in ranges(t):
        assert same_bits(snap.read_kv(a, b), np.ascontiguousarray(kv[:, :, a:b])), (a, b)
    for a, b in ((0, t + 1), (5, 4)):
        with pytest.raises(ValueError, match="range"):
            snap.read_kv(a, b)


def test_every_snapshot_is_read_in_place(engine: Engine) -> None:
    """`InPlaceSnapshot`: copied out into a record's payload in one copy, scanned for NaN/Inf
    without one; an `out` of another dtype or shape is refused by name."""
    t = engine.snapshot_tokens
    kv = random_kv(engine.layout, t, 11)
    snap = engine.snapshot(kv)
    assert isinstance(snap, InPlaceSnapshot)
    for a, b in ranges(t):
        out = np.full((LAYERS, 2, b - a, HEADS, DIM), 0x55, dtype=_UINT[engine.dtype]).view(
            engine.layout.numpy_dtype
        )
        snap.read_kv_into(out, a, b)
        assert same_bits(out, np.ascontiguousarray(kv[:, :, a:b])), (a, b)
    with pytest.raises(ValueError, match="float64"):
        snap.read_kv_into(np.zeros((LAYERS, 2, 4, HEADS, DIM)), 0, 4)
    with pytest.raises(ValueError, match="shaped"):
        snap.read_kv_into(np.zeros((LAYERS, 2, 5, HEADS, DIM), engine.layout.numpy_dtype), 0, 4)
    snap.check_finite(0, t)
    engine.poison(19)
    with pytest.raises(ValueError, match="NaN"):
        snap.check_finite(0, t)
    with pytest.raises(ValueError, match="NaN"):
        snap.check_finite(19, 20)
    snap.check_finite(0, 19)
    snap.check_finite(20, t)
