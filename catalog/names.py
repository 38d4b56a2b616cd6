"""Names: refs (named continuations, compare-and-swap), pins and worker demand, the roots of GC."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from catalog.changes import Change, PinRemoved, PinSet, RefDeleted, RefSet
from catalog.clock import utcnow
from catalog.database import batches
from catalog.errors import (
    CatalogInputError,
    NotFoundError,
    RefConflictError,
)
from catalog.identity import (
    Fingerprint,
    check_prefix_hash,
    fingerprint_hex,
)
from catalog.models import (
    PinInfo,
    RefInfo,
)
from catalog.schema import (
    Demand,
    FingerprintRow,
    Namespace,
    Pin,
    PrefixNode,
    Ref,
)
from catalog.transactions import Database, hold

log = logging.getLogger(__name__)


class Names:
    """Refs, pins and demand."""

    db: Database

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
        """Create a named continuation at `head_hash` (which must be catalogued in `namespace`)."""
        fp_hex = fingerprint_hex(fingerprint)
        _check_ref_name(name)

        def run() -> RefInfo:
            with self.db.write() as conn:
                ns_id, head = self._ref_head(conn, namespace, head_hash)
                hold(conn, [ns_id], {head_hash}, "that the ref would name")
                if (
                    conn.execute(
                        sa.select(FingerprintRow.hex).where(FingerprintRow.hex == fp_hex)
                    ).first()
                    is None
                ):
                    raise NotFoundError(f"fingerprint {fp_hex} is not catalogued")
                now = utcnow()
                try:
                    with conn.begin_nested():
                        conn.execute(
                            sa.insert(Ref).values(
                                namespace_id=ns_id,
                                name=name,
                                fingerprint=fp_hex,
                                head_hash=head_hash,
                                processed=head.token_start + head.token_count,
                                pending_token=pending_token,
                                forked_from=forked_from,
                                created_at=now,
                                updated_at=now,
                            )
                        )
                except IntegrityError as exc:
                    raise RefConflictError(
                        f"ref {name!r} already exists in namespace {namespace!r}"
                    ) from exc
                self.db.event(
                    conn,
                    "ref.create",
                    namespace,
                    name,
                    actor,
                    {"head": head_hash.hex(), "forked_from": forked_from},
                )
                ref = self._get_ref(conn, namespace, ns_id, name)
                self.db.changed(conn, RefSet(ref))
                return ref

        return self.db.retrying(run)

    def _ref_head(self, conn: sa.Connection, namespace: str, head_hash: bytes) -> tuple[int, Any]:
        ns = self.db.namespace(conn, namespace)
        if ns is None:
            raise NotFoundError(f"no namespace {namespace!r}")
        head = conn.execute(
            sa.select(PrefixNode.token_start, PrefixNode.token_count).where(
                PrefixNode.prefix_hash == head_hash, PrefixNode.namespace_id == ns[0]
            )
        ).first()
        if head is None:
            raise NotFoundError(
                f"prefix {head_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return ns[0], head

    def _get_ref(self, conn: sa.Connection, namespace: str, ns_id: int, name: str) -> RefInfo:
        row = conn.execute(
            sa.select(Ref).where(Ref.namespace_id == ns_id, Ref.name == name)
        ).first()
        if row is None:
            raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
        return RefInfo(
            namespace,
            row.name,
            row.fingerprint,
            row.head_hash,
            row.processed,
            row.pending_token,
            row.forked_from,
            row.created_at,
            row.updated_at,
        )

    def get_ref(self, namespace: str, name: str) -> RefInfo:
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
            return self._get_ref(conn, namespace, ns[0], name)

    def list_refs(self, namespace: str) -> list[RefInfo]:
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                return []
            rows = conn.execute(
                sa.select(Ref).where(Ref.namespace_id == ns[0]).order_by(Ref.name)
            ).all()
            return [
                RefInfo(
                    namespace,
                    r.name,
                    r.fingerprint,
                    r.head_hash,
                    r.processed,
                    r.pending_token,
                    r.forked_from,
                    r.created_at,
                    r.updated_at,
                )
                for r in rows
            ]

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
        """Move a ref from `expected_head` to `new_head`; a concurrent mover wins, this raises
        RefConflictError. A move that changes nothing (same head, same pending token) writes
        nothing and records no event."""

        def run() -> RefInfo:
            with self.db.write() as conn:
                ns_id, head = self._ref_head(conn, namespace, new_head)
                if expected_head == new_head:
                    ref = self._get_ref(conn, namespace, ns_id, name)
                    if ref.head_hash == new_head and ref.pending_token == pending_token:
                        return ref
                hold(conn, [ns_id], {new_head}, "that the ref would name")
                res = conn.execute(
                    sa.update(Ref)
                    .where(
                        Ref.namespace_id == ns_id, Ref.name == name, Ref.head_hash == expected_head
                    )
                    .values(
                        head_hash=new_head,
                        processed=head.token_start + head.token_count,
                        pending_token=pending_token,
                        updated_at=utcnow(),
                    )
                )
                if res.rowcount != 1:
                    current = conn.execute(
                        sa.select(Ref.head_hash).where(Ref.namespace_id == ns_id, Ref.name == name)
                    ).scalar()
                    if current is None:
                        raise NotFoundError(f"no ref {name!r} in namespace {namespace!r}")
                    raise RefConflictError(
                        f"ref {name!r} moved: expected head {expected_head.hex()[:16]}, found {current.hex()[:16]}"
                    )
                self.db.event(
                    conn,
                    "ref.update",
                    namespace,
                    name,
                    actor,
                    {"from": expected_head.hex(), "to": new_head.hex()},
                )
                ref = self._get_ref(conn, namespace, ns_id, name)
                self.db.changed(conn, RefSet(ref))
                return ref

        return self.db.retrying(run)

    def fork_ref(
        self, namespace: str, source: str, name: str, *, actor: str | None = None
    ) -> RefInfo:
        """A new ref at the same head as `source`, remembering where it was forked from."""
        src = self.get_ref(namespace, source)
        return self.create_ref(
            namespace,
            name,
            src.fingerprint,
            src.head_hash,
            pending_token=src.pending_token,
            forked_from=source,
            actor=actor,
        )

    def delete_ref(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        self._delete_named(Ref, "ref", "ref.delete", namespace, name, actor, RefDeleted)

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
        """Keep `prefix_hash` and its lineage from GC, for `ttl_s` seconds or until unpinned.

        Setting an existing pin moves it (and resets its expiry). The prefix must be
        catalogued in `namespace` and not being purged.
        """
        _check_pin_name(name)
        check_prefix_hash(prefix_hash)
        if ttl_s is not None and not (0 < ttl_s < 1e10):
            raise CatalogInputError("a pin's ttl must be a positive number of seconds")
        if reason is not None and len(reason) > 1024:
            raise CatalogInputError("a pin's reason is at most 1024 characters")

        def run() -> PinInfo:
            with self.db.write() as conn:
                ns_id, _head = self._ref_head(conn, namespace, prefix_hash)
                hold(conn, [ns_id], {prefix_hash}, "that the pin would name")
                now = utcnow()
                expires = None if ttl_s is None else now + timedelta(seconds=ttl_s)
                values = {
                    "prefix_hash": prefix_hash,
                    "reason": reason,
                    "created_by": actor,
                    "created_at": now,
                    "expires_at": expires,
                }
                conn.execute(
                    self.db.insert(conn, Pin)
                    .values(namespace_id=ns_id, name=name, **values)
                    .on_conflict_do_update(index_elements=["namespace_id", "name"], set_=values)
                )
                self.db.event(
                    conn,
                    "pin.set",
                    namespace,
                    name,
                    actor,
                    {
                        "prefix": prefix_hash.hex(),
                        "expires_at": None if expires is None else expires.isoformat(),
                        "reason": reason,
                    },
                )
                info = PinInfo(namespace, name, prefix_hash, reason, actor, now, expires, True)
                self.db.changed(conn, PinSet(info))
                return info

        return self.db.retrying(run)

    def unpin(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        """Remove a pin (NotFoundError when there is none by that name)."""

        self._delete_named(Pin, "pin", "pin.remove", namespace, name, actor, PinRemoved)

    def list_pins(self, namespace: str, *, include_expired: bool = True) -> list[PinInfo]:
        """The namespace's pins by name; `live` tells which still protect their prefix."""
        now = utcnow()
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                return []
            rows = conn.execute(
                sa.select(Pin).where(Pin.namespace_id == ns[0]).order_by(Pin.name)
            ).all()
        out = [
            PinInfo(
                namespace,
                r.name,
                r.prefix_hash,
                r.reason,
                r.created_by,
                r.created_at,
                r.expires_at,
                r.expires_at is None or r.expires_at > now,
            )
            for r in rows
        ]
        return out if include_expired else [p for p in out if p.live]

    def _delete_named(
        self,
        table: Any,
        what: str,
        event: str,
        namespace: str,
        name: str,
        actor: str | None,
        change: Callable[[str, str, datetime], Change],
    ) -> None:
        """Delete the row `name` of a (namespace_id, name) table, with an event; else NotFound."""

        def run() -> None:
            with self.db.write() as conn:
                ns = self.db.namespace(conn, namespace)
                res = (
                    None
                    if ns is None
                    else conn.execute(
                        sa.delete(table).where(table.namespace_id == ns[0], table.name == name)
                    )
                )
                if res is None or res.rowcount != 1:
                    raise NotFoundError(f"no {what} {name!r} in namespace {namespace!r}")
                self.db.event(conn, event, namespace, name, actor, {})
                self.db.changed(conn, change(namespace, name, utcnow()))

        self.db.retrying(run)

    def declare_demand(
        self,
        worker: str,
        namespace: str,
        prefix_hash: bytes,
        *,
        priority: float = 1.0,
        ttl_s: float = 3600,
    ) -> None:
        """A worker expects to need this prefix until now + ttl (a GC root while live)."""
        from datetime import timedelta

        def run() -> None:
            with self.db.write() as conn:
                ns = self.db.namespace(conn, namespace)
                if ns is None:
                    raise NotFoundError(f"no namespace {namespace!r}")
                expires = utcnow() + timedelta(seconds=ttl_s)
                stmt = self.db.insert(conn, Demand).values(
                    worker=worker,
                    prefix_hash=prefix_hash,
                    namespace_id=ns[0],
                    priority=priority,
                    expires_at=expires,
                )
                conn.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["namespace_id", "worker", "prefix_hash"],
                        set_={"priority": priority, "expires_at": expires},
                    )
                )

        self.db.retrying(run)

    def demand(self, namespace: str, prefix_hashes: Sequence[bytes]) -> dict[bytes, float]:
        """The live demand (priority summed over workers) of each of these prefixes that has any."""
        if not prefix_hashes:
            return {}
        found: dict[bytes, float] = {}
        with self.db.read() as conn:
            for batch in batches(sorted(set(prefix_hashes))):  # one bind variable per hash
                rows = conn.execute(
                    sa.select(Demand.prefix_hash, sa.func.sum(Demand.priority))
                    .join(Namespace, Namespace.id == Demand.namespace_id)
                    .where(
                        Namespace.name == namespace,
                        Demand.prefix_hash.in_(batch),
                        Demand.expires_at > utcnow(),
                    )
                    .group_by(Demand.prefix_hash)
                )
                found.update((bytes(h), float(p)) for h, p in rows)
        return found


def _check_pin_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 255 or not name.isprintable():
        raise CatalogInputError(f"invalid pin name {name!r:.80}: 1-255 printable characters")


def _check_ref_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or any(c in name for c in "\x00\n\r")
    ):
        raise CatalogInputError(f"invalid ref name {name!r:.80}: 1-255 printable characters")
