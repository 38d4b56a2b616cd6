"""RemoteCatalog: the whole catalog interface (`catalog.base.CatalogAPI`) over a `kvc serve` service.

Imports no web framework: the bodies are `catalog.wire`'s pydantic models, the
transport is httpx.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from catalog.base import DEFAULT_CHUNK_SIZE
from catalog.errors import (
    CatalogError,
    CatalogInputError,
    CatalogUnavailableError,
    IdentityError,
    NotFoundError,
    OutcomeUnknownError,
    PublishError,
)
from catalog.identity import Fingerprint, chain_root, fingerprint_hex, token_array
from catalog.models import (
    ChunkRecord,
    Conflict,
    EventInfo,
    InvalidationDirective,
    Match,
    PinInfo,
    PrefixInfo,
    PublishResult,
    RefInfo,
    ReplicaReceipt,
    ReplicaState,
    Shard,
)
from catalog.remote_errors import raise_error
from catalog.wire import (
    API_ROOT,
    ChunkRecordModel,
    CountResponse,
    DemandResponse,
    EventList,
    FingerprintModel,
    KnownResponse,
    Lineage,
    MarkReplicaResponse,
    MatchModel,
    NamespaceResponse,
    PrefixesWithTokensRequest,
    PrefixModel,
    PublishResponse,
    QuarantineResponse,
    ReceiptModel,
    RecordReplicaResponse,
    ReplicaKeys,
    ShardModel,
    StatsModel,
)
from catalog.wire_refs import PinList, PinModel, RefList, RefModel

if TYPE_CHECKING:
    from catalog.base import CatalogAPI

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

# Transport failures before anything was sent: the call did not land.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)
_WRITES = frozenset({"POST", "PUT", "DELETE", "PATCH"})


def _record_model(r: ChunkRecord) -> ChunkRecordModel:
    """The record on the wire; one the service would refuse is refused here, as the SQL catalog does."""
    try:
        return ChunkRecordModel.of(r)
    except ValidationError as exc:
        fields = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PublishError(f"invalid chunk record {r.prefix_hash.hex()}: {fields}") from exc


def _ref_path(name: str) -> str:
    # Encode everything, dots included, so no ref name is ever read as a path segment like "..".
    return quote(name, safe="").replace(".", "%2E")


def _check_name(kind: str, name: str) -> None:
    # Names travel in the path, where an empty one or a line break cannot: refused here
    # as the catalog refuses them (a ref name: no NUL, CR or LF; a pin name: printable).
    bad = "\x00\n\r" if kind == "ref" else ""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or any(c in name for c in bad)
        or (kind == "pin" and not name.isprintable())
    ):
        raise CatalogInputError(f"invalid {kind} name {name!r:.80}: 1-255 printable characters")


class RemoteCatalog:
    """`catalog.base.CatalogAPI` over HTTP: pass it wherever a catalog is expected.

    `token` is the bearer token of the namespaces it works in; `namespace` is
    used for calls that name none (fingerprints, replicas, and `stats()` or
    `events()` without one): the service answers only for the token's
    namespaces, never for all. Errors come back as the classes of
    `catalog.errors` the SQL catalog raises for the same call (the service names
    the class; docs/http-api.md has the table). A call that could not be sent,
    or a 502/503, is `CatalogUnavailableError`; a write whose answer was lost
    (a dropped connection or a read timeout after sending, a 500 or 504) is
    `OutcomeUnknownError`, a read's is `CatalogUnavailableError`. `actor` is
    sent to the service, which records it as given. A publish is one
    transaction per namespace. Safe to share between threads (one `httpx.Client`).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        namespace: str = "default",
        timeout: float = 30,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self._client = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"RemoteCatalog({self.base_url!r}, namespace={self.namespace!r})"

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------

    def _call(
        self,
        method: str,
        namespace: str,
        path: str,
        body: BaseModel | dict[str, Any] | None = None,
        *,
        params: dict[str, Any] | None = None,
        read_only: bool = False,
        default_error: type[CatalogError] | None = None,
    ) -> httpx.Response:
        """One request; `read_only` marks a POST that changes nothing (lookup, known, demand)."""
        url = f"{API_ROOT}{quote(namespace, safe='')}/{path}"
        payload = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
        write = method in _WRITES and not read_only
        if params is not None:
            params = {k: v for k, v in params.items() if v is not None}
        try:
            resp = self._client.request(method, url, json=payload, params=params)
        except _NOT_SENT as exc:
            raise CatalogUnavailableError(
                f"cannot reach the kvc service at {self.base_url}: {exc.__class__.__name__}"
            ) from exc
        except httpx.HTTPError as exc:
            if write:
                raise OutcomeUnknownError(
                    f"{method} {path} was sent to the kvc service at {self.base_url} but its "
                    f"answer was lost ({exc.__class__.__name__}): it may have landed"
                ) from exc
            raise CatalogUnavailableError(
                f"the kvc service at {self.base_url} did not answer {method} {path}: "
                f"{exc.__class__.__name__}"
            ) from exc
        if 200 <= resp.status_code < 300:
            return resp
        raise_error(resp, method, path, write=write, default_error=default_error)

    def _parse(self, resp: httpx.Response, model: type[M]) -> M:
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as exc:
            # Not a kvc answer (a proxy's page?): whatever was asked may have been done.
            method = resp.request.method
            cls = OutcomeUnknownError if method in _WRITES else CatalogUnavailableError
            raise cls(
                f"the answer to {method} {resp.request.url.path} is not the kvc service's"
            ) from exc

    # -- namespaces and fingerprints ---------------------------------------------------

    def ensure_namespace(self, name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
        chain_root(name)
        resp = self._call("POST", name, "namespace", {"chunk_size": chunk_size})
        got = self._parse(resp, NamespaceResponse).chunk_size
        if got is None:
            raise CatalogUnavailableError("the kvc service created no namespace")
        return got

    def namespace_chunk_size(self, name: str) -> int | None:
        chain_root(name)
        try:
            resp = self._call("GET", name, "namespace")
        except NotFoundError:
            return None
        return self._parse(resp, NamespaceResponse).chunk_size

    def register_fingerprint(self, fp: Fingerprint, *, namespace: str | None = None) -> None:
        body = {"descriptor": dict(fp.descriptor)}
        self._call("POST", namespace or self.namespace, "fingerprints", body)

    def get_fingerprint(
        self, fp: Fingerprint | str, *, namespace: str | None = None
    ) -> Fingerprint | None:
        try:
            resp = self._call(
                "GET", namespace or self.namespace, f"fingerprints/{fingerprint_hex(fp)}"
            )
        except NotFoundError:
            return None
        return Fingerprint.from_descriptor(self._parse(resp, FingerprintModel).descriptor)

    # -- publish and lookup --------------------------------------------------------------

    def record_chunks(
        self, records: Sequence[ChunkRecord], *, actor: str | None = None
    ) -> PublishResult:
        """Record chunks whose bytes are durable; idempotent, all or nothing per namespace."""
        by_ns: dict[str, list[ChunkRecord]] = {}
        for r in records:
            if not isinstance(r.fingerprint, Fingerprint):
                raise PublishError(
                    "ChunkRecord.fingerprint must be a Fingerprint (its descriptor is stored)"
                )
            by_ns.setdefault(r.namespace, []).append(r)
        recorded = present = added = 0
        conflicts: list[Conflict] = []
        for ns, recs in by_ns.items():
            body = {
                "fingerprints": {r.fingerprint.hex: dict(r.fingerprint.descriptor) for r in recs},
                "records": [_record_model(r).model_dump(mode="json") for r in recs],
                "actor": actor,
            }
            resp = self._call("POST", ns, "chunks", body, default_error=PublishError)
            out = self._parse(resp, PublishResponse)
            recorded += out.recorded
            present += out.already_present
            added += out.replicas_added
            conflicts += [
                Conflict(bytes.fromhex(c.prefix_hash), c.kept_key, c.rejected_key)
                for c in out.conflicts
            ]
        return PublishResult(recorded, present, added, tuple(conflicts))

    def known_blob_keys(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        prefix_hashes: Sequence[bytes],
        shard: Shard,
    ) -> dict[bytes, str]:
        if not prefix_hashes:
            return {}
        body = {
            "fingerprint": fingerprint_hex(fingerprint),
            "prefix_hashes": [h.hex() for h in prefix_hashes],
            "shard": ShardModel.of(shard).model_dump(),
        }
        resp = self._call("POST", namespace, "known", body, read_only=True)
        found = self._parse(resp, KnownResponse).blob_keys
        return {bytes.fromhex(h): k for h, k in found.items()}

    def lookup(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        shard: Shard | None = None,
        max_tokens: int | None = None,
    ) -> Match:
        """The longest restorable prefix of `tokens` and its chunks; a miss is an empty Match."""
        fp_hex = fingerprint_hex(fingerprint)
        tok = token_array(tokens)  # validates, as the catalog does
        body = {
            "fingerprint": fp_hex,
            "tokens": tok.tolist(),
            "shard": None if shard is None else ShardModel.of(shard).model_dump(),
            "max_tokens": max_tokens,
        }
        resp = self._call("POST", namespace, "lookup", body, read_only=True)
        if resp.status_code == 204:
            return Match(namespace, fp_hex, shard, int(tok.size))
        return self._parse(resp, MatchModel).to_match()

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """One namespace's counts (the service never answers for all namespaces at once)."""
        resp = self._call("GET", namespace or self.namespace, "stats")
        return self._parse(resp, StatsModel).model_dump()

    # -- replicas (of the namespace's blobs only) -----------------------------------------

    def record_replica(
        self,
        blob_key: str,
        receipt: ReplicaReceipt,
        *,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> bool:
        body = {
            "blob_key": blob_key,
            "receipt": ReceiptModel.of(receipt).model_dump(mode="json"),
            "actor": actor,
        }
        resp = self._call("POST", namespace or self.namespace, "replicas", body)
        return self._parse(resp, RecordReplicaResponse).added

    def mark_replica(
        self,
        blob_key: str,
        location: str,
        state: ReplicaState,
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> bool:
        body = {
            "blob_key": blob_key,
            "location": location,
            "state": state,
            "reason": reason,
            "actor": actor,
        }
        resp = self._call("POST", namespace or self.namespace, "replicas/mark", body)
        return self._parse(resp, MarkReplicaResponse).changed

    def touch_verified(
        self, location: str, blob_keys: Sequence[str], *, namespace: str | None = None
    ) -> int:
        if not blob_keys:
            return 0
        body = {"location": location, "blob_keys": list(blob_keys)}
        resp = self._call("POST", namespace or self.namespace, "replicas/verified", body)
        return self._parse(resp, CountResponse).count

    def replicas_at(self, location: str, *, namespace: str | None = None) -> list[str]:
        resp = self._call(
            "GET", namespace or self.namespace, "replicas", params={"location": location}
        )
        return self._parse(resp, ReplicaKeys).blob_keys

    def remove_replicas(
        self,
        location: str,
        blob_keys: Sequence[str],
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> int:
        if not blob_keys:
            return 0
        body = {
            "location": location,
            "blob_keys": list(blob_keys),
            "reason": reason,
            "actor": actor,
        }
        resp = self._call("POST", namespace or self.namespace, "replicas/remove", body)
        return self._parse(resp, CountResponse).count

    # -- refs and pins -----------------------------------------------------------------------

    def create_ref(
        self,
        namespace: str,
        name: str,
        fingerprint: Fingerprint | str,
        head_hash: bytes,
        *,
        pending_token: int | None = None,
        forked_from: str | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        _check_name("ref", name)
        body = {
            "fingerprint": fingerprint_hex(fingerprint),
            "head_hash": head_hash.hex(),
            "pending_token": pending_token,
            "forked_from": forked_from,
            "actor": actor,
        }
        resp = self._call("PUT", namespace, f"refs/{_ref_path(name)}", body)
        return self._parse(resp, RefModel).to_info()

    def get_ref(self, namespace: str, name: str) -> RefInfo:
        _check_name("ref", name)
        resp = self._call("GET", namespace, f"refs/{_ref_path(name)}")
        return self._parse(resp, RefModel).to_info()

    def list_refs(self, namespace: str) -> list[RefInfo]:
        resp = self._call("GET", namespace, "refs")
        return [r.to_info() for r in self._parse(resp, RefList).refs]

    def update_ref(
        self,
        namespace: str,
        name: str,
        *,
        expected_head: bytes,
        new_head: bytes,
        pending_token: int | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        _check_name("ref", name)
        body = {
            "expected_head": expected_head.hex(),
            "new_head": new_head.hex(),
            "pending_token": pending_token,
            "actor": actor,
        }
        resp = self._call("POST", namespace, f"refs/{_ref_path(name)}/cas", body)
        return self._parse(resp, RefModel).to_info()

    def fork_ref(
        self, namespace: str, source: str, name: str, *, actor: str | None = None
    ) -> RefInfo:
        _check_name("ref", source)
        body = {"name": name, "actor": actor}
        resp = self._call("POST", namespace, f"refs/{_ref_path(source)}/fork", body)
        return self._parse(resp, RefModel).to_info()

    def delete_ref(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        _check_name("ref", name)
        self._call("DELETE", namespace, f"refs/{_ref_path(name)}", params={"actor": actor})

    def pin(
        self,
        namespace: str,
        name: str,
        prefix_hash: bytes,
        *,
        ttl_s: float | None = None,
        reason: str | None = None,
        actor: str | None = None,
    ) -> PinInfo:
        _check_name("pin", name)
        body = {"prefix_hash": prefix_hash.hex(), "ttl_s": ttl_s, "reason": reason, "actor": actor}
        resp = self._call("PUT", namespace, f"pins/{_ref_path(name)}", body)
        return self._parse(resp, PinModel).to_info()

    def unpin(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        _check_name("pin", name)
        self._call("DELETE", namespace, f"pins/{_ref_path(name)}", params={"actor": actor})

    def list_pins(self, namespace: str, *, include_expired: bool = True) -> list[PinInfo]:
        params = {"include_expired": "true" if include_expired else "false"}
        resp = self._call("GET", namespace, "pins", params=params)
        return [p.to_info() for p in self._parse(resp, PinList).pins]

    def declare_demand(
        self,
        worker: str,
        namespace: str,
        prefix_hash: bytes,
        *,
        priority: float = 1.0,
        ttl_s: float = 3600,
    ) -> None:
        body = {
            "worker": worker,
            "prefix_hash": prefix_hash.hex(),
            "priority": priority,
            "ttl_s": ttl_s,
        }
        self._call("POST", namespace, "demand", body)

    def demand(self, namespace: str, prefix_hashes: Sequence[bytes]) -> dict[bytes, float]:
        if not prefix_hashes:
            return {}
        body = {"prefix_hashes": sorted({h.hex() for h in prefix_hashes})}
        resp = self._call("POST", namespace, "demand/query", body, read_only=True)
        found = self._parse(resp, DemandResponse).demand
        return {bytes.fromhex(h): p for h, p in found.items()}

    # -- lineage, quarantine, history ----------------------------------------------------------

    def get_prefix(self, namespace: str, prefix_hash: bytes) -> PrefixInfo:
        resp = self._call("GET", namespace, f"prefixes/{_hash_path(prefix_hash)}")
        return self._parse(resp, PrefixModel).to_info()

    def lineage(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        resp = self._call("GET", namespace, f"prefixes/{_hash_path(prefix_hash)}/lineage")
        return [p.to_info() for p in self._parse(resp, Lineage).prefixes]

    def descendants(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        resp = self._call("GET", namespace, f"prefixes/{_hash_path(prefix_hash)}/descendants")
        return [p.to_info() for p in self._parse(resp, Lineage).prefixes]

    def prefixes_with_tokens(
        self, namespace: str, tokens: Sequence[int] | np.ndarray[Any, Any], *, limit: int = 64
    ) -> list[PrefixInfo]:
        tok = token_array(tokens)  # validates, as the catalog does
        body = PrefixesWithTokensRequest(tokens=tok.tolist(), limit=max(1, min(limit, 64)))
        resp = self._call("POST", namespace, "prefixes/with-tokens", body, read_only=True)
        return [p.to_info() for p in self._parse(resp, Lineage).prefixes]

    def quarantine(
        self, namespace: str, prefix_hash: bytes, reason: str, *, actor: str | None = None
    ) -> list[InvalidationDirective]:
        body = {"prefix_hash": _hash_path(prefix_hash), "reason": reason, "actor": actor}
        resp = self._call("POST", namespace, "quarantine", body)
        return [d.to_directive() for d in self._parse(resp, QuarantineResponse).directives]

    def events(
        self,
        *,
        namespace: str | None = None,
        kind: str | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[EventInfo]:
        """The history of `namespace` (the client's without one: the service never answers
        for all namespaces at once)."""
        params = {"kind": kind, "since_seq": since_seq, "limit": limit}
        resp = self._call("GET", namespace or self.namespace, "events", params=params)
        return [e.to_info() for e in self._parse(resp, EventList).events]


def _hash_path(prefix_hash: bytes) -> str:
    if not isinstance(prefix_hash, bytes) or len(prefix_hash) != 32:
        raise IdentityError(f"prefix hash must be 32 bytes, got {prefix_hash!r:.80}")
    return prefix_hash.hex()


if TYPE_CHECKING:

    def _conforms(remote: RemoteCatalog) -> CatalogAPI:
        # mypy fails here when RemoteCatalog drifts from the catalog seam.
        return remote
