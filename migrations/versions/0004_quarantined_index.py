"""prefixes: partial index of the quarantined nodes, for the lookup's walk

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 16:00:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_index(
        "ix_prefixes_quarantined",
        "prefixes",
        ["prefix_hash"],
        unique=False,
        sqlite_where=sa.text("quarantined"),
        postgresql_where=sa.text("quarantined"),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_prefixes_quarantined", table_name="prefixes")
