"""tenancy: replicas, demand and fingerprint registrations belong to a namespace; grafts removed

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 03:00:00.000000

Before this revision a replica row was keyed by (blob key, location) for every tenant, so
one tenant's mark or removal changed another's, and a publish could extend another
namespace's prefix node (a "graft"), whose hashes then collided with the victim's own.
Upgrading:

- gives each replica row to every namespace whose chunks name its blob (a row no chunk
  names is dropped: its bytes are orphans, which GC's sweep reclaims after its grace);
- records which namespaces use which fingerprints (from their chunks and refs);
- keys demand by (namespace, worker, prefix), so one tenant's declaration cannot take the
  place of another's;
- removes grafted chains: nodes extending a node of another namespace, with their subtree
  in the grafting namespace, their chunks, replica rows, refs, pins and demand. The
  victim's own nodes stay; what it loses is cache, which its next checkpoint stores again.
  Each removal is a `tenancy.graft_removed` event.
"""

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

import catalog.schema
from migrations.views import create_views, drop_views

# revision identifiers, used by Alembic.
revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    "location, tier, state, size, etag, version, checksum, stored_at, last_verified_at, worker"
)
_EVENTS = sa.table(
    "events",
    sa.column("at", catalog.schema.UTCDateTime(timezone=True)),
    sa.column("kind", sa.String()),
    sa.column("namespace", sa.String()),
    sa.column("subject", sa.String()),
    sa.column("actor", sa.String()),
    sa.column("details", sa.JSON()),
)


def _replicas_table(*, scoped: bool) -> None:
    ns: list[Any] = (
        [
            sa.Column("namespace_id", sa.Integer(), nullable=False),
            sa.ForeignKeyConstraint(
                ["namespace_id"],
                ["namespaces.id"],
                name=op.f("fk_replicas_namespace_id_namespaces"),
            ),
        ]
        if scoped
        else []
    )
    op.create_table(
        "replicas",
        sa.Column("blob_key", sa.String(length=64), nullable=False),
        *ns[:1],
        sa.Column("location", sa.String(length=1024), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("etag", sa.String(length=255), nullable=True),
        sa.Column("version", sa.String(length=255), nullable=True),
        sa.Column("checksum", sa.String(length=255), nullable=False),
        sa.Column("stored_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.Column("last_verified_at", catalog.schema.UTCDateTime(timezone=True), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.CheckConstraint(
            "state IN ('durable', 'ready', 'corrupt', 'missing', 'deleting')",
            name=op.f("ck_replicas_state_known"),
        ),
        sa.CheckConstraint(
            "tier IN ('resident', 'local', 'object')", name=op.f("ck_replicas_tier_known")
        ),
        *ns[1:],
        sa.PrimaryKeyConstraint(
            *(("blob_key", "namespace_id", "location") if scoped else ("blob_key", "location")),
            name=op.f("pk_replicas"),
        ),
    )
    op.create_index("ix_replicas_location", "replicas", ["location"], unique=False)


def _demand_table(*, scoped: bool) -> None:
    op.create_table(
        "demand",
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("prefix_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("namespace_id", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Double(), nullable=False),
        sa.Column("expires_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["namespace_id"], ["namespaces.id"], name=op.f("fk_demand_namespace_id_namespaces")
        ),
        sa.PrimaryKeyConstraint(
            *(("namespace_id", "worker", "prefix_hash") if scoped else ("worker", "prefix_hash")),
            name=op.f("pk_demand"),
        ),
    )
    op.create_index("ix_demand_expires", "demand", ["expires_at"], unique=False)


def _rekey_demand(*, scoped: bool) -> None:
    """Recreate `demand` with its new key; declarations are copied (when going back to the
    old key, one per (worker, prefix): the lowest namespace's)."""
    op.execute("CREATE TABLE demand_copy AS SELECT * FROM demand")
    op.drop_index("ix_demand_expires", table_name="demand")
    op.drop_table("demand")
    _demand_table(scoped=scoped)
    keep = (
        ""
        if scoped
        else " WHERE d.namespace_id = (SELECT min(x.namespace_id) FROM demand_copy x"
        " WHERE x.worker = d.worker AND x.prefix_hash = d.prefix_hash)"
    )
    op.execute(
        "INSERT INTO demand (worker, prefix_hash, namespace_id, priority, expires_at)"
        " SELECT d.worker, d.prefix_hash, d.namespace_id, d.priority, d.expires_at"
        f" FROM demand_copy d{keep}"
    )
    op.drop_table("demand_copy")


def _remove_grafts(conn: sa.Connection, now: datetime) -> None:
    grafts = conn.execute(
        sa.text(
            "SELECT c.prefix_hash, c.namespace_id, n.name, pn.name AS parent_namespace"
            " FROM prefixes c JOIN prefixes p ON p.prefix_hash = c.parent_hash"
            " JOIN namespaces n ON n.id = c.namespace_id"
            " JOIN namespaces pn ON pn.id = p.namespace_id"
            " WHERE c.token_start > 0 AND p.namespace_id <> c.namespace_id"
            " ORDER BY c.prefix_hash"
        )
    ).all()
    # The namespace a chain belongs to is that of its first node, whose parent publish
    # checked to be that namespace's root: a node under another namespace's node is a graft
    # only if its chain is not its own (bob's node under alice's graft is bob's).
    first_of_chain = sa.text(
        "WITH RECURSIVE up(h, parent, ns, start) AS ("
        " SELECT prefix_hash, parent_hash, namespace_id, token_start FROM prefixes"
        " WHERE prefix_hash = :h UNION ALL"
        " SELECT p.prefix_hash, p.parent_hash, p.namespace_id, p.token_start"
        " FROM prefixes p JOIN up ON p.prefix_hash = up.parent WHERE up.start > 0)"
        " SELECT ns FROM up WHERE start = 0"
    ).bindparams(sa.bindparam("h", type_=sa.LargeBinary()))
    subtree = sa.text(
        "WITH RECURSIVE down(h) AS (SELECT :h UNION ALL"
        " SELECT p.prefix_hash FROM prefixes p JOIN down ON p.parent_hash = down.h"
        " WHERE p.namespace_id = :ns) SELECT h FROM down"
    ).bindparams(sa.bindparam("h", type_=sa.LargeBinary()))
    # Decided for every candidate before any removal (a removal breaks chains below it).
    grafts = [
        g for g in grafts if conn.execute(first_of_chain, {"h": g[0]}).scalar() not in (g[1], None)
    ]
    for graft, ns_id, ns_name, parent_ns in grafts:
        nodes = [bytes(h) for h in conn.execute(subtree, {"h": graft, "ns": ns_id}).scalars()]
        if not nodes:  # already removed under an earlier graft of the same chain
            continue
        hashes = sa.bindparam("hashes", expanding=True, type_=sa.LargeBinary())
        keys = sorted(
            set(
                conn.execute(
                    sa.text("SELECT blob_key FROM chunks WHERE prefix_hash IN :hashes").bindparams(
                        hashes
                    ),
                    {"hashes": nodes},
                ).scalars()
            )
        )
        chunks = conn.execute(
            sa.text("DELETE FROM chunks WHERE prefix_hash IN :hashes").bindparams(hashes),
            {"hashes": nodes},
        ).rowcount
        if keys:
            conn.execute(
                sa.text(
                    "DELETE FROM replicas WHERE namespace_id = :ns AND blob_key IN :keys"
                    " AND NOT EXISTS (SELECT 1 FROM chunks c JOIN prefixes p"
                    " ON p.prefix_hash = c.prefix_hash"
                    " WHERE c.blob_key = replicas.blob_key AND p.namespace_id = :ns)"
                ).bindparams(sa.bindparam("keys", expanding=True)),
                {"ns": ns_id, "keys": keys},
            )
        for table, column in (("refs", "head_hash"), ("pins", "prefix_hash")):
            conn.execute(
                sa.text(f"DELETE FROM {table} WHERE {column} IN :hashes").bindparams(hashes),
                {"hashes": nodes},
            )
        conn.execute(
            sa.text(
                "DELETE FROM demand WHERE namespace_id = :ns AND prefix_hash IN :hashes"
            ).bindparams(hashes),
            {"hashes": nodes, "ns": ns_id},
        )
        conn.execute(
            sa.text("DELETE FROM prefixes WHERE prefix_hash IN :hashes").bindparams(hashes),
            {"hashes": nodes},
        )
        conn.execute(
            sa.insert(_EVENTS).values(
                at=now,
                kind="tenancy.graft_removed",
                namespace=ns_name,
                subject=bytes(graft).hex(),
                actor="migration 0005",
                details={"nodes": len(nodes), "chunks": chunks, "extended": parent_ns},
            )
        )


def upgrade() -> None:
    """Upgrade schema."""
    conn = op.get_bind()
    now = datetime.now(UTC)
    drop_views()
    op.create_table(
        "namespace_fingerprints",
        sa.Column("namespace_id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["fingerprint"],
            ["fingerprints.hex"],
            name=op.f("fk_namespace_fingerprints_fingerprint_fingerprints"),
        ),
        sa.ForeignKeyConstraint(
            ["namespace_id"],
            ["namespaces.id"],
            name=op.f("fk_namespace_fingerprints_namespace_id_namespaces"),
        ),
        sa.PrimaryKeyConstraint(
            "namespace_id", "fingerprint", name=op.f("pk_namespace_fingerprints")
        ),
    )
    op.execute(
        "INSERT INTO namespace_fingerprints (namespace_id, fingerprint, created_at)"
        " SELECT namespace_id, fingerprint, min(created_at) FROM ("
        " SELECT p.namespace_id AS namespace_id, c.fingerprint AS fingerprint,"
        " c.created_at AS created_at"
        " FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash"
        " UNION ALL SELECT namespace_id, fingerprint, created_at FROM refs"
        ") u GROUP BY namespace_id, fingerprint"
    )

    unowned = conn.execute(
        sa.text(
            "SELECT count(*) FROM replicas r"
            " WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.blob_key = r.blob_key)"
        )
    ).scalar_one()
    op.execute("CREATE TABLE replicas_0004 AS SELECT * FROM replicas")
    op.drop_index("ix_replicas_location", table_name="replicas")
    op.drop_table("replicas")
    _replicas_table(scoped=True)
    op.execute(
        f"INSERT INTO replicas (blob_key, namespace_id, {_COLUMNS})"
        f" SELECT r.blob_key, o.namespace_id, {', '.join('r.' + c for c in _COLUMNS.split(', '))}"
        " FROM replicas_0004 r JOIN (SELECT DISTINCT c.blob_key AS blob_key,"
        " p.namespace_id AS namespace_id"
        " FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash) o"
        " ON o.blob_key = r.blob_key"
    )
    op.drop_table("replicas_0004")
    if unowned:
        conn.execute(
            sa.insert(_EVENTS).values(
                at=now,
                kind="replica.unowned_dropped",
                namespace=None,
                subject=None,
                actor="migration 0005",
                details={"replicas": int(unowned), "reason": "no chunk names the blob"},
            )
        )
    _rekey_demand(scoped=True)
    _remove_grafts(conn, now)
    create_views()


def downgrade() -> None:
    """Downgrade schema."""
    drop_views()
    op.execute("CREATE TABLE replicas_0005 AS SELECT * FROM replicas")
    op.drop_index("ix_replicas_location", table_name="replicas")
    op.drop_table("replicas")
    _replicas_table(scoped=False)
    op.execute(
        f"INSERT INTO replicas (blob_key, {_COLUMNS})"
        f" SELECT r.blob_key, {', '.join('r.' + c for c in _COLUMNS.split(', '))}"
        " FROM replicas_0005 r WHERE r.namespace_id = (SELECT min(x.namespace_id)"
        " FROM replicas_0005 x WHERE x.blob_key = r.blob_key AND x.location = r.location)"
    )
    op.drop_table("replicas_0005")
    _rekey_demand(scoped=False)
    op.drop_table("namespace_fingerprints")
    create_views(replica_namespaces=False)
