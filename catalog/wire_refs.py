"""The wire models of refs and pins: the bodies of `kvc serve`'s ref and pin routes and their client."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import StringConstraints

from catalog.models import PinInfo, RefInfo
from catalog.wire import NO_NUL, Actor, Hex64, Reason, Seconds, TokenId, WireModel

RefName = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=NO_NUL)]
PinName = Annotated[
    str, StringConstraints(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")
]


class RefModel(WireModel):
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


class RefList(WireModel):
    refs: list[RefModel]


class CreateRefRequest(WireModel):
    fingerprint: Hex64
    head_hash: Hex64
    pending_token: TokenId | None = None
    forked_from: RefName | None = None
    actor: Actor = None


class UpdateRefRequest(WireModel):
    expected_head: Hex64
    new_head: Hex64
    pending_token: TokenId | None = None
    actor: Actor = None


class ForkRefRequest(WireModel):
    name: RefName
    actor: Actor = None


class PinRequest(WireModel):
    prefix_hash: Hex64
    ttl_s: Seconds | None = None
    reason: Reason | None = None
    actor: Actor = None


class PinModel(WireModel):
    namespace: str
    name: str
    prefix_hash: Hex64
    reason: str | None
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    live: bool

    @classmethod
    def of(cls, p: PinInfo) -> PinModel:
        return cls(
            namespace=p.namespace,
            name=p.name,
            prefix_hash=p.prefix_hash.hex(),
            reason=p.reason,
            created_by=p.created_by,
            created_at=p.created_at,
            expires_at=p.expires_at,
            live=p.live,
        )

    def to_info(self) -> PinInfo:
        return PinInfo(
            self.namespace,
            self.name,
            bytes.fromhex(self.prefix_hash),
            self.reason,
            self.created_by,
            self.created_at,
            self.expires_at,
            self.live,
        )


class PinList(WireModel):
    pins: list[PinModel]
