"""Values the catalog takes and returns: shards, publish records, matches, refs, directives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, NamedTuple

from catalog.errors import CatalogInputError
from catalog.identity import AttentionLayout, Fingerprint

Tier = Literal["resident", "local", "object"]
TIERS: tuple[Tier, ...] = ("resident", "local", "object")  # best first
ReplicaState = Literal["durable", "ready", "corrupt", "missing", "deleting"]
USABLE_STATES: tuple[str, ...] = ("durable", "ready")


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of the attention state a worker owns: layers [lo, hi) and kv heads [lo, hi)."""

    layer_lo: int
    layer_hi: int
    head_lo: int
    head_hi: int

    def __post_init__(self) -> None:
        for name in ("layer_lo", "layer_hi", "head_lo", "head_hi"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
                raise CatalogInputError(f"Shard.{name} must be an int in [0, 2**31), got {v!r}")
        if self.layer_hi <= self.layer_lo or self.head_hi <= self.head_lo:
            raise CatalogInputError(f"empty shard {self}: ranges are [lo, hi) with hi > lo")

    @classmethod
    def full(cls, layout: AttentionLayout) -> Shard:
        return cls(0, layout.num_layers, 0, layout.num_kv_heads)

    def check_within(self, layout: AttentionLayout) -> None:
        if self.layer_hi > layout.num_layers or self.head_hi > layout.num_kv_heads:
            raise CatalogInputError(
                f"shard {self} exceeds the fingerprint's layout "
                f"({layout.num_layers} layers, {layout.num_kv_heads} kv heads)"
            )


@dataclass(frozen=True, slots=True)
class ReplicaReceipt:
    """A store's (or a worker's) proof that a blob's bytes are durable there."""

    location: str
    tier: Tier
    size: int
    checksum: str
    stored_at: datetime
    etag: str | None = None
    version: str | None = None
    worker: str | None = None


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """The facts of one published chunk whose bytes are already durable (see ARCHITECTURE 4)."""

    namespace: str
    fingerprint: Fingerprint
    prefix_hash: bytes
    parent_hash: bytes
    token_start: int
    tokens: Sequence[int]
    shard: Shard
    blob_key: str
    codec: str
    stored_bytes: int
    kv_bytes: int
    receipts: Sequence[ReplicaReceipt]


@dataclass(frozen=True, slots=True)
class Conflict:
    """The same (fingerprint, prefix, shard) published with different bytes; the first is kept."""

    prefix_hash: bytes
    kept_key: str
    rejected_key: str


@dataclass(frozen=True, slots=True)
class PublishResult:
    recorded: int
    already_present: int
    replicas_added: int
    conflicts: tuple[Conflict, ...] = ()


class ReplicaInfo(NamedTuple):
    """Where a blob can be read from; lookups fill the first five fields.

    (A NamedTuple, not a dataclass: a long prompt's lookup builds hundreds.)
    """

    location: str
    tier: Tier
    state: ReplicaState
    size: int
    worker: str | None = None
    checksum: str | None = None
    stored_at: datetime | None = None
    etag: str | None = None
    version: str | None = None
    last_verified_at: datetime | None = None


class ChunkMatch(NamedTuple):
    """One chunk of a lookup's plan: restore its first `tokens_used` positions."""

    prefix_hash: bytes
    parent_hash: bytes
    blob_key: str
    token_start: int
    token_count: int
    tokens_used: int
    codec: str
    stored_bytes: int
    kv_bytes: int
    replicas: tuple[ReplicaInfo, ...]


@dataclass(frozen=True, slots=True)
class Match:
    """The longest restorable prefix of a prompt, and the chunks that cover it."""

    namespace: str
    fingerprint: str
    shard: Shard | None
    prompt_tokens: int
    matched_tokens: int = 0
    chunks: tuple[ChunkMatch, ...] = field(default=())

    @property
    def hit(self) -> bool:
        return self.matched_tokens > 0


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    prefix_hash: bytes
    parent_hash: bytes
    token_start: int
    tokens: tuple[int, ...]
    depth: int
    quarantined: bool
    quarantine_reason: str | None

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class PinInfo:
    """A named hold on a prefix: it and its ancestors are GC roots while `live`."""

    namespace: str
    name: str
    prefix_hash: bytes
    reason: str | None
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    live: bool


@dataclass(frozen=True, slots=True)
class RefInfo:
    """A named continuation: `processed` positions up to `head_hash`, then `pending_token`."""

    namespace: str
    name: str
    fingerprint: str
    head_hash: bytes
    processed: int
    pending_token: int | None
    forked_from: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class InvalidationDirective:
    """Drop this blob at this location: a quarantined chunk's replica (store or worker)."""

    location: str
    blob_key: str
    tier: Tier
    worker: str | None
    prefix_hash: bytes


@dataclass(frozen=True, slots=True)
class EventInfo:
    seq: int
    at: datetime
    kind: str
    namespace: str | None
    subject: str | None
    actor: str | None
    details: dict[str, object]
