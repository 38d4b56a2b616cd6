"""SGLang's HiCache stores and loads KV pages through kvc: bit-exact, verified, durable across processes.

The backend is built by SGLang's own dynamic factory (`StorageBackendFactory`,
sglang 0.5.23) from the extra config a user pastes; the host pool is a faithful
minimal MHA host pool (tests/restore/engines/sglang_worker.py says why not the real class).
Reads are asked with the arguments SGLang's controllers send (`hit_query`,
`page_transfer`): `prefix_keys=None` at the root, the anchor's ancestors only
below it; writes with those of its backup (the node's ancestors, `[]` at the root).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from catalog import Catalog, prefix_hashes
from restore.engines.sglang import KvcHiCacheStorage, page_symbols
from restore.errors import InputError, UnsupportedModelError
from tests.rebuild_helpers import kvc_rebuild, lose_catalog, names
from tests.restore.engines.sglang_worker import HostPool, hit_query, open_backend, page_transfer

NS = "sglang-test"
P = 8


def keys_for(text: str, n: int) -> list[str]:
    """n chained page keys, like SGLang's (sha256 hex over the previous key and the page)."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{text}/{i}".encode()).digest()
        out.append(prev.hex())
    return out


def info(prefix: list[str] | None) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def fill(pool: HostPool, first_slot: int, pages: int, seed: int) -> None:
    """Random finite KV in `pages` pages from `first_slot`."""
    g = torch.Generator().manual_seed(seed)
    for j in range(pages):
        page = pool.get_data_page(first_slot + j * P, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(pool.dtype))


def page_bytes(pool: HostPool, slot: int) -> bytes:
    return pool.get_data_page(slot).view(torch.uint8).numpy().tobytes()


def slots(first: int, pages: int) -> torch.Tensor:
    return torch.arange(first, first + pages * P)


@pytest.fixture
def env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The extra config: SQLite + local store unless the test is parametrized otherwise."""
    catalog_kind, store_kind = getattr(request, "param", ("sqlite", "local"))
    db = (
        request.getfixturevalue("postgres_url")
        if catalog_kind == "postgres"
        else f"sqlite:///{tmp_path / 'catalog.db'}"
    )
    stores = [
        request.getfixturevalue("s3_url") if store_kind == "s3" else f"file://{tmp_path / 'blobs'}"
    ]
    Catalog.open(db, upgrade=True).close()  # `kvc init`
    return {"catalog": db, "stores": stores, "namespace": NS, "weights_id": "tiny-model@test"}


def test_pages_set_then_get_bit_for_bit_with_lineage_in_the_catalog(env: dict[str, Any]) -> None:
    for layout in ("layer_first", "page_first"):
        extra = {**env, "namespace": f"{NS}-{layout.replace('_', '-')}"}
        pool = HostPool(layout)
        kv = open_backend(extra, pool)
        keys = keys_for(layout, 5)
        fill(pool, 0, 5, seed=1)
        want = [page_bytes(pool, j * P) for j in range(5)]
        # SGLang writes a sequence in batches; the second batch names the pages before it.
        assert kv.batch_set_v1(keys[:3], slots(0, 3), info([])) == [True] * 3
        assert kv.batch_set_v1(keys[3:], slots(3 * P, 2), info(keys[:3])) == [True] * 2
        # A request from the root: SGLang asks with prefix_keys=None, then loads with [].
        assert hit_query(kv, [], keys[:2]) == 2
        assert page_transfer(kv, [], keys[:2], slots(8 * P, 2)) == [True, True]
        # A request anchored at the node holding pages 0-1 (a child of the root): SGLang
        # passes its ancestors, none, not the anchor's own pages.
        assert hit_query(kv, [], keys[2:]) == 3
        assert page_transfer(kv, [], keys[2:], slots(10 * P, 3)) == [True] * 3
        assert [page_bytes(pool, (8 + j) * P) for j in range(5)] == want
        # Anchored deeper, at a node holding page 2 under the node of pages 0-1: keys[:2].
        assert hit_query(kv, keys[:2], keys[3:]) == 2
        assert page_transfer(kv, keys[:2], keys[3:], slots(13 * P, 2)) == [True, True]
        assert [page_bytes(pool, (13 + j) * P) for j in range(2)] == want[3:]
        # Each page is a chunk whose parent is the previous page, its key first in its symbols.
        cat = kv.catalog
        head = prefix_hashes(extra["namespace"], page_symbols(keys, P), P)[-1]
        lineage = cat.lineage(extra["namespace"], head)
        assert [n.token_start for n in lineage] == [0, 8, 16, 24, 32]
        for node, key in zip(lineage, keys, strict=True):
            assert bytes.fromhex(key) == b"".join(t.to_bytes(4, "big") for t in node.tokens[:8])
        # The single-page calls serve keys whose place was learned: a flat page in host order.
        flat = pool.get_dummy_flat_data_page()
        assert kv.get(keys[4], flat) is flat
        assert flat.view(torch.uint8).numpy().tobytes() == want[4]
        assert kv.exists(keys[4])
        kv.close()


@pytest.mark.s3
@pytest.mark.postgres
@pytest.mark.parametrize("env", [("postgres", "s3")], indirect=True, ids=["postgres-s3"])
def test_pages_round_trip_through_postgresql_and_a_real_s3(env: dict[str, Any]) -> None:
    pool = HostPool("page_first", dtype=torch.float16)
    kv = open_backend(env, pool)
    keys = keys_for("s3", 3)
    fill(pool, 0, 3, seed=2)
    want = [page_bytes(pool, j * P) for j in range(3)]
    assert kv.batch_set_v1(keys, slots(0, 3), info([])) == [True] * 3
    assert hit_query(kv, [], keys) == 3
    assert page_transfer(kv, [], keys, slots(4 * P, 3)) == [True] * 3
    assert [page_bytes(pool, (4 + j) * P) for j in range(3)] == want
    kv.close()


def test_batch_exists_counts_the_leading_run_only(env: dict[str, Any]) -> None:
    pool = HostPool("layer_first")
    kv = open_backend(env, pool)
    keys = keys_for("run", 4)
    fill(pool, 0, 4, seed=3)
    assert kv.batch_set_v1(keys, slots(0, 4), info([])) == [True] * 4
    other = keys_for("other", 1)[0]
    assert hit_query(kv, [], [*keys[:2], other, keys[3]]) == 2
    # A page is found from its key whatever SGLang passes: the key commits to its prefix.
    assert hit_query(kv, [], keys[1:]) == 3
    assert hit_query(kv, keys[:1], keys[2:]) == 2  # the anchor's ancestors only
    assert hit_query(kv, keys[:2], keys[2:]) == 2  # every page before them
    assert kv.batch_exists(keys[2:], info(keys_for("unrelated", 2))) == 2  # a wrong hint
    assert hit_query(kv, [], [other, *keys]) == 0  # the leading run only
    kv.close()


def test_a_page_stored_under_two_lineages_is_found_either_way(env: dict[str, Any]) -> None:
    """A backup whose ancestors had no key yet passes a truncated chain (SGLang's
    `get_prefix_hash_values` stops at a node without hashes): the same page at the root."""
    pool = HostPool("layer_first")
    kv = open_backend(env, pool)
    keys = keys_for("twice", 3)
    fill(pool, 0, 3, seed=7)
    want = [page_bytes(pool, j * P) for j in range(3)]
    assert kv.batch_set_v1(keys, slots(0, 3), info([])) == [True] * 3
    assert kv.batch_set_v1(keys[2:], slots(2 * P, 1), info([])) == [True]
    assert [n.depth for n in kv.catalog.prefixes_with_tokens(NS, page_symbols(keys[2:], P))] == [
        0,
        2,
    ]
    assert hit_query(kv, keys[:1], keys[2:]) == 1  # the lineage that agrees with the hint
    assert page_transfer(kv, keys[:1], keys[2:], slots(8 * P, 1)) == [True]
    assert hit_query(kv, [], keys[2:]) == 1
    assert page_transfer(kv, [], keys[2:], slots(9 * P, 1)) == [True]
    assert [page_bytes(pool, 8 * P), page_bytes(pool, 9 * P)] == [want[2], want[2]]
    kv.close()


def _blob_file(tmp_path: Path, kv: KvcHiCacheStorage, keys: list[str], page: int) -> Path:
    assert kv.fingerprint is not None
    h = prefix_hashes(NS, page_symbols(keys, P), P)[page]
    blob = kv.catalog.known_blob_keys(NS, kv.fingerprint, [h], kv.shard)[h]
    (path,) = [p for p in (tmp_path / "blobs").rglob(f"*{blob}*") if p.is_file()]
    return path


def test_a_corrupt_page_is_a_miss_never_bad_bytes_and_is_marked(
    env: dict[str, Any], tmp_path: Path
) -> None:
    pool = HostPool("layer_first")
    kv = open_backend(env, pool)
    keys = keys_for("corrupt", 3)
    fill(pool, 0, 3, seed=4)
    want = [page_bytes(pool, j * P) for j in range(3)]
    assert kv.batch_set_v1(keys, slots(0, 3), info([])) == [True] * 3
    path = _blob_file(tmp_path, kv, keys, 1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a flipped bit in the payload, at rest
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    sentinel = torch.full((3 * P,), 7.0).to(pool.dtype)
    pool.kv_buffer[:, :, 8 * P : 11 * P] = sentinel.view(1, 1, -1, 1, 1)
    assert page_transfer(kv, [], keys, slots(8 * P, 3)) == [True, False, False]
    assert page_bytes(pool, 8 * P) == want[0]
    assert torch.equal(
        pool.get_data_page(9 * P, flat=False),
        torch.full_like(pool.get_data_page(9 * P, flat=False), 7.0),
    )
    # The replica is marked corrupt: the exists run now ends before it, for every process.
    assert hit_query(kv, [], keys) == 1
    assert get_in_new_process(env, keys)["hits"] == 1
    marks = [e for e in kv.catalog.events(namespace=NS) if "corrupt" in json.dumps(e.details)]
    assert [e.actor for e in marks] == ["sglang:tp0"]
    kv.close()


def get_in_new_process(
    env: dict[str, Any], keys: list[str], prefix: list[str] | None = None
) -> dict[str, Any]:
    """What a new SGLang process (tests/restore/engines/sglang_worker.py) finds and reads of these pages,
    asked from an anchor whose ancestors are `prefix` (default: the root)."""
    args = json.dumps({"layout": "page_first", "extra": env, "keys": keys, "prefix": prefix or []})
    out = subprocess.run(
        [sys.executable, "-m", "tests.restore.engines.sglang_worker", args],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def test_a_new_process_sees_every_page(env: dict[str, Any]) -> None:
    pool = HostPool("page_first")
    kv = open_backend(env, pool)
    keys = keys_for("restart", 4)
    fill(pool, 0, 4, seed=5)
    want = [page_bytes(pool, j * P).hex() for j in range(4)]
    assert kv.batch_set_v1(keys, slots(0, 4), info([])) == [True] * 4
    kv.close()
    # After a restart SGLang's radix tree is empty: every lookup is anchored at the root.
    result = get_in_new_process(env, keys)
    assert result == {"hits": 4, "loaded": [True] * 4, "pages": want}
    # Once pages 0-1 are back on the host as a node, the rest is asked from that anchor.
    result = get_in_new_process(env, keys[2:])
    assert result == {"hits": 2, "loaded": [True] * 2, "pages": want[2:]}
    # And from a deeper anchor (page 2 under the node of pages 0-1): its ancestors only.
    result = get_in_new_process(env, keys[3:], prefix=keys[:2])
    assert result == {"hits": 1, "loaded": [True], "pages": want[3:]}
    # A key this catalog does not hold ends the run.
    result = get_in_new_process(env, [keys[0], keys_for("elsewhere", 1)[0], *keys[1:]])
    assert result == {"hits": 1, "loaded": [True], "pages": want[:1]}


def _chunks(kv: KvcHiCacheStorage) -> int:
    return int(kv.catalog.stats(NS)["chunks"])


def test_bad_input_is_refused_or_missed_and_changes_nothing(env: dict[str, Any]) -> None:
    pool = HostPool("layer_first")
    kv = open_backend(env, pool)
    keys = keys_for("bad", 2)
    fill(pool, 0, 2, seed=6)
    assert kv.batch_set_v1(keys, slots(0, 2), info([])) == [True, True]
    before = (_chunks(kv), sorted(kv.stores[0].keys()))
    unknown = keys_for("unknown", 2)
    # Empty lists.
    assert kv.batch_exists([], info([])) == 0
    assert kv.batch_get_v1([], torch.arange(0), info([])) == []
    assert kv.batch_set_v1([], torch.arange(0), info([])) == []
    # Unknown keys are misses.
    assert kv.batch_exists(unknown, info([])) == 0
    assert kv.batch_get_v1(unknown, slots(4 * P, 2), info([])) == [False, False]
    assert kv.get(unknown[0], pool.get_dummy_flat_data_page()) is None
    assert not kv.exists(unknown[0])
    assert kv.batch_exists(unknown, None) == 0
    # A write without the preceding keys cannot be placed (its parent is unknown): refused.
    assert kv.batch_set_v1(unknown, slots(0, 2), info(None)) == [False, False]
    # A page whose parent kvc does not hold is refused (its lineage would be broken).
    assert kv.batch_set_v1(unknown[1:], slots(0, 1), info(unknown[:1])) == [False]
    # A single page whose place no call has told cannot be placed: not stored.
    assert not kv.set(keys_for("never-seen", 1)[0], pool.get_data_page(0))
    # Malformed keys, wrong index counts, wrong dtype or size: a clear error.
    with pytest.raises(InputError, match="64 lowercase hex"):
        kv.batch_exists(["not-a-key"], info([]))
    with pytest.raises(InputError, match="host indices"):
        kv.batch_get_v1(keys, slots(0, 1), info([]))
    with pytest.raises(InputError, match="consecutive"):
        kv.batch_set_v1(keys[:1], torch.arange(P).flip(0), info([]))
    with pytest.raises(InputError, match="flat page"):
        kv.get(keys[0], torch.zeros(2 * 2 * P * 2 * 8, dtype=torch.float32))
    with pytest.raises(InputError, match="flat page"):
        kv.set(keys[0], torch.zeros(7, dtype=pool.dtype))
    assert (_chunks(kv), sorted(kv.stores[0].keys())) == before
    kv.close()


@pytest.mark.parametrize(
    ("pool_args", "config", "match"),
    [
        ({}, {"is_mla_model": True}, "MLA"),
        ({}, {"pp_size": 2}, "pipeline"),
        ({"layout": "page_head"}, {}, "layout 'page_head'"),
        ({"page_size": 4}, {}, "page size 4"),
        ({"dtype": torch.float8_e4m3fn}, {}, "float8"),
    ],
    ids=["mla", "pipeline", "page-head-layout", "small-pages", "fp8"],
)
def test_what_kvc_cannot_store_exactly_is_refused_by_name(
    env: dict[str, Any], pool_args: dict[str, Any], config: dict[str, Any], match: str
) -> None:
    pool = HostPool(**{"layout": "layer_first", **pool_args})
    with pytest.raises(UnsupportedModelError, match=match):
        open_backend(env, pool, **config)


def test_tensor_parallel_ranks_are_shards_of_one_fingerprint(env: dict[str, Any]) -> None:
    ranks = [open_backend(env, HostPool("layer_first"), tp_rank=r, tp_size=2) for r in (0, 1)]
    assert ranks[0].fingerprint == ranks[1].fingerprint
    assert [(b.shard.head_lo, b.shard.head_hi) for b in ranks] == [(0, 2), (2, 4)]
    for b in ranks:
        b.close()
    cat = Catalog.open(env["catalog"])
    assert cat.namespace_chunk_size(NS) == P
    cat.close()


def test_the_catalog_comes_back_from_the_store_alone_names_included(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """The backend journals by default: a pin and refs made through its catalog and a deleted
    ref survive losing the catalog (`kvc rebuild --from` the store); a new process hits."""
    pool = HostPool("page_first")
    kv = open_backend(env, pool)
    keys = keys_for("rebuilt", 4)
    fill(pool, 0, 4, seed=9)
    want = [page_bytes(pool, j * P).hex() for j in range(4)]
    assert kv.batch_set_v1(keys, slots(0, 4), info([])) == [True] * 4
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
    result = get_in_new_process(env, keys)
    assert result == {"hits": 4, "loaded": [True] * 4, "pages": want}
