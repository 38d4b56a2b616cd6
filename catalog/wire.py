"""The HTTP catalog's wire models: the pydantic bodies `kvc serve` and `RemoteCatalog` exchange.

Shared by the server (kvc/service/) and the client (catalog/remote.py); imports
no web framework, so a worker that only talks to a service never loads one.
The bodies of refs and pins are in `catalog.wire_refs`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
)

from catalog.base import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from catalog.identity import MAX_TOKEN_ID
from catalog.models import (
    ChunkMatch,
    ChunkRecord,
    EventInfo,
    InvalidationDirective,
    Match,
    PrefixInfo,
    ReplicaInfo,
    ReplicaReceipt,
    Shard,
)

API_ROOT = "/v1/namespaces/"
API_PREFIX = API_ROOT + "{namespace}"
# One body for every "no such thing", whether it is missing or belongs to another
# tenant: the same as an unknown path, so nothing leaks which namespaces exist.
NOT_FOUND = {"detail": "Not Found"}

# -- wire models ---------------------------------------------------------------

# What reaches the catalog fits its columns, refused here with a 422 naming the field
# rather than by the database with a 500: BIGINT counts, VARCHAR lengths, and no NUL
# characters (PostgreSQL text cannot hold them; SQLite would store anything).
NO_NUL = r"^[^\x00]*$"
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
Count = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
TierName = Literal["resident", "local", "object"]
StateName = Literal["durable", "ready", "corrupt", "missing", "deleting"]
# What a tenant may set: `deleting` belongs to GC, which runs beside the catalog, not over HTTP.
MarkableState = Literal["durable", "ready", "corrupt", "missing"]
Text = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=NO_NUL)]
Short = Annotated[str, StringConstraints(max_length=255, pattern=NO_NUL)]
# A replica's location is a URI; the catalog files its store under the scheme (16 characters).
Location = Annotated[
    str,
    StringConstraints(max_length=1024, pattern=r"^[A-Za-z][A-Za-z0-9+.\-]{0,15}:[^\x00]*$"),
]
Actor = Short | None
Reason = Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL)]


def _utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the time is out of range in UTC") from None


# Stored in UTC: an offset that moves it past year 1 or 9999 would not fit.
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_utc)]


class WireModel(BaseModel):
    """A body on the wire: unknown fields are refused, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardModel(WireModel):
    layer_lo: Count
    layer_hi: Count
    head_lo: Count
    head_hi: Count

    @classmethod
    def of(cls, s: Shard) -> ShardModel:
        return cls(layer_lo=s.layer_lo, layer_hi=s.layer_hi, head_lo=s.head_lo, head_hi=s.head_hi)

    def to_shard(self) -> Shard:
        return Shard(self.layer_lo, self.layer_hi, self.head_lo, self.head_hi)


class ReceiptModel(WireModel):
    location: Location
    tier: TierName
    size: Count
    checksum: Annotated[Short, StringConstraints(min_length=1)]
    stored_at: UtcDatetime
    etag: Short | None = None
    version: Short | None = None
    worker: Short | None = None

    @classmethod
    def of(cls, r: ReplicaReceipt) -> ReceiptModel:
        return cls(
            location=r.location,
            tier=r.tier,
            size=r.size,
            checksum=r.checksum,
            stored_at=r.stored_at,
            etag=r.etag,
            version=r.version,
            worker=r.worker,
        )

    def to_receipt(self) -> ReplicaReceipt:
        return ReplicaReceipt(
            self.location,
            self.tier,
            self.size,
            self.checksum,
            self.stored_at,
            self.etag,
            self.version,
            self.worker,
        )


class NamespaceRequest(WireModel):
    chunk_size: Annotated[int, Field(strict=True, ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)]


class NamespaceResponse(WireModel):
    chunk_size: int | None


class FingerprintModel(WireModel):
    fingerprint: Hex64
    descriptor: dict[str, Any]


class RegisterFingerprintRequest(WireModel):
    descriptor: dict[str, Any]


class LookupRequest(WireModel):
    fingerprint: Hex64
    tokens: list[TokenId] = Field(min_length=1)
    shard: ShardModel | None = None
    max_tokens: Count | None = None


class ReplicaModel(WireModel):
    location: str
    tier: TierName
    state: StateName
    size: int
    worker: str | None = None
    checksum: str | None = None
    stored_at: datetime | None = None
    etag: str | None = None
    version: str | None = None
    last_verified_at: datetime | None = None

    @classmethod
    def of(cls, r: ReplicaInfo) -> ReplicaModel:
        return cls(**r._asdict())

    def to_info(self) -> ReplicaInfo:
        return ReplicaInfo(**self.model_dump())


class ChunkMatchModel(WireModel):
    prefix_hash: Hex64
    parent_hash: Hex64
    blob_key: Hex64
    token_start: int
    token_count: int
    tokens_used: int
    codec: str
    stored_bytes: int
    kv_bytes: int
    replicas: list[ReplicaModel]

    @classmethod
    def of(cls, c: ChunkMatch) -> ChunkMatchModel:
        return cls(
            prefix_hash=c.prefix_hash.hex(),
            parent_hash=c.parent_hash.hex(),
            blob_key=c.blob_key,
            token_start=c.token_start,
            token_count=c.token_count,
            tokens_used=c.tokens_used,
            codec=c.codec,
            stored_bytes=c.stored_bytes,
            kv_bytes=c.kv_bytes,
            replicas=[ReplicaModel.of(r) for r in c.replicas],
        )

    def to_match(self) -> ChunkMatch:
        return ChunkMatch(
            bytes.fromhex(self.prefix_hash),
            bytes.fromhex(self.parent_hash),
            self.blob_key,
            self.token_start,
            self.token_count,
            self.tokens_used,
            self.codec,
            self.stored_bytes,
            self.kv_bytes,
            tuple(r.to_info() for r in self.replicas),
        )


class MatchModel(WireModel):
    namespace: str
    fingerprint: Hex64
    shard: ShardModel | None
    prompt_tokens: int
    matched_tokens: int
    chunks: list[ChunkMatchModel]

    @classmethod
    def of(cls, m: Match) -> MatchModel:
        return cls(
            namespace=m.namespace,
            fingerprint=m.fingerprint,
            shard=None if m.shard is None else ShardModel.of(m.shard),
            prompt_tokens=m.prompt_tokens,
            matched_tokens=m.matched_tokens,
            chunks=[ChunkMatchModel.of(c) for c in m.chunks],
        )

    def to_match(self) -> Match:
        return Match(
            self.namespace,
            self.fingerprint,
            None if self.shard is None else self.shard.to_shard(),
            self.prompt_tokens,
            self.matched_tokens,
            tuple(c.to_match() for c in self.chunks),
        )


class ChunkRecordModel(WireModel):
    """A publish record; the namespace is the one in the path, the fingerprint a hex."""

    fingerprint: Hex64
    prefix_hash: Hex64
    parent_hash: Hex64
    token_start: Count
    tokens: list[TokenId] = Field(min_length=1)
    shard: ShardModel
    blob_key: Hex64
    codec: Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=NO_NUL)]
    stored_bytes: Count
    kv_bytes: Count
    receipts: list[ReceiptModel] = Field(min_length=1)

    @classmethod
    def of(cls, r: ChunkRecord) -> ChunkRecordModel:
        return cls(
            fingerprint=r.fingerprint.hex,
            prefix_hash=r.prefix_hash.hex(),
            parent_hash=r.parent_hash.hex(),
            token_start=r.token_start,
            tokens=[int(t) for t in r.tokens],
            shard=ShardModel.of(r.shard),
            blob_key=r.blob_key,
            codec=r.codec,
            stored_bytes=r.stored_bytes,
            kv_bytes=r.kv_bytes,
            receipts=[ReceiptModel.of(x) for x in r.receipts],
        )


class PublishRequest(WireModel):
    """Records, and the descriptor of each fingerprint they use (registered by the service)."""

    fingerprints: dict[Hex64, dict[str, Any]] = Field(default_factory=dict)
    records: list[ChunkRecordModel] = Field(min_length=1)
    actor: Actor = None


class ConflictModel(WireModel):
    prefix_hash: Hex64
    kept_key: Hex64
    rejected_key: Hex64


class PublishResponse(WireModel):
    recorded: int
    already_present: int
    replicas_added: int
    conflicts: list[ConflictModel] = Field(default_factory=list)


class RecordReplicaRequest(WireModel):
    blob_key: Hex64
    receipt: ReceiptModel
    actor: Actor = None


class RecordReplicaResponse(WireModel):
    added: bool


class MarkReplicaRequest(WireModel):
    blob_key: Hex64
    location: Text
    state: MarkableState
    reason: Reason
    actor: Actor = None


class MarkReplicaResponse(WireModel):
    changed: bool


class KnownRequest(WireModel):
    fingerprint: Hex64
    prefix_hashes: list[Hex64]
    shard: ShardModel


class KnownResponse(WireModel):
    blob_keys: dict[Hex64, Hex64]


class PrefixModel(WireModel):
    prefix_hash: Hex64
    parent_hash: Hex64
    token_start: int
    tokens: list[int]
    depth: int
    quarantined: bool
    quarantine_reason: str | None

    @classmethod
    def of(cls, p: PrefixInfo) -> PrefixModel:
        return cls(
            prefix_hash=p.prefix_hash.hex(),
            parent_hash=p.parent_hash.hex(),
            token_start=p.token_start,
            tokens=list(p.tokens),
            depth=p.depth,
            quarantined=p.quarantined,
            quarantine_reason=p.quarantine_reason,
        )

    def to_info(self) -> PrefixInfo:
        return PrefixInfo(
            bytes.fromhex(self.prefix_hash),
            bytes.fromhex(self.parent_hash),
            self.token_start,
            tuple(self.tokens),
            self.depth,
            self.quarantined,
            self.quarantine_reason,
        )


class Lineage(WireModel):
    prefixes: list[PrefixModel]


class PrefixesWithTokensRequest(WireModel):
    tokens: list[TokenId] = Field(min_length=1)
    limit: int = Field(default=64, strict=True, ge=1, le=64)


class QuarantineRequest(WireModel):
    prefix_hash: Hex64
    reason: Annotated[Reason, StringConstraints(min_length=1, strip_whitespace=True)]
    actor: Actor = None


class DirectiveModel(WireModel):
    location: str
    blob_key: Hex64
    tier: TierName
    worker: str | None
    prefix_hash: Hex64

    @classmethod
    def of(cls, d: InvalidationDirective) -> DirectiveModel:
        return cls(
            location=d.location,
            blob_key=d.blob_key,
            tier=d.tier,
            worker=d.worker,
            prefix_hash=d.prefix_hash.hex(),
        )

    def to_directive(self) -> InvalidationDirective:
        return InvalidationDirective(
            self.location, self.blob_key, self.tier, self.worker, bytes.fromhex(self.prefix_hash)
        )


class QuarantineResponse(WireModel):
    directives: list[DirectiveModel]


class StatsModel(WireModel):
    namespace: str | None
    chunks: int
    prefixes: int
    refs: int
    stored_bytes: int
    kv_bytes: int
    replicas: dict[str, int]


class Health(WireModel):
    status: Literal["ok"]


class ErrorModel(WireModel):
    """A refusal: what is wrong, and for an error of the catalog its class name (`error`)."""

    detail: str
    error: str | None = None


class FieldErrorModel(BaseModel):
    """One invalid field: `loc` is its place, ["body", "records", 0, "tokens"] or ["path", "name"]."""

    loc: list[str | int] = Field(min_length=1)
    msg: str
    type: str


class InvalidRequestModel(BaseModel):
    detail: list[FieldErrorModel]


# -- replicas of the namespace, demand, prefixes, history (refs and pins: catalog.wire_refs) --

BlobKeys = Annotated[list[Hex64], Field(max_length=100_000)]
Seconds = Annotated[float, Field(gt=0, lt=1e10, allow_inf_nan=False)]


class ReplicaKeys(WireModel):
    """Blob keys with a replica at a location, of this namespace's chunks only."""

    blob_keys: list[Hex64]


class TouchVerifiedRequest(WireModel):
    location: Text
    blob_keys: BlobKeys


class RemoveReplicasRequest(WireModel):
    location: Text
    blob_keys: BlobKeys
    reason: Reason
    actor: Actor = None


class CountResponse(WireModel):
    count: int


class DeclareDemandRequest(WireModel):
    worker: Annotated[Short, StringConstraints(min_length=1)]
    prefix_hash: Hex64
    priority: Annotated[float, Field(allow_inf_nan=False, ge=-1e300, le=1e300)] = 1.0
    ttl_s: Seconds = 3600


class DemandRequest(WireModel):
    prefix_hashes: BlobKeys


class DemandResponse(WireModel):
    demand: dict[Hex64, float]


class EventModel(WireModel):
    seq: int
    at: datetime
    kind: str
    namespace: str | None
    subject: str | None
    actor: str | None
    details: dict[str, Any]

    @classmethod
    def of(cls, e: EventInfo) -> EventModel:
        return cls(
            seq=e.seq,
            at=e.at,
            kind=e.kind,
            namespace=e.namespace,
            subject=e.subject,
            actor=e.actor,
            details=dict(e.details),
        )

    def to_info(self) -> EventInfo:
        return EventInfo(
            self.seq, self.at, self.kind, self.namespace, self.subject, self.actor, self.details
        )


class EventList(WireModel):
    events: list[EventModel]
