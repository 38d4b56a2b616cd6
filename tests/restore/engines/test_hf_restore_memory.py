"""A restored DynamicCache's memory: reused once transformers has let go of it, never while in use.

`HFAdapter.restore` lands the KV in one host buffer whose views become the cache's
tensors; transformers' first forward replaces them, and the buffer goes back to the
adapter's `HostBuffers` for the next restore (a copy into memory already touched runs
about twice as fast as into memory the kernel maps anew). The model's head dim is
large so that a restore's buffer passes the 2 MiB below which malloc recycles alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from catalog.catalog import Catalog
from chunkstore import open_store
from restore.engines.hf import HFAdapter
from restore.engines.hf.cache import HostBuffers
from restore.errors import InputError
from tests.restore.engines.hf_worker import generate, prefill
from tests.restore.test_token_exact import corrupt

MiB = 1 << 20
CHUNK = 64
TOKENS = 200  # 199 restored positions x 16 KiB = 3.1 MiB of KV


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,  # 2 layers x K,V x 8 heads x 128 x 4 bytes = 16 KiB per position
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def kv(model: PreTrainedModel, tmp_path: Path) -> Iterator[HFAdapter]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True)
    store = open_store(f"file://{tmp_path / 'blobs'}")
    with HFAdapter(model, cat, [store], chunk_size=CHUNK, weights_id="memory-test") as adapter:
        yield adapter
    store.close()
    cat.close()


def prompt(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 128, TOKENS)]


def memory_of(cache: DynamicCache) -> int:
    return int(cache.layers[0].keys.untyped_storage().data_ptr())  # type: ignore[union-attr]


def bits(cache: DynamicCache) -> list[torch.Tensor]:
    return [
        t.contiguous().view(torch.int32).clone()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
    ]  # type: ignore[union-attr]


def test_the_next_restore_reuses_the_memory_transformers_let_go_of(
    model: PreTrainedModel, kv: HFAdapter
) -> None:
    p = prompt(1)
    kv.checkpoint(p, prefill(model, p[:-1]))
    first, n = kv.restore(p)
    assert n == TOKENS - 1
    used = memory_of(first)
    expected = generate(model, p, prefill(model, p[:-1]), 4)
    assert generate(model, p, first, 4) == expected  # the forward replaced its tensors
    assert kv.restore_buffers.idle_bytes >= (TOKENS - 1) * 16 * 1024
    again, n = kv.restore(p)
    assert n == TOKENS - 1 and memory_of(again) == used
    assert kv.restore_buffers.idle_bytes == 0
    # Recycled memory holds this restore's KV, bit for bit, and continues alike.
    assert generate(model, p, again, 4) == expected


def test_memory_of_a_cache_still_in_use_is_never_handed_out(
    model: PreTrainedModel, kv: HFAdapter
) -> None:
    p, q = prompt(2), prompt(3)
    kv.checkpoint(p, prefill(model, p[:-1]))
    kv.checkpoint(q, prefill(model, q[:-1]))
    held, _ = kv.restore(p)
    before = bits(held)
    dropped, _ = kv.restore(q)
    addr = memory_of(dropped)
    del dropped  # its memory comes back ...
    other, _ = kv.restore(q)
    assert memory_of(other) == addr  # ... and is reused,
    assert memory_of(other) != memory_of(held)  # but never the memory of a cache in use
    assert all(torch.equal(a, b) for a, b in zip(before, bits(held), strict=True))


@pytest.mark.parametrize("bad_chunk", [0, 2])
def test_the_memory_of_a_restore_cut_short_comes_back(
    model: PreTrainedModel, kv: HFAdapter, tmp_path: Path, bad_chunk: int
) -> None:
    """A restore that verifies fewer chunks than it reserved hands out a cache of the verified
    positions (none: an empty one), and its buffer comes back as soon as that cache lets go
    of it, not at the next garbage collection (a failed chunk's exception once held the
    restore's frames, and so the buffer, in a reference cycle)."""
    p = prompt(4)
    original = prefill(model, p[:-1])
    kv.checkpoint(p, original)
    chunks = kv.restorer.catalog.lookup("default", kv.fingerprint, p).chunks
    with open_store(f"file://{tmp_path / 'blobs'}") as blobs:
        corrupt(blobs, chunks[bad_chunk].blob_key)
    reserved = (TOKENS - 1) * 16 * 1024
    cache, n = kv.restore(p)
    assert n == bad_chunk * CHUNK
    if n == 0:
        assert cache.get_seq_length() == 0
        assert kv.restore_buffers.idle_bytes >= reserved  # back at once: nothing holds it
        return
    assert kv.restore_buffers.idle_bytes == 0  # the cache handed out holds the buffer
    assert cache.get_seq_length() == n
    assert all(
        torch.equal(mine.keys, theirs.keys[:, :, :n])  # type: ignore[index]
        and torch.equal(mine.values, theirs.values[:, :, :n])  # type: ignore[index]
        for mine, theirs in zip(cache.layers, original.layers, strict=True)
    )
    del cache
    assert kv.restore_buffers.idle_bytes >= reserved


def _tensor_at(buffers: HostBuffers, mib: int) -> tuple[Any, int]:
    t = buffers.tensor((mib, MiB // 4), torch.float32)
    return t, int(t.untyped_storage().data_ptr())


def test_idle_buffers_are_bounded_and_only_a_close_fit_is_reused() -> None:
    buffers = HostBuffers(keep_bytes=10 * MiB)
    six, six_at = _tensor_at(buffers, 6)
    large, _ = _tensor_at(buffers, 12)  # more than keep_bytes alone: not kept
    del six, large
    assert buffers.idle_bytes == 6 * MiB
    two, two_at = _tensor_at(buffers, 2)  # 6 MiB would hold 3x what it needs: a new one
    assert two_at != six_at and buffers.idle_bytes == 6 * MiB
    four, four_at = _tensor_at(buffers, 4)
    assert four_at == six_at and buffers.idle_bytes == 0
    del two, four
    assert buffers.idle_bytes == 8 * MiB
    again, _ = _tensor_at(buffers, 12)
    del again  # larger than keep_bytes on its own: dropped, the idle ones stay
    assert buffers.idle_bytes == 8 * MiB
    nothing = HostBuffers(keep_bytes=0)
    t, _ = _tensor_at(nothing, 4)
    del t
    assert nothing.idle_bytes == 0


def test_the_buffer_given_back_last_is_kept_before_older_ones() -> None:
    """Restores of one size keep recycling their buffer while smaller buffers of earlier
    restores sit idle: past `keep_bytes`, the least recently given back goes first (when
    the largest went first, a 16k-token restore after 1k and 4k ones lost its own buffer
    every time and copied into new memory, 3x slower)."""
    buffers = HostBuffers(keep_bytes=10 * MiB)
    a, _ = _tensor_at(buffers, 2)
    b, b_at = _tensor_at(buffers, 2)
    del a, b  # 4 MiB idle, `b` the newer
    big, big_at = _tensor_at(buffers, 8)
    del big  # 12 MiB would pass keep_bytes: the oldest idle buffer goes, not this one
    assert buffers.idle_bytes == 10 * MiB
    again, again_at = _tensor_at(buffers, 8)
    assert again_at == big_at
    two, two_at = _tensor_at(buffers, 2)
    assert two_at == b_at
    del again, two


def test_keep_bytes_must_be_a_non_negative_int() -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(InputError, match="keep_bytes must be an int >= 0"):
            HostBuffers(keep_bytes=bad)  # type: ignore[arg-type]


def test_a_buffer_given_back_while_the_pool_is_busy_waits_for_no_lock() -> None:
    """A buffer comes back from a finalizer, which a garbage collection may run inside the
    pool's own bookkeeping: giving back never blocks, and the buffer is kept all the same."""
    buffers = HostBuffers(keep_bytes=8 * MiB)
    t, at = _tensor_at(buffers, 4)
    with buffers._lock:  # the pool busy in this very thread
        del t  # would deadlock if giving back took the lock
    assert buffers.idle_bytes == 4 * MiB
    _, again = _tensor_at(buffers, 4)
    assert again == at
