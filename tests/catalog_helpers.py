"""Builders for catalog tests: fingerprints, chains of publish records, fake receipts."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import blake3

from catalog import AttentionLayout, Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.gc import GcPlan
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from catalog.purge import apply_gc

LAYOUT = AttentionLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
FP = Fingerprint.create(
    weights="sha256:test", architecture="llama", config={"v": 1}, attention_layout=LAYOUT
)
FP2 = Fingerprint.create(
    weights="sha256:other", architecture="llama", config={"v": 1}, attention_layout=LAYOUT
)
CS = 4  # chunk size used by the tests


def fake_key(*parts: object) -> str:
    return blake3.blake3(repr(parts).encode()).hexdigest()


def receipt(
    location: str = "file:///store", tier: str = "local", size: int = 100, **kw: object
) -> ReplicaReceipt:
    return ReplicaReceipt(
        location=location,
        tier=tier,
        size=size,
        checksum="blake3:x",  # type: ignore[arg-type]
        stored_at=datetime.now(UTC),
        **kw,
    )  # type: ignore[arg-type]


def chain_records(
    namespace: str,
    tokens: Sequence[int],
    *,
    fp: Fingerprint = FP,
    shard: Shard | None = None,
    chunk_size: int = CS,
    start_chunk: int = 0,
    receipts: Sequence[ReplicaReceipt] | None = None,
    salt: str = "",
) -> list[ChunkRecord]:
    """Publish records for `tokens` cut at chunk boundaries (the last may be a tail)."""
    shard = shard or Shard.full(fp.layout)
    out = []
    parent = chain_root(namespace)
    for i in range(0, len(tokens), chunk_size):
        piece = list(tokens[i : i + chunk_size])
        h = chain_hash(parent, piece)
        if i // chunk_size >= start_chunk:
            key = fake_key(namespace, fp.hex, h, shard, salt)
            out.append(
                ChunkRecord(
                    namespace,
                    fp,
                    h,
                    parent,
                    i,
                    piece,
                    shard,
                    key,
                    "raw",
                    100,
                    64 * len(piece),
                    list(receipts) if receipts is not None else [receipt()],
                )
            )
        parent = h
    return out


def publish(cat: Catalog, namespace: str, tokens: Sequence[int], **kw: object) -> list[ChunkRecord]:
    recs = chain_records(namespace, tokens, **kw)  # type: ignore[arg-type]
    cat.record_chunks(recs)
    return recs


class GcKilled(BaseException):
    """Raised from a GC run's blob deletion: as if the process died after the mark."""


def kill_gc_after_marking(cat: Catalog, plan: GcPlan) -> None:
    """Apply `plan` but die at its first blob deletion, leaving its chunks `purging`."""

    def die(location: str, key: str) -> bool:
        raise GcKilled

    try:
        apply_gc(cat, plan, die)
    except GcKilled:
        return
    raise AssertionError("the GC run deleted no blob, so it never died after marking")
