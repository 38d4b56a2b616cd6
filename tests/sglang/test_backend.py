"""kvc's SGLang backend called directly, over SGLang's real host pool: lineage in the catalog,
the single-page calls, PostgreSQL and S3, the leading run, bad input, refusals, tensor
parallelism and a catalog rebuilt from the store.

The backend is built by SGLang's own dynamic factory from the extra config a user
pastes (`open_backend`); calls pass `prefix_keys` as SGLang's controllers do
(None at the root of a hit query; the anchor's ancestors below it). The controller
itself drives the backend in tests/sglang/test_controller.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from catalog import Catalog, prefix_hashes
from restore.engines.sglang import page_symbols
from restore.errors import InputError, UnsupportedModelError
from tests.rebuild_helpers import kvc_rebuild, lose_catalog, names
from tests.sglang.conftest import NS
from tests.sglang.harness import (
    PAGE,
    SGLangRank,
    config_arg,
    fill,
    host_pool,
    kvc_extra_config,
    open_backend,
    page_bytes,
    page_keys,
)

P = PAGE


def info(prefix: list[str] | None) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def keys_for(pages: int, first: int = 1000) -> list[str]:
    return page_keys(list(range(first, first + pages * P)))


def pages_of(indices: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return indices[lo * P : hi * P]


@pytest.fixture
def env(request: pytest.FixtureRequest, kvc: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """kvc's extra config: SQLite + local store unless parametrized to PostgreSQL + S3."""
    if getattr(request, "param", None) == "postgres-s3":
        db = request.getfixturevalue("postgres_url")
        Catalog.open(db, upgrade=True).close()
        return {**kvc, "catalog": db, "stores": [request.getfixturevalue("s3_url")]}
    return kvc


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_set_then_get_bit_for_bit_with_lineage_in_the_catalog(
    env: dict[str, Any], layout: str
) -> None:
    _, host = host_pool(layout)
    kv = open_backend(env, host)
    keys = keys_for(5)
    src = fill(host, 5 * P, seed=1)
    want = page_bytes(host, src)
    # SGLang writes a sequence in batches; the second batch names the pages before it.
    assert kv.batch_set_v1(keys[:3], pages_of(src, 0, 3), info([])) == [True] * 3
    assert kv.batch_set_v1(keys[3:], pages_of(src, 3, 5), info(keys[:3])) == [True] * 2
    dst = host.alloc(5 * P)
    # From the root: SGLang's hit query passes None.
    assert kv.batch_exists(keys, info(None)) == 5
    assert kv.batch_get_v1(keys, dst, info([])) == [True] * 5
    assert page_bytes(host, dst) == want
    # Each page is a chunk whose parent is the previous page, its key first in its symbols.
    head = prefix_hashes(NS, page_symbols(keys, P), P)[-1]
    lineage = kv.catalog.lineage(NS, head)
    assert [n.token_start for n in lineage] == [0, 8, 16, 24, 32]
    for node, key in zip(lineage, keys, strict=True):
        assert bytes.fromhex(key) == b"".join(t.to_bytes(4, "big") for t in node.tokens[:8])
    # The single-page calls: a flat page in host order, found from its key.
    flat = host.get_dummy_flat_data_page()
    assert kv.get(keys[4], flat) is flat
    assert torch.equal(flat, host.get_data_page(int(src[4 * P])))
    assert kv.exists(keys[4])
    kv.close()


@pytest.mark.s3
@pytest.mark.postgres
@pytest.mark.parametrize("env", ["postgres-s3"], indirect=True)
def test_pages_round_trip_through_postgresql_and_a_real_s3(env: dict[str, Any]) -> None:
    _, host = host_pool("page_first", dtype=torch.float16)
    kv = open_backend(env, host)
    keys = keys_for(3)
    src = fill(host, 3 * P, seed=2)
    assert kv.batch_set_v1(keys, src, info([])) == [True] * 3
    dst = host.alloc(3 * P)
    assert kv.batch_exists(keys, info(None)) == 3
    assert kv.batch_get_v1(keys, dst, info([])) == [True] * 3
    assert page_bytes(host, dst) == page_bytes(host, src)
    kv.close()


def test_batch_exists_counts_the_leading_run_only(env: dict[str, Any]) -> None:
    _, host = host_pool("layer_first")
    kv = open_backend(env, host)
    keys = keys_for(4)
    assert kv.batch_set_v1(keys, fill(host, 4 * P, seed=3), info([])) == [True] * 4
    (other,) = keys_for(1, first=5000)
    assert kv.batch_exists([*keys[:2], other, keys[3]], info(None)) == 2
    # A page is found from its key whatever SGLang passes: the key commits to its prefix.
    assert kv.batch_exists(keys[1:], info(None)) == 3
    assert kv.batch_exists(keys[2:], info(keys[:1])) == 2  # the anchor's ancestors only
    assert kv.batch_exists(keys[2:], info(keys[:2])) == 2  # every page before them
    assert kv.batch_exists(keys[2:], info(keys_for(2, first=7000))) == 2  # a wrong hint
    assert kv.batch_exists([other, *keys], info(None)) == 0  # the leading run only
    kv.close()


def test_a_page_stored_under_two_lineages_is_found_either_way(env: dict[str, Any]) -> None:
    """A backup whose ancestors had no key yet passes a truncated chain (SGLang's
    `get_prefix_hash_values` stops at a node without hashes): the same page at the root."""
    _, host = host_pool("layer_first")
    kv = open_backend(env, host)
    keys = keys_for(3)
    src = fill(host, 3 * P, seed=7)
    want = page_bytes(host, src)
    assert kv.batch_set_v1(keys, src, info([])) == [True] * 3
    assert kv.batch_set_v1(keys[2:], pages_of(src, 2, 3), info([])) == [True]
    depths = [n.depth for n in kv.catalog.prefixes_with_tokens(NS, page_symbols(keys[2:], P))]
    assert depths == [0, 2]
    for hint in (keys[:1], None):
        dst = host.alloc(P)
        assert kv.batch_exists(keys[2:], info(hint)) == 1
        assert kv.batch_get_v1(keys[2:], dst, info(hint)) == [True]
        assert page_bytes(host, dst) == want[2:]
    kv.close()


def _chunks(kv: Any) -> int:
    return int(kv.catalog.stats(NS)["chunks"])


def test_bad_input_is_refused_or_missed_and_changes_nothing(env: dict[str, Any]) -> None:
    _, host = host_pool("layer_first")
    kv = open_backend(env, host)
    keys = keys_for(2)
    src = fill(host, 2 * P, seed=6)
    assert kv.batch_set_v1(keys, src, info([])) == [True, True]
    before = (_chunks(kv), sorted(kv.stores[0].keys()))
    unknown = keys_for(2, first=9000)
    dst = host.alloc(2 * P)
    # Empty lists.
    assert kv.batch_exists([], info(None)) == 0
    assert kv.batch_get_v1([], torch.arange(0), info([])) == []
    assert kv.batch_set_v1([], torch.arange(0), info([])) == []
    # Unknown keys are misses.
    assert kv.batch_exists(unknown, info(None)) == 0
    assert kv.batch_get_v1(unknown, dst, info([])) == [False, False]
    assert kv.get(unknown[0], host.get_dummy_flat_data_page()) is None
    assert not kv.exists(unknown[0])
    # A write without the preceding keys cannot be placed (its parent is unknown): refused.
    assert kv.batch_set_v1(unknown, src, info(None)) == [False, False]
    # A page whose parent kvc does not hold is refused (its lineage would be broken).
    assert kv.batch_set_v1(unknown[1:], pages_of(src, 0, 1), info(unknown[:1])) == [False]
    # A single page whose place no call has told cannot be placed: not stored.
    assert not kv.set(keys_for(1, first=11000)[0], host.get_data_page(int(src[0])).flatten())
    # Malformed keys, wrong index counts, wrong dtype or size: a clear error.
    with pytest.raises(InputError, match="64 lowercase hex"):
        kv.batch_exists(["not-a-key"], info(None))
    with pytest.raises(InputError, match="host indices"):
        kv.batch_get_v1(keys, pages_of(src, 0, 1), info([]))
    with pytest.raises(InputError, match="consecutive"):
        kv.batch_set_v1(keys[:1], pages_of(src, 0, 1).flip(0), info([]))
    with pytest.raises(InputError, match="flat page"):
        kv.get(keys[0], torch.zeros(2 * 2 * P * 2 * 8, dtype=torch.float32))
    with pytest.raises(InputError, match="flat page"):
        kv.set(keys[0], torch.zeros(7, dtype=host.dtype))
    assert (_chunks(kv), sorted(kv.stores[0].keys())) == before
    kv.close()


@pytest.mark.parametrize(
    ("pool_args", "config", "match"),
    [
        ({}, {"is_mla_model": True}, "MLA"),
        ({}, {"pp_size": 2}, "pipeline"),
        ({"layout": "page_head"}, {}, "layout 'page_head'"),
        ({"layout": "page_first_direct"}, {}, "layout 'page_first_direct'"),
        ({"page_size": 4}, {}, "page size 4"),
        ({"dtype": torch.float8_e4m3fn}, {}, "host KV dtype"),
    ],
    ids=["mla", "pipeline", "page-head-layout", "page-first-direct", "small-pages", "fp8"],
)
def test_what_kvc_cannot_store_exactly_is_refused_by_name(
    env: dict[str, Any], pool_args: dict[str, Any], config: dict[str, Any], match: str
) -> None:
    _, host = host_pool(**{"layout": "layer_first", **pool_args})
    with pytest.raises(UnsupportedModelError, match=match):
        open_backend(env, host, **config)


def test_tensor_parallel_ranks_are_shards_of_one_fingerprint(env: dict[str, Any]) -> None:
    ranks = [open_backend(env, host_pool("layer_first")[1], tp_rank=r, tp_size=2) for r in (0, 1)]
    assert ranks[0].fingerprint == ranks[1].fingerprint
    assert [(b.shard.head_lo, b.shard.head_hi) for b in ranks] == [(0, 2), (2, 4)]
    for b in ranks:
        b.close()
    cat = Catalog.open(env["catalog"])
    assert cat.namespace_chunk_size(NS) == P
    cat.close()


def test_the_catalog_comes_back_from_the_store_alone_names_included(
    env: dict[str, Any], rank_group: Any
) -> None:
    """The backend journals by default: a pin and refs made through its catalog and a deleted
    ref survive losing the catalog (`kvc rebuild --from` the store); a new backend hits."""
    _, host = host_pool("page_first")
    kv = open_backend(env, host)
    keys = keys_for(4)
    src = fill(host, 4 * P, seed=9)
    want = page_bytes(host, src)
    assert kv.batch_set_v1(keys, src, info([])) == [True] * 4
    assert kv.fingerprint is not None
    head = prefix_hashes(NS, page_symbols(keys, P), P)[-1]
    kv.catalog.create_ref(NS, "conversation", kv.fingerprint, head)
    kv.catalog.create_ref(NS, "draft", kv.fingerprint, head)
    kv.catalog.delete_ref(NS, "draft")
    kv.catalog.pin(NS, "system", head)
    kv.close()
    before = names(env["catalog"], NS)
    assert set(before[0]) == {"conversation"} and set(before[1]) == {"system"}
    lose_catalog(env["catalog"])
    assert kvc_rebuild(env["catalog"], env["stores"])["complete"]
    assert names(env["catalog"], NS) == before
    rank = SGLangRank(config_arg(kvc_extra_config(env)), layout="page_first", group=rank_group)
    try:
        got = rank.prefetch(list(range(1000, 1000 + 4 * P)), [])
        assert (got.hit_tokens, got.loaded_tokens) == (4 * P, 4 * P)
        assert rank.page_bytes(got.host_indices) == want
    finally:
        rank.close()
