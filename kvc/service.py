"""The catalog over HTTP: a FastAPI app with per-namespace bearer tokens, its wire models and metrics.

Every path function is a plain `def`: the catalog is synchronous, so FastAPI
runs them in its threadpool. See docs/http-api.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import numpy as np
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
)
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from catalog.catalog import Catalog
from catalog.errors import CatalogError, NotFoundError, PurgeInProgressError, RefConflictError
from catalog.identity import MAX_TOKEN_ID, Fingerprint
from catalog.models import (
    ChunkMatch,
    ChunkRecord,
    InvalidationDirective,
    Match,
    PrefixInfo,
    PublishResult,
    RefInfo,
    ReplicaInfo,
    ReplicaReceipt,
    Shard,
)
from catalog.schema import Chunk, Namespace, PrefixNode

log = logging.getLogger(__name__)

API_ROOT = "/v1/namespaces/"
API_PREFIX = API_ROOT + "{namespace}"
# One body for every "no such thing", whether it is missing or belongs to another
# tenant: the same as an unknown path, so nothing leaks which namespaces exist.
NOT_FOUND = {"detail": "Not Found"}
MISSING_TOKEN = "missing bearer token"
INVALID_TOKEN = "invalid bearer token"
_HEX64 = re.compile(r"[0-9a-f]{64}")

# -- wire models ---------------------------------------------------------------

# What reaches the catalog fits its columns, refused here with a 422 naming the field
# rather than by the database with a 500: BIGINT counts, VARCHAR lengths, and no NUL
# characters (PostgreSQL text cannot hold them; SQLite would store anything).
_NO_NUL = r"^[^\x00]*$"
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
Count = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
TierName = Literal["resident", "local", "object"]
StateName = Literal["durable", "ready", "corrupt", "missing", "deleting"]
Text = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=_NO_NUL)]
Short = Annotated[str, StringConstraints(max_length=255, pattern=_NO_NUL)]
# A replica's location is a URI; the catalog files its store under the scheme (16 characters).
Location = Annotated[
    str,
    StringConstraints(max_length=1024, pattern=r"^[A-Za-z][A-Za-z0-9+.\-]{0,15}:[^\x00]*$"),
]
RefName = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=_NO_NUL)]
Actor = Short | None
Reason = Annotated[str, StringConstraints(max_length=1024, pattern=_NO_NUL)]


def _utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the time is out of range in UTC") from None


# Stored in UTC: an offset that moves it past year 1 or 9999 would not fit.
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_utc)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardModel(_Model):
    layer_lo: Count
    layer_hi: Count
    head_lo: Count
    head_hi: Count

    @classmethod
    def of(cls, s: Shard) -> ShardModel:
        return cls(layer_lo=s.layer_lo, layer_hi=s.layer_hi, head_lo=s.head_lo, head_hi=s.head_hi)

    def to_shard(self) -> Shard:
        return Shard(self.layer_lo, self.layer_hi, self.head_lo, self.head_hi)


class ReceiptModel(_Model):
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


class NamespaceRequest(_Model):
    chunk_size: Annotated[int, Field(strict=True, ge=1, le=65536)]


class NamespaceResponse(_Model):
    chunk_size: int | None


class FingerprintModel(_Model):
    fingerprint: Hex64
    descriptor: dict[str, Any]


class RegisterFingerprintRequest(_Model):
    descriptor: dict[str, Any]


class LookupRequest(_Model):
    fingerprint: Hex64
    tokens: list[TokenId] = Field(min_length=1)
    shard: ShardModel | None = None
    max_tokens: Count | None = None


class ReplicaModel(_Model):
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


class ChunkMatchModel(_Model):
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


class MatchModel(_Model):
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


class ChunkRecordModel(_Model):
    """A publish record; the namespace is the one in the path, the fingerprint a hex."""

    fingerprint: Hex64
    prefix_hash: Hex64
    parent_hash: Hex64
    token_start: Count
    tokens: list[TokenId] = Field(min_length=1)
    shard: ShardModel
    blob_key: Hex64
    codec: Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=_NO_NUL)]
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


class PublishRequest(_Model):
    """Records, and the descriptor of each fingerprint they use (registered by the service)."""

    fingerprints: dict[Hex64, dict[str, Any]] = Field(default_factory=dict)
    records: list[ChunkRecordModel] = Field(min_length=1)
    actor: Actor = None


class ConflictModel(_Model):
    prefix_hash: Hex64
    kept_key: Hex64
    rejected_key: Hex64


class PublishResponse(_Model):
    recorded: int
    already_present: int
    replicas_added: int
    conflicts: list[ConflictModel] = Field(default_factory=list)


class RecordReplicaRequest(_Model):
    blob_key: Hex64
    receipt: ReceiptModel
    actor: Actor = None


class RecordReplicaResponse(_Model):
    added: bool


class MarkReplicaRequest(_Model):
    blob_key: Hex64
    location: Text
    state: StateName
    reason: Reason
    actor: Actor = None


class MarkReplicaResponse(_Model):
    changed: bool


class KnownRequest(_Model):
    fingerprint: Hex64
    prefix_hashes: list[Hex64]
    shard: ShardModel


class KnownResponse(_Model):
    blob_keys: dict[Hex64, Hex64]


class RefModel(_Model):
    namespace: str
    name: str
    fingerprint: Hex64
    head_hash: Hex64
    processed: int
    pending_token: int | None
    forked_from: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, r: RefInfo) -> RefModel:
        return cls(
            namespace=r.namespace,
            name=r.name,
            fingerprint=r.fingerprint,
            head_hash=r.head_hash.hex(),
            processed=r.processed,
            pending_token=r.pending_token,
            forked_from=r.forked_from,
            created_at=r.created_at,
            updated_at=r.updated_at,
        )

    def to_info(self) -> RefInfo:
        return RefInfo(
            self.namespace,
            self.name,
            self.fingerprint,
            bytes.fromhex(self.head_hash),
            self.processed,
            self.pending_token,
            self.forked_from,
            self.created_at,
            self.updated_at,
        )


class RefList(_Model):
    refs: list[RefModel]


class CreateRefRequest(_Model):
    fingerprint: Hex64
    head_hash: Hex64
    pending_token: TokenId | None = None
    forked_from: RefName | None = None
    actor: Actor = None


class UpdateRefRequest(_Model):
    expected_head: Hex64
    new_head: Hex64
    pending_token: TokenId | None = None
    actor: Actor = None


class ForkRefRequest(_Model):
    name: RefName
    actor: Actor = None


class PrefixModel(_Model):
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


class Lineage(_Model):
    prefixes: list[PrefixModel]


class QuarantineRequest(_Model):
    prefix_hash: Hex64
    reason: Annotated[Reason, StringConstraints(min_length=1, strip_whitespace=True)]
    actor: Actor = None


class DirectiveModel(_Model):
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


class QuarantineResponse(_Model):
    directives: list[DirectiveModel]


class StatsModel(_Model):
    namespace: str | None
    chunks: int
    prefixes: int
    refs: int
    stored_bytes: int
    kv_bytes: int
    replicas: dict[str, int]


class Health(_Model):
    status: Literal["ok"]


class ErrorModel(_Model):
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


def _refusal(description: str, model: Any = ErrorModel, **more: Any) -> dict[str, Any]:
    return {"model": model, "description": description, **more}


# What each status means on this API, declared in the OpenAPI document for the
# routes that can answer it (schemathesis holds the service to that document).
_REFUSALS: dict[int, dict[str, Any]] = {
    400: _refusal("The body could not be read"),
    401: _refusal(
        "No bearer token, or one of no namespace",
        headers={"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}},
    ),
    404: _refusal("Nothing of that name in this namespace, or the token is another namespace's"),
    409: _refusal(
        "A ref moved or exists already, or GC is purging what the call names (`Retry-After`)",
        headers={"Retry-After": {"schema": {"type": "string"}, "required": False}},
    ),
    413: _refusal("More tokens than this service's limit"),
    422: _refusal(
        "Invalid input: each field named by `loc`, or the catalog's refusal with its `error`",
        model=InvalidRequestModel | ErrorModel,
    ),
}


def _refusals(*statuses: int, body: bool = True) -> dict[int | str, dict[str, Any]]:
    """The refusals of a namespace route: 401, 404 and 422, 400 with a body, and `statuses`."""
    codes = sorted({401, 404, 422, *statuses, *((400,) if body else ())})
    return {code: _REFUSALS[code] for code in codes}


# -- metrics -------------------------------------------------------------------

_METRICS_HELP = {
    "kvc_lookups_total": "Lookups answered.",
    "kvc_lookup_hits_total": "Lookups that matched at least one token.",
    "kvc_restorable_tokens_total": "Tokens the lookups found restorable.",
    "kvc_publish_chunks_total": "Chunks newly recorded by publishes.",
    "kvc_errors_total": "Requests that failed with an unexpected error (500).",
}


class Metrics:
    """Process-wide counters, without labels: per-namespace labels would tell any scraper the tenants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(_METRICS_HELP, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def exposition(self) -> str:
        """Prometheus text format 0.0.4."""
        lines = []
        for name, value in self.snapshot().items():
            lines += [f"# HELP {name} {_METRICS_HELP[name]}", f"# TYPE {name} counter"]
            lines.append(f"{name} {value}")
        return "\n".join(lines) + "\n"


class _Guard:
    """ASGI middleware: an unexpected exception becomes a bare 500, logged and counted, never echoed."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            self.metrics.add("kvc_errors_total")
            # The type and the request line only: messages may carry values from the request.
            log.error(
                "internal error on %s %s: %s",
                scope.get("method"),
                scope.get("path"),
                exc.__class__.__name__,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if started:
                raise
            await JSONResponse({"detail": "internal error"}, status_code=500)(scope, receive, send)


class _Authenticate:
    """ASGI middleware: a namespace call without a namespace's bearer token is a 401, body unread.

    FastAPI reads and parses the body before it runs the dependencies, `_authorize`
    among them: without this, a call with no token and a broken body got a 400 or
    a 422 echoing the body. `_authorize` still decides between the namespace and 404.
    """

    def __init__(self, app: ASGIApp, hashes: Mapping[str, bytes]) -> None:
        self.app = app
        self.hashes = hashes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_ROOT):
            authorization = Headers(scope=scope).get("authorization")
            scheme, token = get_authorization_scheme_param(authorization)
            matches: set[str] = set()
            if scheme.lower() != "bearer" or not token:
                problem: str | None = MISSING_TOKEN
            else:
                matches = _namespaces_of(self.hashes, token)
                problem = None if matches else INVALID_TOKEN
            if problem is None:
                # For `_authorize`: the token is compared once per call.
                scope.setdefault("state", {})["token_namespaces"] = matches
            else:
                response = JSONResponse(
                    {"detail": problem}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app -------------------------------------------------------------------


def hash_token(token: str) -> str:
    """What a tokens file stores for `token`: the hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _namespaces_of(hashes: Mapping[str, bytes], token: str) -> set[str]:
    """The namespaces whose token `token` is: compared with every hash, so timing says nothing of which."""
    presented = hash_token(token).encode("ascii")
    return {ns for ns, h in hashes.items() if hmac.compare_digest(presented, h)}


def _not_found() -> HTTPException:
    return HTTPException(status_code=404, detail=NOT_FOUND["detail"])


def _finite(value: Any) -> Any:
    """`value` (JSON-able) with NaN and +-Inf as strings: JSON responses cannot carry them."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _bytes(hex_: str) -> bytes:
    return bytes.fromhex(hex_)


_bearer = HTTPBearer(auto_error=False, description="The namespace's token")


def _authorize(
    request: Request,
    namespace: str,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The path's namespace, if the bearer token is its token (401 without one, 404 for another's)."""
    # `_Authenticate` compared the token and refused calls without one; `credentials`
    # is here so that the OpenAPI document declares the bearer scheme.
    matches: set[str] = getattr(request.state, "token_namespaces", set())
    if namespace in matches:
        return namespace
    if matches:
        raise _not_found()  # another tenant's token: this namespace does not exist for it
    raise HTTPException(
        status_code=401, detail=INVALID_TOKEN, headers={"WWW-Authenticate": "Bearer"}
    )


Ns = Annotated[str, Depends(_authorize)]


def create_app(catalog: Catalog, tokens: Mapping[str, str], *, max_prompt_tokens: int) -> FastAPI:
    """The service over `catalog`; `tokens` maps each namespace to the sha256 hex of its bearer token."""
    hashes: dict[str, bytes] = {}
    for ns, h in tokens.items():
        if not isinstance(ns, str) or not ns:
            raise ValueError("tokens: namespace names must be non-empty strings")
        if not isinstance(h, str) or not _HEX64.fullmatch(h.lower()):
            raise ValueError(f"tokens: the hash for namespace {ns!r} is not a sha256 hex digest")
        hashes[ns] = h.lower().encode("ascii")
    if max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")

    metrics = Metrics()
    app = FastAPI(
        title="kvc catalog service",
        version="1",
        description="The kvc catalog over HTTP; see docs/http-api.md.",
    )
    app.state.metrics = metrics
    # Added last, so outermost: `_Guard` also covers `_Authenticate`.
    app.add_middleware(_Authenticate, hashes=hashes)
    app.add_middleware(_Guard, metrics=metrics)
    app.state.token_hashes = hashes

    def check_prompt(n: int) -> None:
        if n > max_prompt_tokens:
            raise HTTPException(
                status_code=413,
                detail=f"{n} tokens exceed this service's limit of {max_prompt_tokens} tokens",
            )

    def own_blob(namespace: str, blob_key: str) -> None:
        # The catalog addresses replicas by blob key alone; a tenant may touch only its own.
        with catalog.engine.connect() as conn:
            found = conn.execute(
                sa.select(sa.literal(1))
                .select_from(Chunk)
                .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
                .join(Namespace, Namespace.id == PrefixNode.namespace_id)
                .where(Chunk.blob_key == blob_key, Namespace.name == namespace)
                .limit(1)
            ).first()
        if found is None:
            raise _not_found()

    @app.exception_handler(RequestValidationError)
    def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # As FastAPI's own handler, but a NaN or Infinity in the request can be echoed.
        return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(NotFoundError)
    def on_not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(NOT_FOUND, status_code=404)

    @app.exception_handler(RefConflictError)
    def on_conflict(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(PurgeInProgressError)
    def on_purging(request: Request, exc: Exception) -> JSONResponse:
        # GC is deleting what the call names: a conflict that clears, so retry later.
        return JSONResponse(
            {"detail": str(exc), "error": "PurgeInProgressError"},
            status_code=409,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(CatalogError)
    def on_catalog_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "error": exc.__class__.__name__}, status_code=422)

    # -- unauthenticated ---------------------------------------------------------

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        """Liveness: the process answers (no auth, no catalog access)."""
        return Health(status="ok")

    @app.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
    def get_metrics() -> PlainTextResponse:
        """Prometheus counters, process-wide, no labels (no auth: they name no tenant)."""
        return PlainTextResponse(
            metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    # -- namespace and fingerprints ------------------------------------------------

    @app.get(
        f"{API_PREFIX}/namespace", response_model=NamespaceResponse, responses=_refusals(body=False)
    )
    def get_namespace(ns: Ns) -> NamespaceResponse:
        """The namespace's chunk size, or null when nothing was published yet."""
        return NamespaceResponse(chunk_size=catalog.namespace_chunk_size(ns))

    @app.post(f"{API_PREFIX}/namespace", response_model=NamespaceResponse, responses=_refusals())
    def ensure_namespace(ns: Ns, body: NamespaceRequest) -> NamespaceResponse:
        """Create the namespace if needed; answers its chunk size (fixed at creation)."""
        return NamespaceResponse(chunk_size=catalog.ensure_namespace(ns, body.chunk_size))

    @app.post(f"{API_PREFIX}/fingerprints", response_model=FingerprintModel, responses=_refusals())
    def register_fingerprint(ns: Ns, body: RegisterFingerprintRequest) -> FingerprintModel:
        fp = Fingerprint.from_descriptor(body.descriptor)
        catalog.register_fingerprint(fp)
        return FingerprintModel(fingerprint=fp.hex, descriptor=dict(fp.descriptor))

    @app.get(
        f"{API_PREFIX}/fingerprints/{{fingerprint}}",
        response_model=FingerprintModel,
        responses=_refusals(body=False),
    )
    def get_fingerprint(ns: Ns, fingerprint: Hex64) -> FingerprintModel:
        fp = catalog.get_fingerprint(fingerprint)
        if fp is None:
            raise _not_found()
        return FingerprintModel(fingerprint=fp.hex, descriptor=dict(fp.descriptor))

    # -- lookup and publish ----------------------------------------------------------

    @app.post(
        f"{API_PREFIX}/lookup",
        response_model=MatchModel,
        responses={204: {"description": "Nothing of the prompt is restorable"}, **_refusals(413)},
    )
    def lookup(ns: Ns, body: LookupRequest) -> Any:
        """The longest restorable prefix of the prompt and its chunks (200), or 204 on a miss."""
        check_prompt(len(body.tokens))
        match = catalog.lookup(
            ns,
            body.fingerprint,
            np.asarray(body.tokens, dtype="<u4"),
            shard=None if body.shard is None else body.shard.to_shard(),
            max_tokens=body.max_tokens,
        )
        metrics.add("kvc_lookups_total")
        if not match.hit:
            return Response(status_code=204)
        metrics.add("kvc_lookup_hits_total")
        metrics.add("kvc_restorable_tokens_total", match.matched_tokens)
        return MatchModel.of(match)

    @app.post(f"{API_PREFIX}/chunks", response_model=PublishResponse, responses=_refusals(409, 413))
    def publish(ns: Ns, body: PublishRequest) -> PublishResponse:
        """Record chunks whose bytes are durable (all or nothing), registering their fingerprints."""
        check_prompt(sum(len(r.tokens) for r in body.records))
        fps: dict[str, Fingerprint] = {}
        for hex_, desc in body.fingerprints.items():
            fp = Fingerprint.from_descriptor(desc)
            if fp.hex != hex_:
                raise HTTPException(
                    status_code=422,
                    detail=f"fingerprints.{hex_}: the descriptor hashes to {fp.hex}",
                )
            fps[hex_] = fp
        records = []
        for r in body.records:
            fp_or_none = fps.get(r.fingerprint) or catalog.get_fingerprint(r.fingerprint)
            if fp_or_none is None:
                raise HTTPException(
                    status_code=422,
                    detail=f"fingerprint {r.fingerprint} is neither catalogued nor in `fingerprints`",
                )
            fps[r.fingerprint] = fp_or_none
            records.append(
                ChunkRecord(
                    ns,
                    fp_or_none,
                    _bytes(r.prefix_hash),
                    _bytes(r.parent_hash),
                    r.token_start,
                    r.tokens,
                    r.shard.to_shard(),
                    r.blob_key,
                    r.codec,
                    r.stored_bytes,
                    r.kv_bytes,
                    [x.to_receipt() for x in r.receipts],
                )
            )
        # record_chunks registers the records' fingerprints in its own transaction, so a
        # refused publish leaves none behind.
        result: PublishResult = catalog.record_chunks(records, actor=body.actor)
        metrics.add("kvc_publish_chunks_total", result.recorded)
        return PublishResponse(
            recorded=result.recorded,
            already_present=result.already_present,
            replicas_added=result.replicas_added,
            conflicts=[
                ConflictModel(
                    prefix_hash=c.prefix_hash.hex(),
                    kept_key=c.kept_key,
                    rejected_key=c.rejected_key,
                )
                for c in result.conflicts
            ],
        )

    @app.post(f"{API_PREFIX}/known", response_model=KnownResponse, responses=_refusals(413))
    def known(ns: Ns, body: KnownRequest) -> KnownResponse:
        """Which of these prefixes already have a chunk for this fingerprint and shard."""
        check_prompt(len(body.prefix_hashes))
        found = catalog.known_blob_keys(
            ns, body.fingerprint, [_bytes(h) for h in body.prefix_hashes], body.shard.to_shard()
        )
        return KnownResponse(blob_keys={h.hex(): k for h, k in found.items()})

    @app.post(
        f"{API_PREFIX}/replicas", response_model=RecordReplicaResponse, responses=_refusals(409)
    )
    def record_replica(ns: Ns, body: RecordReplicaRequest) -> RecordReplicaResponse:
        """Add a replica (with its receipt) of one of this namespace's blobs."""
        own_blob(ns, body.blob_key)
        added = catalog.record_replica(
            body.blob_key, body.receipt.to_receipt(), namespace=ns, actor=body.actor
        )
        return RecordReplicaResponse(added=added)

    @app.post(
        f"{API_PREFIX}/replicas/mark", response_model=MarkReplicaResponse, responses=_refusals()
    )
    def mark_replica(ns: Ns, body: MarkReplicaRequest) -> MarkReplicaResponse:
        """Set a replica's state (e.g. `corrupt` after a failed verification), with the reason."""
        own_blob(ns, body.blob_key)
        changed = catalog.mark_replica(
            body.blob_key,
            body.location,
            body.state,
            reason=body.reason,
            namespace=ns,
            actor=body.actor,
        )
        return MarkReplicaResponse(changed=changed)

    # -- refs ------------------------------------------------------------------------
    # `{name:path}`: ref names may contain '/'; POST is only ever .../cas or .../fork.

    @app.get(f"{API_PREFIX}/refs", response_model=RefList, responses=_refusals(body=False))
    def list_refs(ns: Ns) -> RefList:
        return RefList(refs=[RefModel.of(r) for r in catalog.list_refs(ns)])

    @app.get(
        f"{API_PREFIX}/refs/{{name:path}}", response_model=RefModel, responses=_refusals(body=False)
    )
    def get_ref(ns: Ns, name: RefName) -> RefModel:
        return RefModel.of(catalog.get_ref(ns, name))

    @app.put(
        f"{API_PREFIX}/refs/{{name:path}}",
        response_model=RefModel,
        status_code=201,
        responses=_refusals(409),
    )
    def create_ref(ns: Ns, name: RefName, body: CreateRefRequest) -> RefModel:
        """Create a ref at a catalogued head; 409 if it already exists."""
        return RefModel.of(
            catalog.create_ref(
                ns,
                name,
                body.fingerprint,
                _bytes(body.head_hash),
                pending_token=body.pending_token,
                forked_from=body.forked_from,
                actor=body.actor,
            )
        )

    @app.post(
        f"{API_PREFIX}/refs/{{name:path}}/cas", response_model=RefModel, responses=_refusals(409)
    )
    def update_ref(ns: Ns, name: RefName, body: UpdateRefRequest) -> RefModel:
        """Move a ref from `expected_head` to `new_head`; 409 when it has moved meanwhile."""
        return RefModel.of(
            catalog.update_ref(
                ns,
                name,
                expected_head=_bytes(body.expected_head),
                new_head=_bytes(body.new_head),
                pending_token=body.pending_token,
                actor=body.actor,
            )
        )

    @app.post(
        f"{API_PREFIX}/refs/{{name:path}}/fork",
        response_model=RefModel,
        status_code=201,
        responses=_refusals(409),
    )
    def fork_ref(ns: Ns, name: RefName, body: ForkRefRequest) -> RefModel:
        """A new ref `body.name` at the head of `name`."""
        return RefModel.of(catalog.fork_ref(ns, name, body.name, actor=body.actor))

    @app.delete(
        f"{API_PREFIX}/refs/{{name:path}}", status_code=204, responses=_refusals(body=False)
    )
    def delete_ref(ns: Ns, name: RefName) -> Response:
        catalog.delete_ref(ns, name)
        return Response(status_code=204)

    # -- lineage, quarantine, stats ------------------------------------------------------

    @app.get(
        f"{API_PREFIX}/prefixes/{{prefix_hash}}/lineage",
        response_model=Lineage,
        responses=_refusals(body=False),
    )
    def lineage(ns: Ns, prefix_hash: Hex64) -> Lineage:
        """The chain from the root to this prefix, root first."""
        return Lineage(
            prefixes=[PrefixModel.of(p) for p in catalog.lineage(ns, _bytes(prefix_hash))]
        )

    @app.post(f"{API_PREFIX}/quarantine", response_model=QuarantineResponse, responses=_refusals())
    def quarantine(ns: Ns, body: QuarantineRequest) -> QuarantineResponse:
        """Make a prefix and its descendants unrestorable; answers one directive per replica to drop."""
        directives = catalog.quarantine(ns, _bytes(body.prefix_hash), body.reason, actor=body.actor)
        return QuarantineResponse(directives=[DirectiveModel.of(d) for d in directives])

    @app.get(f"{API_PREFIX}/stats", response_model=StatsModel, responses=_refusals(body=False))
    def stats(ns: Ns) -> StatsModel:
        return StatsModel(**catalog.stats(ns))

    return app
