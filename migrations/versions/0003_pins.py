"""pins: named, optionally expiring GC roots, and the v_pins admin view

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 22:20:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import catalog.schema

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _v_pins(dialect: str) -> str:
    if dialect == "sqlite":
        h = "lower(hex(p.prefix_hash))"
        live = "(p.expires_at IS NULL OR p.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))"
    else:
        h = "encode(p.prefix_hash, 'hex')"
        live = "(p.expires_at IS NULL OR p.expires_at > now())"
    return f"""
        SELECT n.name AS namespace, p.name AS pin, {h} AS prefix, p.prefix_hash AS prefix_hash,
               q.token_start + q.token_count AS token_end, p.reason, p.created_by,
               p.created_at, p.expires_at, {live} AS live
        FROM pins p JOIN namespaces n ON n.id = p.namespace_id
        LEFT JOIN prefixes q ON q.prefix_hash = p.prefix_hash"""


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "pins",
        sa.Column("namespace_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("prefix_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("reason", sa.String(length=1024), nullable=True),
        sa.Column("created_by", sa.String(length=255), nullable=True),
        sa.Column("created_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", catalog.schema.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["namespace_id"], ["namespaces.id"], name=op.f("fk_pins_namespace_id_namespaces")
        ),
        sa.PrimaryKeyConstraint("namespace_id", "name", name=op.f("pk_pins")),
    )
    op.create_index("ix_pins_prefix", "pins", ["prefix_hash"], unique=False)
    op.execute(f"CREATE VIEW v_pins AS {_v_pins(op.get_bind().dialect.name)}")


def downgrade() -> None:
    """Downgrade schema."""
    op.execute("DROP VIEW IF EXISTS v_pins")
    op.drop_index("ix_pins_prefix", table_name="pins")
    op.drop_table("pins")
