"""Routes of a namespace's chunks: namespace, fingerprints, lookup, publish, prefixes, quarantine,
stats and history."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query, Response
from fastapi.exceptions import HTTPException

from catalog.identity import Fingerprint
from catalog.models import ChunkRecord, PublishResult
from catalog.wire import (
    API_PREFIX,
    ConflictModel,
    DirectiveModel,
    EventList,
    EventModel,
    FingerprintModel,
    Hex64,
    KnownRequest,
    KnownResponse,
    Lineage,
    LookupRequest,
    MatchModel,
    NamespaceRequest,
    NamespaceResponse,
    PrefixesWithTokensRequest,
    PrefixModel,
    PublishRequest,
    PublishResponse,
    QuarantineRequest,
    QuarantineResponse,
    RegisterFingerprintRequest,
    StatsModel,
)
from kvc.service.auth import Ns, not_found
from kvc.service.deps import Cat, Counters, Limit, refusals
from kvc.service.parsing import ThreadParsedRoute

router = APIRouter(prefix=API_PREFIX, route_class=ThreadParsedRoute)


# -- namespace and fingerprints ------------------------------------------------


@router.get("/namespace", response_model=NamespaceResponse, responses=refusals(body=False))
def get_namespace(ns: Ns, catalog: Cat) -> NamespaceResponse:
    """The namespace's chunk size, or null when nothing was published yet."""
    return NamespaceResponse(chunk_size=catalog.namespace_chunk_size(ns))


@router.post("/namespace", response_model=NamespaceResponse, responses=refusals())
def ensure_namespace(ns: Ns, body: NamespaceRequest, catalog: Cat) -> NamespaceResponse:
    """Create the namespace if needed; answers its chunk size (fixed at creation)."""
    return NamespaceResponse(chunk_size=catalog.ensure_namespace(ns, body.chunk_size))


@router.post("/fingerprints", response_model=FingerprintModel, responses=refusals())
def register_fingerprint(
    ns: Ns, body: RegisterFingerprintRequest, catalog: Cat
) -> FingerprintModel:
    fp = Fingerprint.from_descriptor(body.descriptor)
    catalog.register_fingerprint(fp, namespace=ns)
    return FingerprintModel(fingerprint=fp.hex, descriptor=dict(fp.descriptor))


@router.get(
    "/fingerprints/{fingerprint}", response_model=FingerprintModel, responses=refusals(body=False)
)
def get_fingerprint(ns: Ns, fingerprint: Hex64, catalog: Cat) -> FingerprintModel:
    fp = catalog.get_fingerprint(fingerprint, namespace=ns)
    if fp is None:
        raise not_found()
    return FingerprintModel(fingerprint=fp.hex, descriptor=dict(fp.descriptor))


# -- lookup and publish ------------------------------------------------------------


@router.post(
    "/lookup",
    response_model=MatchModel,
    responses={204: {"description": "Nothing of the prompt is restorable"}, **refusals(413)},
)
def lookup(ns: Ns, body: LookupRequest, catalog: Cat, metrics: Counters, limit: Limit) -> Any:
    """The longest restorable prefix of the prompt and its chunks (200), or 204 on a miss."""
    limit.check(len(body.tokens))
    match = catalog.lookup(
        ns,
        body.fingerprint,
        np.asarray(body.tokens, dtype="<u4"),
        shard=None if body.shard is None else body.shard.to_shard(),
        max_tokens=body.max_tokens,
    )
    metrics.lookups.inc()
    if not match.hit:
        return Response(status_code=204)
    metrics.lookup_hits.inc()
    metrics.restorable_tokens.inc(match.matched_tokens)
    return MatchModel.of(match)


@router.post("/chunks", response_model=PublishResponse, responses=refusals(409, 413))
def publish(
    ns: Ns, body: PublishRequest, catalog: Cat, metrics: Counters, limit: Limit
) -> PublishResponse:
    """Record chunks whose bytes are durable (all or nothing), registering their fingerprints."""
    limit.check(sum(len(r.tokens) for r in body.records))
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
        fp_or_none = fps.get(r.fingerprint) or catalog.get_fingerprint(r.fingerprint, namespace=ns)
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
                bytes.fromhex(r.prefix_hash),
                bytes.fromhex(r.parent_hash),
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
    metrics.publish_chunks.inc(result.recorded)
    return PublishResponse(
        recorded=result.recorded,
        already_present=result.already_present,
        replicas_added=result.replicas_added,
        conflicts=[
            ConflictModel(
                prefix_hash=c.prefix_hash.hex(), kept_key=c.kept_key, rejected_key=c.rejected_key
            )
            for c in result.conflicts
        ],
    )


@router.post("/known", response_model=KnownResponse, responses=refusals(413))
def known(ns: Ns, body: KnownRequest, catalog: Cat, limit: Limit) -> KnownResponse:
    """Which of these prefixes already have a chunk for this fingerprint and shard."""
    limit.check(len(body.prefix_hashes))
    found = catalog.known_blob_keys(
        ns, body.fingerprint, [bytes.fromhex(h) for h in body.prefix_hashes], body.shard.to_shard()
    )
    return KnownResponse(blob_keys={h.hex(): k for h, k in found.items()})


# -- prefixes, quarantine, stats, history ------------------------------------------------


@router.get("/prefixes/{prefix_hash}", response_model=PrefixModel, responses=refusals(body=False))
def get_prefix(ns: Ns, prefix_hash: Hex64, catalog: Cat) -> PrefixModel:
    return PrefixModel.of(catalog.get_prefix(ns, bytes.fromhex(prefix_hash)))


@router.get(
    "/prefixes/{prefix_hash}/lineage", response_model=Lineage, responses=refusals(body=False)
)
def lineage(ns: Ns, prefix_hash: Hex64, catalog: Cat) -> Lineage:
    """The chain from the root to this prefix, root first."""
    found = catalog.lineage(ns, bytes.fromhex(prefix_hash))
    return Lineage(prefixes=[PrefixModel.of(p) for p in found])


@router.get(
    "/prefixes/{prefix_hash}/descendants", response_model=Lineage, responses=refusals(body=False)
)
def descendants(ns: Ns, prefix_hash: Hex64, catalog: Cat) -> Lineage:
    """The prefix and every prefix that extends it."""
    found = catalog.descendants(ns, bytes.fromhex(prefix_hash))
    return Lineage(prefixes=[PrefixModel.of(p) for p in found])


@router.post("/prefixes/with-tokens", response_model=Lineage, responses=refusals(413))
def prefixes_with_tokens(
    ns: Ns, body: PrefixesWithTokensRequest, catalog: Cat, limit: Limit
) -> Lineage:
    """The prefixes whose own tokens are exactly these, whatever their parent, shallowest first."""
    limit.check(len(body.tokens))
    found = catalog.prefixes_with_tokens(ns, np.asarray(body.tokens, dtype="<u4"), limit=body.limit)
    return Lineage(prefixes=[PrefixModel.of(p) for p in found])


@router.post("/quarantine", response_model=QuarantineResponse, responses=refusals())
def quarantine(ns: Ns, body: QuarantineRequest, catalog: Cat) -> QuarantineResponse:
    """Make a prefix and its descendants unrestorable; answers one directive per replica to drop."""
    directives = catalog.quarantine(
        ns, bytes.fromhex(body.prefix_hash), body.reason, actor=body.actor
    )
    return QuarantineResponse(directives=[DirectiveModel.of(d) for d in directives])


@router.get("/stats", response_model=StatsModel, responses=refusals(body=False))
def stats(ns: Ns, catalog: Cat) -> StatsModel:
    return StatsModel(**catalog.stats(ns))


@router.get("/events", response_model=EventList, responses=refusals(body=False))
def events(
    ns: Ns,
    catalog: Cat,
    kind: Annotated[str | None, Query(max_length=255, pattern=r"^[^\x00]*$")] = None,
    since_seq: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> EventList:
    """The namespace's history after `since_seq`, oldest first (at most `limit` events)."""
    found = catalog.events(namespace=ns, kind=kind, since_seq=since_seq, limit=limit)
    return EventList(events=[EventModel.of(e) for e in found])
