"""`StagedKV`: the host copy a save publishes from once the engine's memory is released."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog.catalog import Catalog
from chunkstore import open_store
from restore.checkpoint import Checkpointer
from restore.encode import InPlaceSnapshot
from restore.engines.reference import ReferenceModel
from restore.errors import InputError
from restore.pool import PagePool
from restore.staging import StagedKV

MODEL = ReferenceModel.small(seed=0)
LAYOUT = MODEL.layout


def pool_route(tokens: int) -> tuple[PagePool, int, np.ndarray[Any, Any]]:
    """A route holding the reference model's KV of `tokens` positions, and a copy of it."""
    pool = PagePool(LAYOUT, page_size=16, num_pages=64)
    route = pool.new_route()
    MODEL.prefill(pool, route, list(range(1, tokens + 1)))
    with pool.lease(route) as lease:
        return pool, route, lease.read_kv(0, tokens)


def test_a_staged_copy_outlives_the_memory_it_was_copied_from() -> None:
    pool, route, kv = pool_route(100)
    with pool.lease(route) as lease:
        staged = StagedKV.copy_of(lease, 80)
    pool.release(route)  # the engine's memory is released and reused
    MODEL.prefill(pool, pool.new_route(), list(range(100, 200)))
    assert isinstance(staged, InPlaceSnapshot)
    assert staged.length == 80 and staged.layout == LAYOUT
    assert staged.read_kv(0, 80).tobytes() == np.ascontiguousarray(kv[:, :, :80]).tobytes()
    out = np.empty(kv[:, :, 10:40].shape, LAYOUT.numpy_dtype)
    staged.read_kv_into(out, 10, 40)
    assert out.tobytes() == np.ascontiguousarray(kv[:, :, 10:40]).tobytes()
    with pytest.raises(ValueError, match="range"):
        staged.read_kv(0, 81)
    staged.kv[-1, 0, 5, 0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        staged.check_finite(0, 80)
    staged.check_finite(6, 80)


def test_an_array_of_another_layout_is_refused_by_name() -> None:
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    other = np.float64 if LAYOUT.numpy_dtype != np.float64 else np.float32
    with pytest.raises(InputError, match=np.dtype(other).name):
        StagedKV(LAYOUT, np.zeros((L, 2, 4, H, D), other))
    with pytest.raises(InputError, match="shaped"):
        StagedKV(LAYOUT, np.zeros((L, 2, 4, H + 1, D), LAYOUT.numpy_dtype))


def test_a_staged_copy_publishes_the_same_chunks_as_the_memory_it_came_from(tmp_path: Path) -> None:
    pool, route, _kv = pool_route(100)
    tokens = list(range(1, 101))
    fp = MODEL.fingerprint
    with pool.lease(route) as lease:
        staged = StagedKV.copy_of(lease, 100)
    keys = []
    for name, snapshot in (("lease", None), ("staged", staged)):
        with (
            Catalog.open(f"sqlite:///{tmp_path / name}.db", upgrade=True) as cat,
            Checkpointer(cat, open_store(f"file://{tmp_path / name}"), "ns", 32) as ck,
        ):
            if snapshot is None:
                ck.checkpoint(pool, route, tokens, fp)
            else:
                ck.checkpoint_snapshot(snapshot, tokens, fp)
            keys.append([c.blob_key for c in cat.lookup("ns", fp.hex, [*tokens, 0]).chunks])
    a, b = keys
    assert len(a) == 4
    assert a == b
