"""prefixes: index (namespace, tokens_head), to find a node by its own tokens whatever its parent

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 04:00:00.000000

SGLang's page keys already commit to their whole prefix, so its HiCache backend finds a
stored page from its key alone (`prefixes_with_tokens`), without the keys before it.
"""

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_index(
        "ix_prefixes_namespace_head", "prefixes", ["namespace_id", "tokens_head"], unique=False
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_prefixes_namespace_head", table_name="prefixes")
