"""Routes of a namespace's GC roots: refs (named continuations) and pins.

`{name:path}`: ref and pin names may contain '/'; POST is only ever .../cas or .../fork.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from catalog.wire import API_PREFIX
from catalog.wire_refs import (
    CreateRefRequest,
    ForkRefRequest,
    PinList,
    PinModel,
    PinName,
    PinRequest,
    RefList,
    RefModel,
    RefName,
    UpdateRefRequest,
)
from kvc.service.auth import Ns
from kvc.service.deps import Cat, refusals
from kvc.service.parsing import ThreadParsedRoute

router = APIRouter(prefix=API_PREFIX, route_class=ThreadParsedRoute)

# A DELETE has no body: its actor comes as a query parameter.
ActorQuery = Annotated[str | None, Query(max_length=255, pattern=r"^[^\x00]*$")]


@router.get("/refs", response_model=RefList, responses=refusals(body=False))
def list_refs(ns: Ns, catalog: Cat) -> RefList:
    return RefList(refs=[RefModel.of(r) for r in catalog.list_refs(ns)])


@router.get("/refs/{name:path}", response_model=RefModel, responses=refusals(body=False))
def get_ref(ns: Ns, name: RefName, catalog: Cat) -> RefModel:
    return RefModel.of(catalog.get_ref(ns, name))


@router.put("/refs/{name:path}", response_model=RefModel, status_code=201, responses=refusals(409))
def create_ref(ns: Ns, name: RefName, body: CreateRefRequest, catalog: Cat) -> RefModel:
    """Create a ref at a catalogued head; 409 if it already exists."""
    return RefModel.of(
        catalog.create_ref(
            ns,
            name,
            body.fingerprint,
            bytes.fromhex(body.head_hash),
            pending_token=body.pending_token,
            forked_from=body.forked_from,
            actor=body.actor,
        )
    )


@router.post("/refs/{name:path}/cas", response_model=RefModel, responses=refusals(409))
def update_ref(ns: Ns, name: RefName, body: UpdateRefRequest, catalog: Cat) -> RefModel:
    """Move a ref from `expected_head` to `new_head`; 409 when it has moved meanwhile."""
    return RefModel.of(
        catalog.update_ref(
            ns,
            name,
            expected_head=bytes.fromhex(body.expected_head),
            new_head=bytes.fromhex(body.new_head),
            pending_token=body.pending_token,
            actor=body.actor,
        )
    )


@router.post(
    "/refs/{name:path}/fork", response_model=RefModel, status_code=201, responses=refusals(409)
)
def fork_ref(ns: Ns, name: RefName, body: ForkRefRequest, catalog: Cat) -> RefModel:
    """A new ref `body.name` at the head of `name`."""
    return RefModel.of(catalog.fork_ref(ns, name, body.name, actor=body.actor))


@router.delete("/refs/{name:path}", status_code=204, responses=refusals(body=False))
def delete_ref(ns: Ns, name: RefName, catalog: Cat, actor: ActorQuery = None) -> Response:
    catalog.delete_ref(ns, name, actor=actor)
    return Response(status_code=204)


@router.get("/pins", response_model=PinList, responses=refusals(body=False))
def list_pins(ns: Ns, catalog: Cat, include_expired: bool = True) -> PinList:
    """The namespace's pins by name; `live` tells which still protect their prefix."""
    pins = catalog.list_pins(ns, include_expired=include_expired)
    return PinList(pins=[PinModel.of(p) for p in pins])


@router.put("/pins/{name:path}", response_model=PinModel, responses=refusals(409))
def pin(ns: Ns, name: PinName, body: PinRequest, catalog: Cat) -> PinModel:
    """Keep a prefix and its lineage from GC (for `ttl_s` seconds if given); re-pinning moves it."""
    return PinModel.of(
        catalog.pin(
            ns,
            name,
            bytes.fromhex(body.prefix_hash),
            ttl_s=body.ttl_s,
            reason=body.reason,
            actor=body.actor,
        )
    )


@router.delete("/pins/{name:path}", status_code=204, responses=refusals(body=False))
def unpin(ns: Ns, name: PinName, catalog: Cat, actor: ActorQuery = None) -> Response:
    catalog.unpin(ns, name, actor=actor)
    return Response(status_code=204)
