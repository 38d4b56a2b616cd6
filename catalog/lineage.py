"""Lineage: prefix nodes, their ancestors and descendants, and quarantine of a subtree."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from catalog.changes import Quarantined
from catalog.clock import utcnow
from catalog.errors import (
    CatalogInputError,
    NotFoundError,
)
from catalog.identity import (
    check_prefix_hash,
    token_array,
)
from catalog.models import (
    InvalidationDirective,
    PrefixInfo,
)
from catalog.schema import (
    HEAD_TOKENS,
    Chunk,
    PrefixNode,
    Replica,
    be_to_tokens,
    tokens_to_be,
)
from catalog.transactions import Database

log = logging.getLogger(__name__)

# Nodes with the same tokens under different parents answered at most (a bound on the
# answer, not a limit on what is stored).
MAX_SAME_TOKENS = 64


class Lineage:
    """Prefix nodes: one, its chain to the root, its subtree; quarantine."""

    db: Database

    def get_prefix(self, namespace: str, prefix_hash: bytes) -> PrefixInfo:
        check_prefix_hash(prefix_hash)
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            row = (
                None
                if ns is None
                else conn.execute(
                    sa.select(PrefixNode).where(
                        PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0]
                    )
                ).first()
            )
        if row is None:
            raise NotFoundError(
                f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return prefix_info(row)

    def lineage(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """The chain from the root to `prefix_hash`, root first (one recursive query)."""
        check_prefix_hash(prefix_hash)
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no namespace {namespace!r}")
            up = (
                sa.select(PrefixNode.prefix_hash, PrefixNode.parent_hash)
                .where(PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0])
                .cte("up", recursive=True)
            )
            # Every step stays in the namespace: a chain never crosses into another's.
            up = up.union_all(
                sa.select(PrefixNode.prefix_hash, PrefixNode.parent_hash)
                .join(up, PrefixNode.prefix_hash == up.c.parent_hash)
                .where(PrefixNode.namespace_id == ns[0])
            )
            rows = conn.execute(
                sa.select(PrefixNode)
                .join(up, PrefixNode.prefix_hash == up.c.prefix_hash)
                .order_by(PrefixNode.token_start)
            ).all()
        if not rows:
            raise NotFoundError(
                f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
            )
        return [prefix_info(r) for r in rows]

    def prefixes_with_tokens(
        self, namespace: str, tokens: Any, *, limit: int = MAX_SAME_TOKENS
    ) -> list[PrefixInfo]:
        """The nodes of the namespace whose own tokens are exactly `tokens`, whatever their
        parent: shallowest first, at most `limit`. One indexed query (namespace, tokens_head).

        For chunks whose tokens already commit to their whole prefix (SGLang's page keys):
        the caller finds a node from its tokens alone, then its chain with `lineage`.
        """
        arr = token_array(tokens)
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                return []
            rows = conn.execute(
                sa.select(PrefixNode)
                .where(
                    PrefixNode.namespace_id == ns[0],
                    PrefixNode.tokens_head == tokens_to_be(arr[:HEAD_TOKENS]),
                    PrefixNode.tokens_be == tokens_to_be(arr),
                )
                .order_by(PrefixNode.depth, PrefixNode.prefix_hash)
                .limit(max(1, min(limit, MAX_SAME_TOKENS)))
            ).all()
        return [prefix_info(r) for r in rows]

    def _descendants_cte(self, ns_id: int, prefix_hash: bytes) -> Any:
        down = (
            sa.select(PrefixNode.prefix_hash)
            .where(PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns_id)
            .cte("down", recursive=True)
        )
        return down.union_all(
            sa.select(PrefixNode.prefix_hash)
            .join(down, PrefixNode.parent_hash == down.c.prefix_hash)
            .where(PrefixNode.namespace_id == ns_id)
        )

    def descendants(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """Every node below `prefix_hash` (not itself), in token order."""
        check_prefix_hash(prefix_hash)
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                raise NotFoundError(f"no namespace {namespace!r}")
            down = self._descendants_cte(ns[0], prefix_hash)
            rows = conn.execute(
                sa.select(PrefixNode)
                .join(down, PrefixNode.prefix_hash == down.c.prefix_hash)
                .where(PrefixNode.prefix_hash != prefix_hash)
                .order_by(PrefixNode.token_start, PrefixNode.prefix_hash)
            ).all()
        return [prefix_info(r) for r in rows]

    def quarantine(
        self, namespace: str, prefix_hash: bytes, reason: str, *, actor: str | None = None
    ) -> list[InvalidationDirective]:
        """Make a node and all its descendants unrestorable at once; return one directive per replica."""
        check_prefix_hash(prefix_hash)
        if not reason or not reason.strip():
            raise CatalogInputError("a quarantine needs a reason")

        def run() -> list[InvalidationDirective]:
            with self.db.write() as conn:
                ns = self.db.namespace(conn, namespace)
                if (
                    ns is None
                    or conn.execute(
                        sa.select(PrefixNode.prefix_hash).where(
                            PrefixNode.prefix_hash == prefix_hash, PrefixNode.namespace_id == ns[0]
                        )
                    ).first()
                    is None
                ):
                    raise NotFoundError(
                        f"prefix {prefix_hash.hex()} is not catalogued in namespace {namespace!r}"
                    )
                down = self._descendants_cte(ns[0], prefix_hash)
                affected = sa.select(down.c.prefix_hash)
                conn.execute(
                    sa.update(PrefixNode)
                    .where(PrefixNode.prefix_hash.in_(affected))
                    .values(quarantined=True, quarantine_reason=reason)
                )
                down2 = self._descendants_cte(ns[0], prefix_hash)
                rows = conn.execute(
                    sa.select(
                        Replica.location,
                        Replica.blob_key,
                        Replica.tier,
                        Replica.worker,
                        Chunk.prefix_hash,
                    )
                    .join(Chunk, Chunk.blob_key == Replica.blob_key)
                    .where(
                        Chunk.prefix_hash.in_(sa.select(down2.c.prefix_hash)),
                        Replica.namespace_id == ns[0],
                    )
                    .order_by(Chunk.prefix_hash, Replica.location)
                ).all()
                directives = [
                    InvalidationDirective(r.location, r.blob_key, r.tier, r.worker, r.prefix_hash)
                    for r in rows
                ]
                self.db.event(
                    conn,
                    "quarantine",
                    namespace,
                    prefix_hash.hex(),
                    actor,
                    {"reason": reason, "replicas": len(directives)},
                )
                self.db.changed(conn, Quarantined(namespace, prefix_hash, reason, utcnow()))
                for d in directives:
                    self.db.event(
                        conn,
                        "invalidate",
                        namespace,
                        d.blob_key,
                        actor,
                        {
                            "location": d.location,
                            "tier": d.tier,
                            "worker": d.worker,
                            "prefix": d.prefix_hash.hex(),
                            "reason": reason,
                        },
                    )
                return directives

        return self.db.retrying(run)


def prefix_info(row: Any) -> PrefixInfo:
    return PrefixInfo(
        row.prefix_hash,
        row.parent_hash,
        row.token_start,
        be_to_tokens(row.tokens_be),
        row.depth,
        row.quarantined,
        row.quarantine_reason,
    )
