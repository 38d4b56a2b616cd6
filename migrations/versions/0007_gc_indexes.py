"""replicas and chunks: indexes for GC's resume and its check of missing replicas

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 22:00:00.000000

At ten million chunks (issue 29) three queries every GC run makes read a whole table: the
chunks an interrupted GC left `purging`, the replicas it left `deleting`, and the replicas
in `missing` state at a store. The location index gains the state, and two partial indexes
hold only the rows an interrupted GC left (usually none).

No index on replicas (namespace_id, state): SQLite, without statistics, chose it over the
primary key for the lookup's replica query, reading a namespace's every replica per chunk.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_index("ix_replicas_location_state", "replicas", ["location", "state"], unique=False)
    op.drop_index("ix_replicas_location", table_name="replicas")
    op.create_index(
        "ix_chunks_purging",
        "chunks",
        ["id"],
        unique=False,
        sqlite_where=sa.text("state = 'purging'"),
        postgresql_where=sa.text("state = 'purging'"),
    )
    op.create_index(
        "ix_replicas_deleting",
        "replicas",
        ["blob_key", "location"],
        unique=False,
        sqlite_where=sa.text("state = 'deleting'"),
        postgresql_where=sa.text("state = 'deleting'"),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_replicas_deleting", table_name="replicas")
    op.drop_index("ix_chunks_purging", table_name="chunks")
    op.create_index("ix_replicas_location", "replicas", ["location"], unique=False)
    op.drop_index("ix_replicas_location_state", table_name="replicas")
