"""kvc as SGLang 0.5.23's HiCache storage, driven by SGLang's own cache controller.

SGLang's `HybridCacheController` (its threads, its hit query, its page transfer
and backup loops), its `MHATokenToKVPoolHost` in both host layouts and its
extra-config parser run as in a server (tests/sglang/harness.py says what stands
for the scheduler and the radix tree around them). Page keys are SGLang's own
(`get_storage_hash_str`); prefetches pass what the scheduler passes: the anchor's
last key and its ancestors' keys, never the anchor's own pages, and nothing at
the root, which is where every lookup of a restarted server starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry

from catalog import prefix_hashes
from restore.engines.sglang import page_symbols
from restore.errors import InputError, UnsupportedModelError
from tests.sglang.conftest import NS
from tests.sglang.harness import PAGE, SGLangRank, config_arg, page_keys

LAYOUTS = ("layer_first", "page_first")
ROOT = Path(__file__).resolve().parents[2]


def tokens(pages: int, first: int = 1000) -> list[int]:
    return list(range(first, first + pages * PAGE))


@pytest.fixture(params=LAYOUTS)
def rank(request: pytest.FixtureRequest, extra: dict[str, Any], rank_group: Any) -> Any:
    r = SGLangRank(config_arg(extra), layout=request.param, group=rank_group)
    yield r
    r.close()


def backup_path(
    rank: SGLangRank, nodes: list[list[int]], seed: int = 1
) -> tuple[list[list[str]], list[bytes]]:
    """Back up a path of radix-tree nodes (each a list of token ids, the root's child first)
    the way write-through does, each node once its parent is backed up: (each node's page
    keys, the bytes of every page written, in order)."""
    path: list[list[str]] = []
    written: list[bytes] = []
    for i, node_tokens in enumerate(nodes):
        host_value = rank.fill(len(node_tokens), seed=seed + i)
        ancestors = [k for node in path for k in node]
        assert rank.backup(host_value, node_tokens, ancestors) == len(node_tokens)
        path.append(page_keys(node_tokens, ancestors[-1] if ancestors else None))
        written += rank.page_bytes(host_value)
    return path, written


def test_a_restarted_server_prefetches_every_stored_page_from_the_root_bit_for_bit(
    extra: dict[str, Any], rank_group: Any, tmp_path: Path
) -> None:
    """Written through one host layout each, read in a new process into both: the
    config comes from a file (`@kvc.json`), as an operator would keep it."""
    config = tmp_path / "kvc.json"
    config.write_text(json.dumps(extra))
    toks = tokens(5)
    first = SGLangRank(f"@{config}", layout="layer_first", group=rank_group)
    (a,), want = backup_path(first, [toks[: 2 * PAGE]], seed=1)
    first.close()
    second = SGLangRank(f"@{config}", layout="page_first", group=rank_group)
    host_value = second.fill(3 * PAGE, seed=2)
    assert second.backup(host_value, toks[2 * PAGE :], a) == 3 * PAGE
    want += second.page_bytes(host_value)
    second.close()

    args = {"config": f"@{config}", "layouts": list(LAYOUTS), "tokens": toks + tokens(1, 9)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.sglang.restart_worker", json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    expect = {"hit": 5 * PAGE, "loaded": 5 * PAGE, "pages": [w.hex() for w in want]}
    assert got == {layout: expect for layout in LAYOUTS}


def test_a_prefetch_anchored_below_the_root_hits_the_pages_after_the_anchor(
    rank: SGLangRank,
) -> None:
    """The scheduler passes the anchor's ancestors without the anchor's own pages."""
    toks = tokens(5)
    nodes = [toks[: 2 * PAGE], toks[2 * PAGE : 3 * PAGE], toks[3 * PAGE :]]
    (a, b, _c), written = backup_path(rank, nodes)
    assert rank.hit_query(toks, []) == 5 * PAGE
    assert rank.hit_query(nodes[1] + nodes[2], [a]) == 3 * PAGE
    got = rank.prefetch(nodes[2], [a, b])
    assert (got.hit_tokens, got.loaded_tokens) == (2 * PAGE, 2 * PAGE)
    assert rank.page_bytes(got.host_indices) == written[3:]


def test_a_prefix_stored_in_part_hits_that_part(rank: SGLangRank) -> None:
    toks = tokens(4)
    _, written = backup_path(rank, [toks[: 2 * PAGE]])
    got = rank.prefetch(toks, [])
    assert (got.hit_tokens, got.loaded_tokens) == (2 * PAGE, 2 * PAGE)
    assert rank.page_bytes(got.host_indices) == written
    # Tokens that share no page with what is stored: a miss.
    assert rank.hit_query(tokens(2, first=5000), []) == 0


def _blob_file(rank: SGLangRank, kvc: dict[str, Any], keys: list[str], page: int) -> Path:
    backend = rank.backend
    assert backend.fingerprint is not None
    h = prefix_hashes(NS, page_symbols(keys, PAGE), PAGE)[page]
    blob = backend.catalog.known_blob_keys(NS, backend.fingerprint, [h], backend.shard)[h]
    store = Path(kvc["stores"][0].removeprefix("file://"))
    (path,) = [p for p in store.rglob(f"*{blob}*") if p.is_file()]
    return path


def test_a_corrupt_page_is_a_miss_never_bad_bytes_and_is_marked(
    rank: SGLangRank, kvc: dict[str, Any]
) -> None:
    toks = tokens(3)
    (keys,), written = backup_path(rank, [toks])
    path = _blob_file(rank, kvc, keys, 1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a flipped bit in the payload, at rest
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    # The catalog still lists the page: the hit query counts it, the verified read stops there.
    got = rank.prefetch(toks, [])
    assert (got.hit_tokens, got.loaded_tokens) == (3 * PAGE, PAGE)
    assert rank.page_bytes(got.host_indices[:PAGE]) == written[:1]
    # Marked corrupt: the next hit query ends before it.
    assert rank.hit_query(toks, []) == PAGE
    marks = [
        e for e in rank.backend.catalog.events(namespace=NS) if "corrupt" in json.dumps(e.details)
    ]
    assert [e.actor for e in marks] == ["sglang:tp0"]


def test_without_prefix_keys_reads_hit_and_backups_are_refused(
    rank: SGLangRank, extra: dict[str, Any], rank_group: Any
) -> None:
    """With `hicache_storage_pass_prefix_keys` false SGLang passes no lineage at all: a page
    is still found from its key, at the root and below it; a write cannot be placed."""
    toks = tokens(3)
    (a, _b), written = backup_path(rank, [toks[:PAGE], toks[PAGE:]])
    plain = SGLangRank(
        config_arg({**extra, "hicache_storage_pass_prefix_keys": False}),
        layout=rank.host.layout,
        group=rank_group,
    )
    try:
        assert not plain.pass_prefix_keys
        got = plain.prefetch(toks[PAGE:], [a])
        assert (got.hit_tokens, got.loaded_tokens) == (2 * PAGE, 2 * PAGE)
        assert plain.page_bytes(got.host_indices) == written[1:]
        chunks = plain.backend.catalog.stats(NS)["chunks"]
        assert plain.backup(plain.fill(PAGE, seed=9), tokens(1, first=7000), []) == 0
        assert plain.backend.catalog.stats(NS)["chunks"] == chunks
    finally:
        plain.close()


def test_hybrid_models_pools_and_v2_calls_are_refused_by_name(
    rank: SGLangRank, extra: dict[str, Any]
) -> None:
    keys = page_keys(tokens(1))
    swa = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PAGE), keys=keys)
    with pytest.raises(UnsupportedModelError, match="batch_exists_v2 \\(pools: swa\\)"):
        rank.backend.batch_exists_v2(keys, [swa])
    mamba = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(PAGE), keys=keys)
    with pytest.raises(UnsupportedModelError, match="batch_get_v2 \\(pools: mamba\\)"):
        rank.backend.batch_get_v2([mamba])
    with pytest.raises(UnsupportedModelError, match="batch_set_v2 \\(pools: mamba\\)"):
        rank.backend.batch_set_v2([mamba])
    # A hybrid model's host pool group has a second pool: SGLang's attach fails, naming it.
    rank.controller.detach_storage_backend()
    sidecar = build_pool_entry(
        name=PoolName.MAMBA,
        host_pool=rank.host,
        device_pool=rank.device_pool,
        layer_mapping={},
        transfer_layer_id_max=0,
    )
    with pytest.raises(UnsupportedModelError, match="host pool 'mamba'"):
        rank.controller.attach_storage_backend(
            storage_backend="dynamic",
            storage_backend_extra_config=dict(extra),
            host_pools=[*rank.entries, sidecar],
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [({"catalog": None}, '"catalog"'), ({"stores": "file:///tmp/x"}, '"stores"')],
    ids=["no-catalog", "stores-not-a-list"],
)
def test_a_bad_extra_config_fails_the_attach_naming_the_field(
    extra: dict[str, Any], rank_group: Any, change: dict[str, Any], match: str
) -> None:
    bad = {k: v for k, v in {**extra, **change}.items() if v is not None}
    with pytest.raises(InputError, match=match):
        SGLangRank(config_arg(bad), layout="layer_first", group=rank_group)


def test_storage_metrics_reach_sglangs_hook(extra: dict[str, Any], rank_group: Any) -> None:
    rank = SGLangRank(
        config_arg(extra), layout="page_first", group=rank_group, storage_metrics=True
    )
    try:
        toks = tokens(2)
        backup_path(rank, [toks])
        got = rank.prefetch(toks, [])
        assert got.loaded_tokens == 2 * PAGE
        stats = rank.backend.get_stats()
        assert (stats.backup_pgs, stats.prefetch_pgs) == ([2], [2])
        assert all(gbps > 0 for gbps in stats.backup_bandwidth + stats.prefetch_bandwidth)
        again = rank.backend.get_stats()  # drained: each call reports what happened since
        assert (again.backup_pgs, again.prefetch_pgs) == ([], [])
    finally:
        rank.close()
