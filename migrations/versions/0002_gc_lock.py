"""gc lock: a named lease table

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 18:30:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import catalog.schema

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "locks",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("acquired_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", catalog.schema.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_locks")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("locks")
