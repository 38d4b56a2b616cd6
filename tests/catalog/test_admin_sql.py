"""Every query in docs/admin-sql.md runs on SQLite and PostgreSQL and answers something real."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from tests.catalog_helpers import CS, FP, chain_records, publish

DOC = Path(__file__).resolve().parents[2] / "docs" / "admin-sql.md"
QUERIES = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
# Report 10, chunks with no usable replica, and the view filter it replaced.
NO_USABLE_REPLICA = next(q for q in QUERIES if "FROM v_chunks v" in q and "NOT EXISTS" in q)
BY_VIEW_COUNT = "SELECT namespace, blob_key FROM v_chunks WHERE usable_replicas = 0"


def test_the_doc_has_the_promised_queries() -> None:
    assert len(QUERIES) >= 8


@pytest.fixture(params=["sqlite", "postgres"])
def populated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Catalog, str]]:
    url = (
        f"sqlite:///{tmp_path / 'c.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    cat = Catalog.open(url, upgrade=True)
    cat.ensure_namespace("default", CS)
    system = list(range(1, 9))
    a = publish(cat, "default", [*system, 10, 11, 12, 13, 14])
    b = publish(cat, "default", [*system, 20, 21, 22])
    cat.create_ref("default", "main", FP, a[-1].prefix_hash)
    cat.create_ref("default", "other", FP, b[-1].prefix_hash)
    cat.fork_ref("default", "main", "fork")
    cat.pin("default", "launch", a[1].prefix_hash, ttl_s=3600, reason="launch week")
    cat.pin("default", "old", a[0].prefix_hash, ttl_s=3600)
    with cat.engine.begin() as conn:  # the second has expired: the query must leave it out
        conn.execute(sa.text("UPDATE pins SET expires_at = created_at WHERE name = 'old'"))
    conflict = chain_records("default", system[:4], salt="x")
    cat.record_chunks(conflict)
    cat.quarantine("default", b[-1].prefix_hash, "bad bytes")
    with cat.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE replicas SET last_verified_at = NULL WHERE blob_key = :k"),
            {"k": a[-1].blob_key},
        )
        conn.execute(
            sa.text("UPDATE replicas SET state = 'missing' WHERE blob_key = :k"),
            {"k": a[0].blob_key},
        )
    yield cat, a[0].prefix_hash.hex()[:4]
    cat.close()


@pytest.mark.parametrize("index", range(len(QUERIES)))
def test_admin_query_runs_and_answers(populated: tuple[Catalog, str], index: int) -> None:
    cat, prefix4 = populated
    sql = QUERIES[index].replace("'ab12%'", f"'{prefix4}%'").strip().rstrip(";")
    with cat.engine.connect() as conn:
        rows = conn.execute(sa.text(sql)).all()
    assert rows, f"query {index + 1} returned nothing on populated data:\n{sql}"
    if QUERIES[index] == NO_USABLE_REPLICA:
        with cat.engine.connect() as conn:
            expected = conn.execute(sa.text(BY_VIEW_COUNT)).all()
        assert sorted((r.namespace, r.blob_key) for r in rows) == sorted(map(tuple, expected))
    if "FROM v_pins" in sql:
        assert [(r.pin, r.token_end) for r in rows] == [("launch", 8)]


@pytest.mark.postgres
def test_the_report_of_chunks_without_a_usable_replica_reads_the_replicas_once(
    postgres_url: str,
) -> None:
    """Report 10 filters with an anti-join, not with a per-chunk count of replicas: filtering
    on `v_chunks.usable_replicas` runs a subquery for every chunk of the catalog (155 s at
    10 million chunks, 16x its 1M time); the report's filter must hold no subplan."""
    with Catalog.open(postgres_url, upgrade=True) as cat, cat.engine.connect() as conn:
        plan = [
            r[0] for r in conn.exec_driver_sql("EXPLAIN " + NO_USABLE_REPLICA.strip().rstrip(";"))
        ]
        old = [r[0] for r in conn.exec_driver_sql("EXPLAIN " + BY_VIEW_COUNT)]
    assert any("Filter" in line and "SubPlan" in line for line in old)  # what this test catches
    assert not any("Filter" in line and "SubPlan" in line for line in plan), "\n".join(plan)
    assert any("Anti" in line for line in plan), "\n".join(plan)
