"""Routes of a namespace's replicas and demand. The catalog addresses a replica by blob key
and location alone: every route here is scoped to the blobs of the token's namespace."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from catalog.wire import (
    API_PREFIX,
    CountResponse,
    DeclareDemandRequest,
    DemandRequest,
    DemandResponse,
    MarkReplicaRequest,
    MarkReplicaResponse,
    RecordReplicaRequest,
    RecordReplicaResponse,
    RemoveReplicasRequest,
    ReplicaKeys,
    TouchVerifiedRequest,
)
from kvc.service.auth import Ns, not_found
from kvc.service.deps import Cat, refusals
from kvc.service.parsing import ThreadParsedRoute

router = APIRouter(prefix=API_PREFIX, route_class=ThreadParsedRoute)


def _own_blob(catalog: Cat, namespace: str, blob_key: str) -> None:
    """404 unless a chunk of `namespace` has this blob: a tenant touches only its own replicas."""
    if not catalog.holds_blob(namespace, blob_key):
        raise not_found()


@router.post("/replicas", response_model=RecordReplicaResponse, responses=refusals(409))
def record_replica(ns: Ns, body: RecordReplicaRequest, catalog: Cat) -> RecordReplicaResponse:
    """Add a replica (with its receipt) of one of this namespace's blobs."""
    _own_blob(catalog, ns, body.blob_key)
    added = catalog.record_replica(
        body.blob_key, body.receipt.to_receipt(), namespace=ns, actor=body.actor
    )
    return RecordReplicaResponse(added=added)


@router.get("/replicas", response_model=ReplicaKeys, responses=refusals(body=False))
def replicas_at(
    ns: Ns,
    catalog: Cat,
    location: Annotated[str, Query(min_length=1, max_length=1024, pattern=r"^[^\x00]*$")],
) -> ReplicaKeys:
    """The blob keys of this namespace's chunks that have a replica at `location`."""
    return ReplicaKeys(blob_keys=catalog.replicas_at(location, namespace=ns))


@router.post("/replicas/mark", response_model=MarkReplicaResponse, responses=refusals())
def mark_replica(ns: Ns, body: MarkReplicaRequest, catalog: Cat) -> MarkReplicaResponse:
    """Set a replica's state (e.g. `corrupt` after a failed verification), with the reason."""
    _own_blob(catalog, ns, body.blob_key)
    changed = catalog.mark_replica(
        body.blob_key,
        body.location,
        body.state,
        reason=body.reason,
        namespace=ns,
        actor=body.actor,
    )
    return MarkReplicaResponse(changed=changed)


@router.post("/replicas/verified", response_model=CountResponse, responses=refusals())
def touch_verified(ns: Ns, body: TouchVerifiedRequest, catalog: Cat) -> CountResponse:
    """Record that these replicas' bytes were just read back and verified; answers how many."""
    count = catalog.touch_verified(body.location, body.blob_keys, namespace=ns)
    return CountResponse(count=count)


@router.post("/replicas/remove", response_model=CountResponse, responses=refusals())
def remove_replicas(ns: Ns, body: RemoveReplicasRequest, catalog: Cat) -> CountResponse:
    """Forget this namespace's replicas at `location` among `blob_keys`; answers how many."""
    count = catalog.remove_replicas(
        body.location, body.blob_keys, reason=body.reason, namespace=ns, actor=body.actor
    )
    return CountResponse(count=count)


@router.post("/demand", status_code=204, responses=refusals())
def declare_demand(ns: Ns, body: DeclareDemandRequest, catalog: Cat) -> Response:
    """A worker expects to need this prefix for `ttl_s` seconds (a GC root while live)."""
    catalog.declare_demand(
        body.worker,
        ns,
        bytes.fromhex(body.prefix_hash),
        priority=body.priority,
        ttl_s=body.ttl_s,
    )
    return Response(status_code=204)


@router.post("/demand/query", response_model=DemandResponse, responses=refusals())
def demand(ns: Ns, body: DemandRequest, catalog: Cat) -> DemandResponse:
    """The live demand (priority summed over workers) of each of these prefixes that has any."""
    found = catalog.demand(ns, [bytes.fromhex(h) for h in body.prefix_hashes])
    return DemandResponse(demand={h.hex(): p for h, p in found.items()})
