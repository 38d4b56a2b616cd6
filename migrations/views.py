"""Admin SQL views over the catalog, for operators (see docs/admin-sql.md); one definition per dialect."""

from __future__ import annotations

from alembic import op

VIEWS = (
    "v_chunks",
    "v_replica_health",
    "v_namespace_usage",
    "v_continuation_heads",
    "v_prefixes",
    "v_events",
    "v_conflicts",
)


def _sql(dialect: str, replica_namespaces: bool) -> dict[str, str]:
    if dialect == "sqlite":
        hexs = "lower(hex({}))"
        age = "((julianday('now') - julianday({})) * 86400.0)"
        jtext = "json_extract({}, '$.{}')"
    else:
        hexs = "encode({}, 'hex')"
        age = "extract(epoch from (now() - {}))"
        jtext = "({} ->> '{}')"
    h = hexs.format
    # From revision 0005 a replica row belongs to a namespace: count a chunk's own.
    own = " AND r.namespace_id = p.namespace_id" if replica_namespaces else ""
    return {
        "v_prefixes": f"""
            SELECT n.name AS namespace, {h("p.prefix_hash")} AS prefix, {h("p.parent_hash")} AS parent,
                   p.prefix_hash AS prefix_hash, p.parent_hash AS parent_hash,
                   p.token_start, p.token_count, p.token_start + p.token_count AS token_end, p.depth,
                   p.quarantined, p.quarantine_reason, p.created_at
            FROM prefixes p JOIN namespaces n ON n.id = p.namespace_id""",
        "v_chunks": f"""
            SELECT c.id AS chunk_id, n.name AS namespace, c.fingerprint, {h("c.prefix_hash")} AS prefix,
                   {h("p.parent_hash")} AS parent, p.token_start, p.token_count,
                   c.layer_lo, c.layer_hi, c.head_lo, c.head_hi, c.blob_key, c.codec,
                   c.stored_bytes, c.kv_bytes, c.state, p.quarantined, c.created_at, c.last_seen_at,
                   c.last_access_at, c.access_count,
                   (SELECT count(*) FROM replicas r WHERE r.blob_key = c.blob_key{own}) AS replicas,
                   (SELECT count(*) FROM replicas r WHERE r.blob_key = c.blob_key{own}
                      AND r.state IN ('durable', 'ready')) AS usable_replicas
            FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash
            JOIN namespaces n ON n.id = p.namespace_id""",
        "v_replica_health": f"""
            SELECT n.name AS namespace, r.blob_key, r.location, r.tier, r.state, r.size, r.etag,
                   r.checksum, r.stored_at, r.last_verified_at, r.worker,
                   {age.format("r.last_verified_at")} AS seconds_since_verified,
                   (SELECT count(*) FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash
                      WHERE c.blob_key = r.blob_key AND p.namespace_id = r.namespace_id) AS chunks
            FROM replicas r JOIN namespaces n ON n.id = r.namespace_id"""
        if replica_namespaces
        else f"""
            SELECT r.blob_key, r.location, r.tier, r.state, r.size, r.etag, r.checksum, r.stored_at,
                   r.last_verified_at, r.worker,
                   {age.format("r.last_verified_at")} AS seconds_since_verified,
                   (SELECT count(*) FROM chunks c WHERE c.blob_key = r.blob_key) AS chunks
            FROM replicas r""",
        "v_namespace_usage": """
            SELECT n.name AS namespace, c.fingerprint, count(*) AS chunks,
                   sum(c.stored_bytes) AS stored_bytes, sum(c.kv_bytes) AS kv_bytes,
                   sum(p.token_count) AS tokens
            FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash
            JOIN namespaces n ON n.id = p.namespace_id
            GROUP BY n.name, c.fingerprint""",
        "v_continuation_heads": f"""
            SELECT n.name AS namespace, r.name AS ref, r.fingerprint, {h("r.head_hash")} AS head,
                   r.head_hash AS head_hash, r.processed, r.pending_token, r.forked_from,
                   p.quarantined AS head_quarantined, r.created_at, r.updated_at
            FROM refs r JOIN namespaces n ON n.id = r.namespace_id
            JOIN prefixes p ON p.prefix_hash = r.head_hash""",
        "v_events": f"""
            SELECT e.seq, e.at, e.kind, e.namespace, e.subject, e.actor, e.details,
                   {age.format("e.at")} AS age_seconds
            FROM events e""",
        "v_conflicts": f"""
            SELECT e.seq, e.at, e.namespace, e.subject AS prefix,
                   {jtext.format("e.details", "fingerprint")} AS fingerprint,
                   {jtext.format("e.details", "kept")} AS kept_key,
                   {jtext.format("e.details", "rejected")} AS rejected_key
            FROM events e WHERE e.kind = 'conflict'""",
    }


def create_views(*, replica_namespaces: bool = True) -> None:
    """Create the views as of the newest revision (`replica_namespaces=False`: before 0005)."""
    sql = _sql(op.get_bind().dialect.name, replica_namespaces)
    for name in VIEWS:
        op.execute(f"CREATE VIEW {name} AS {sql[name]}")


def drop_views() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
