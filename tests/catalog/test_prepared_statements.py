"""PostgreSQL plans the lookup's statements once per connection, not on every lookup.

psycopg prepares a statement after a few executions on one connection and forgets every
prepared statement on each ROLLBACK; a read that ended with one (what closing a
connection with an open transaction sends) kept the lookup's two statements from ever
being prepared, and planning them cost PostgreSQL six times their execution.
"""

from __future__ import annotations

import pytest

from catalog.catalog import Catalog
from tests.catalog_helpers import CS, FP, chain_records

pytestmark = pytest.mark.postgres


def test_a_lookups_statements_are_prepared_and_stay_prepared(postgres_url: str) -> None:
    with Catalog.open(postgres_url, upgrade=True, pool_size=1) as cat:
        cat.ensure_namespace("ns", CS)
        tokens = list(range(3 * CS + 10))
        cat.record_chunks(chain_records("ns", tokens))
        # The last position is pending and the chain ends mid-chunk: both the full-chunk
        # statement and the best-sibling probe run on every lookup.
        query = [*tokens[: 2 * CS + 5], 99_999]
        for _ in range(12):
            assert cat.lookup("ns", FP, query).matched_tokens == 2 * CS + 5
        with cat.db.read() as conn:  # the pool's one connection, the lookups' own
            prepared = conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements").all()
    statements = [row[0] for row in prepared]
    assert any("FROM chunks c" in s for s in statements), statements
    assert any("sibling_candidates" in s for s in statements), statements


def test_a_read_on_postgresql_sends_no_begin_or_commit(postgres_url: str) -> None:
    """Each statement of a read is its own transaction: the read costs no BEGIN and no
    COMMIT round trip, and leaves the connection idle, outside any transaction."""
    with Catalog.open(postgres_url, upgrade=True, pool_size=1) as cat:
        with cat.db.read() as conn:
            first = conn.exec_driver_sql("SELECT now()").scalar_one()
            conn.exec_driver_sql("SELECT pg_sleep(0.001)")
            second = conn.exec_driver_sql("SELECT now()").scalar_one()
            raw = conn.connection.driver_connection
            assert raw is not None
            status = raw.info.transaction_status.name
        # now() is the start of the statement's transaction: one transaction per statement.
        assert second > first
        assert status == "IDLE"
