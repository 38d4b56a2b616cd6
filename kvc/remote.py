"""RemoteCatalog: the catalog's interface (what checkpoints and restores use) over a `kvc serve` service."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
from pydantic import BaseModel

from catalog.base import DEFAULT_CHUNK_SIZE
from catalog.errors import (
    CatalogError,
    IdentityError,
    MissingParentError,
    NotFoundError,
    PublishError,
    PurgeInProgressError,
    RefConflictError,
)
from catalog.identity import Fingerprint, chain_root, fingerprint_hex, token_array
from catalog.models import (
    ChunkRecord,
    Conflict,
    InvalidationDirective,
    Match,
    PrefixInfo,
    PublishResult,
    RefInfo,
    ReplicaReceipt,
    Shard,
)
from kvc.service import (
    ChunkRecordModel,
    FingerprintModel,
    KnownResponse,
    Lineage,
    MarkReplicaResponse,
    MatchModel,
    NamespaceResponse,
    PublishResponse,
    QuarantineResponse,
    ReceiptModel,
    RecordReplicaResponse,
    RefList,
    RefModel,
    ShardModel,
    StatsModel,
)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_ERRORS: dict[str, type[CatalogError]] = {
    "PublishError": PublishError,
    "PurgeInProgressError": PurgeInProgressError,
    "MissingParentError": MissingParentError,
    "IdentityError": IdentityError,
    "CatalogError": CatalogError,
}


def _ref_path(name: str) -> str:
    # Encode everything, dots included, so no ref name is ever read as a path segment like "..".
    return quote(name, safe="").replace(".", "%2E")


def _detail(resp: httpx.Response) -> tuple[str, str | None]:
    try:
        body = resp.json()
    except ValueError:
        return resp.reason_phrase or f"HTTP {resp.status_code}", None
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}", None
    detail = body.get("detail")
    if isinstance(detail, list):  # request validation: name the fields, never echo the input
        parts = []
        for err in detail:
            if isinstance(err, dict):
                loc = ".".join(str(x) for x in err.get("loc", ()))
                parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return "; ".join(parts) or "invalid request", None
    error = body.get("error")
    return str(detail), error if isinstance(error, str) else None


class RemoteCatalog:
    """The parts of `catalog.Catalog` that `Checkpointer` and `Restorer` use, over HTTP.

    `token` is the bearer token of the namespaces it works in; `namespace` is
    used for calls that name none (fingerprints, and `stats()` without one).
    Errors come back as the catalog's exceptions: 404 is `NotFoundError`, 409
    `RefConflictError`, 422 `PublishError`/`IdentityError`/`CatalogError` with
    the service's message. A publish is one transaction per namespace.
    Safe to share between threads (one `httpx.Client`).
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
        default_error: type[CatalogError] = CatalogError,
    ) -> httpx.Response:
        url = f"/v1/namespaces/{quote(namespace, safe='')}/{path}"
        payload = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
        try:
            resp = self._client.request(method, url, json=payload)
        except httpx.HTTPError as exc:
            raise CatalogError(
                f"cannot reach the kvc service at {self.base_url}: {exc.__class__.__name__}"
            ) from exc
        if resp.status_code < 400:
            return resp
        self._raise(resp, method, path, default_error)

    def _raise(
        self, resp: httpx.Response, method: str, path: str, default_error: type[CatalogError]
    ) -> NoReturn:
        message, error = _detail(resp)
        code = resp.status_code
        if code == 404:
            raise NotFoundError(f"not found in namespace: {method} {path}")
        if code == 409:
            if error == "PurgeInProgressError":
                raise PurgeInProgressError(message)
            raise RefConflictError(message)
        if code == 401:
            raise CatalogError(f"the kvc service refused the token: {message}")
        if code in (400, 413, 422):
            raise _ERRORS.get(error or "", default_error)(message)
        raise CatalogError(f"the kvc service answered {code} to {method} {path}: {message}")

    @staticmethod
    def _parse(resp: httpx.Response, model: type[M]) -> M:
        return model.model_validate_json(resp.content)

    # -- namespaces and fingerprints ---------------------------------------------------

    def ensure_namespace(self, name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
        chain_root(name)
        resp = self._call("POST", name, "namespace", {"chunk_size": chunk_size})
        got = self._parse(resp, NamespaceResponse).chunk_size
        assert got is not None
        return got

    def namespace_chunk_size(self, name: str) -> int | None:
        try:
            resp = self._call("GET", name, "namespace")
        except NotFoundError:
            return None
        return self._parse(resp, NamespaceResponse).chunk_size

    def register_fingerprint(self, fp: Fingerprint) -> None:
        self._call("POST", self.namespace, "fingerprints", {"descriptor": dict(fp.descriptor)})

    def get_fingerprint(self, fp: Fingerprint | str) -> Fingerprint | None:
        try:
            resp = self._call("GET", self.namespace, f"fingerprints/{fingerprint_hex(fp)}")
        except NotFoundError:
            return None
        return Fingerprint.from_descriptor(self._parse(resp, FingerprintModel).descriptor)

    # -- publish -----------------------------------------------------------------------

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
                "records": [ChunkRecordModel.of(r).model_dump(mode="json") for r in recs],
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

    def record_chunk(self, record: ChunkRecord, *, actor: str | None = None) -> PublishResult:
        return self.record_chunks([record], actor=actor)

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
        state: str,
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
        resp = self._call("POST", namespace, "known", body)
        found = self._parse(resp, KnownResponse).blob_keys
        return {bytes.fromhex(h): k for h, k in found.items()}

    # -- lookup --------------------------------------------------------------------------

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
        tok = token_array(tokens)
        body = {
            "fingerprint": fp_hex,
            "tokens": tok.tolist(),
            "shard": None if shard is None else ShardModel.of(shard).model_dump(),
            "max_tokens": max_tokens,
        }
        resp = self._call("POST", namespace, "lookup", body)
        if resp.status_code == 204:
            return Match(namespace, fp_hex, shard, int(tok.size))
        return self._parse(resp, MatchModel).to_match()

    # -- refs ------------------------------------------------------------------------------

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
        body = {"name": name, "actor": actor}
        resp = self._call("POST", namespace, f"refs/{_ref_path(source)}/fork", body)
        return self._parse(resp, RefModel).to_info()

    def delete_ref(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        self._call("DELETE", namespace, f"refs/{_ref_path(name)}")

    # -- lineage, quarantine, stats ----------------------------------------------------------

    def lineage(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        resp = self._call("GET", namespace, f"prefixes/{prefix_hash.hex()}/lineage")
        return [p.to_info() for p in self._parse(resp, Lineage).prefixes]

    def quarantine(
        self, namespace: str, prefix_hash: bytes, reason: str, *, actor: str | None = None
    ) -> list[InvalidationDirective]:
        body = {"prefix_hash": prefix_hash.hex(), "reason": reason, "actor": actor}
        resp = self._call("POST", namespace, "quarantine", body)
        return [d.to_directive() for d in self._parse(resp, QuarantineResponse).directives]

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """One namespace's counts (the service never answers for all namespaces at once)."""
        resp = self._call("GET", namespace or self.namespace, "stats")
        return self._parse(resp, StatsModel).model_dump()
