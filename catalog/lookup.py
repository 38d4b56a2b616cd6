"""Lookup: the longest restorable prefix of a prompt in a constant number of round trips (section 5)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa

from catalog.database import batches
from catalog.errors import (
    CatalogInputError,
)
from catalog.identity import (
    Fingerprint,
    chain_root,
    fingerprint_hex,
    prefix_hashes,
    token_array,
)
from catalog.models import (
    TIERS,
    USABLE_STATES,
    ChunkMatch,
    Match,
    ReplicaInfo,
    Shard,
)
from catalog.schema import (
    HEAD_TOKENS,
    Chunk,
    Hash,
    PrefixNode,
    Replica,
)
from catalog.transactions import Database

if TYPE_CHECKING:
    from catalog.access import AccessLog

log = logging.getLogger(__name__)


class Lookups:
    """`lookup`: token-exact, partial last chunk, replicas best tier first."""

    db: Database
    _access: AccessLog

    def lookup(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        shard: Shard | None = None,
        max_tokens: int | None = None,
    ) -> Match:
        """The longest restorable prefix of `tokens` (at most len - 1) and the chunks covering it.

        Two round trips at most, whatever the prompt length: every full chunk
        of the prompt at once, then the best partial sibling where the chain
        ends (namespaces and fingerprints are cached: they never change).
        Pass tokens as a uint32 numpy array to skip converting a list.
        """
        fp_hex = fingerprint_hex(fingerprint)
        tok = token_array(tokens)  # validates, with clear errors
        root = chain_root(namespace)  # validates the namespace
        n = int(tok.size)
        limit = n - 1
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise CatalogInputError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
            limit = min(limit, max_tokens)
        miss = Match(namespace, fp_hex, shard, n)
        if limit <= 0:
            return miss
        with self.db.read() as conn:
            ns = self.db.namespace(conn, namespace)
            if ns is None:
                return miss
            cs = ns[1]
            if shard is None:
                fp = self.db.fingerprint(conn, fp_hex, ns[0])
                if fp is None:
                    return miss
                shard = Shard.full(fp.layout)
            # Full chunks that can serve at least one position below the limit.
            n_full = min(n // cs, -(-limit // cs))
            full = prefix_hashes(namespace, tok, cs, max_chunks=n_full) if n_full else []
            found = self._chunks_for(conn, ns[0], fp_hex, shard, full)
            # A full chunk's place in the tree is the prompt's own: its parent is the
            # previous hash and it starts at i * cs (the hash commits to both), so the
            # walk never reads the prefix nodes' rows.
            chunks: list[ChunkMatch] = []
            add = chunks.append
            get = found.get
            matched = 0
            parent = root
            for h in full:
                hit = get(h)
                if hit is None:
                    break
                r, reps = hit
                used = min(cs, limit - matched)
                add(_new(ChunkMatch, (h, parent, r[1], matched, cs, used, r[2], r[3], r[4], reps)))
                matched += used
                parent = h
                if used < cs:
                    break
            if matched < limit and matched % cs == 0:
                q_be = tok[matched : matched + cs].astype(">u4").tobytes()
                partial = self._best_sibling(conn, ns[0], fp_hex, shard, parent, q_be)
                if partial is not None:
                    used = min(partial[1], limit - matched)
                    chunks.append(_chunk_match(partial[0], used))
                    matched += used
        if chunks:
            self._access.note([c.prefix_hash for c in chunks], fp_hex, shard)
        return Match(namespace, fp_hex, shard, n, matched, tuple(chunks))

    def _chunks_for(
        self, conn: sa.Connection, ns_id: int, fp_hex: str, shard: Shard, hashes: list[bytes]
    ) -> dict[bytes, _ChunkRow]:
        """The usable chunks of these prefix hashes: their row and namespace `ns_id`'s
        replicas, best tier first.

        One statement: the chunk rows by their identity index, their usable replicas,
        and a probe into the (small) partial index of quarantined nodes; the prefix
        nodes' own rows are not read. Plain driver SQL with cached text: with
        hundreds of hashes, building and expanding a SQLAlchemy IN costs more than
        the query. PostgreSQL takes the hashes as one bytea[] parameter (one
        statement text, which psycopg prepares after a few uses).
        """
        if not hashes:
            return {}
        ident = (fp_hex, shard.layer_lo, shard.layer_hi, shard.head_lo, shard.head_hi, ns_id)
        params: tuple[Any, ...]
        rows: list[Any] = []
        # SQLite binds one variable per hash: a prompt of more than BIND_BATCH chunks
        # takes one statement per batch (PostgreSQL binds the array as one).
        for batch in batches(hashes) if conn.dialect.name == "sqlite" else (hashes,):
            if conn.dialect.name == "sqlite":
                sql = _hot_sql_sqlite(len(batch))
                params = (*batch, *ident)
            else:
                sql = _HOT_SQL_PG
                params = (batch, *ident)
            # Raw driver rows: a Row per chunk x replica costs more than the row itself.
            result = conn.exec_driver_sql(sql, params)
            try:
                rows += result.cursor.fetchall()
            finally:
                result.close()
        out: dict[bytes, _ChunkRow] = {}
        get = out.get
        for r in rows:
            # Columns 5-14 are exactly a ReplicaInfo's fields (the last five NULL).
            rep = _new(ReplicaInfo, r[5:])
            prev = get(r[0])
            if prev is None:
                out[r[0]] = (r, (rep,))
            else:
                out[r[0]] = (prev[0], _best_first((*prev[1], rep)))
        return out

    def _best_sibling(
        self,
        conn: sa.Connection,
        ns_id: int,
        fp_hex: str,
        shard: Shard,
        parent: bytes,
        q_be: bytes,
    ) -> tuple[_ChunkRow, int] | None:
        rows = conn.execute(
            _sibling_statement(conn.dialect.name),
            {
                "ns": ns_id,
                "fp": fp_hex,
                "layer_lo": shard.layer_lo,
                "layer_hi": shard.layer_hi,
                "head_lo": shard.head_lo,
                "head_hi": shard.head_hi,
                "parent": parent,
                "q_head": q_be[: 4 * HEAD_TOKENS],
                "q_be": q_be,
            },
        ).all()
        tokens_of = {r.prefix_hash: r.tokens_be for r in rows}
        best: tuple[_ChunkRow, int] | None = None
        for h, row in sorted(_group(rows).items()):
            shared = _common_prefix(q_be, tokens_of[h])
            if shared > (best[1] if best else 0):
                best = (row, shared)
        return best


def _common_prefix(a: bytes, b: bytes) -> int:
    """Number of leading uint32 tokens shared by two big-endian token strings."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=">u4", count=n)
    y = np.frombuffer(b, dtype=">u4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@functools.cache
def _sibling_statement(dialect: str) -> Any:
    """The best-sibling probe of a lookup, built once per dialect with bind parameters.

    The sibling sharing the longest prefix with q is q's neighbour in token order.
    The index orders siblings by their first HEAD_TOKENS ids only: two probes find
    the neighbours by that head, and two more order just the siblings whose head
    equals q's by their full token ids (the rare case of siblings agreeing on their
    first HEAD_TOKENS tokens). All in one statement, so one round trip. Built once
    (not per lookup) so SQLAlchemy's compiled cache and psycopg's prepared
    statements apply: building it cost more than running it.

    Every chunk row is reached through the identity index with its prefix hash, whatever
    the statistics say. PostgreSQL planning a young or fast-growing catalog (no
    statistics yet: every condition looks like it matches one row) otherwise turned the
    `usable` check into a scan of all the fingerprint's chunks per sibling and the final
    join into a scan of all of them against the candidates: 0.5 ms became 600-800 ms
    with 1,250 chunks. So the check keeps its own per-row plan (`OFFSET 0`: PostgreSQL
    does not flatten it into a join) and, on PostgreSQL, the candidates are handed to the
    final query as an array that its index condition takes (`= ANY`).
    """
    fp = sa.bindparam("fp", type_=sa.String())
    layer_lo, layer_hi, head_lo, head_hi = (
        sa.bindparam(name, type_=sa.Integer())
        for name in ("layer_lo", "layer_hi", "head_lo", "head_hi")
    )
    q_head = sa.bindparam("q_head", type_=Hash)
    q_be = sa.bindparam("q_be", type_=sa.LargeBinary())
    ns = sa.bindparam("ns", type_=sa.Integer())
    ident = (
        Chunk.fingerprint == fp,
        Chunk.layer_lo == layer_lo,
        Chunk.layer_hi == layer_hi,
        Chunk.head_lo == head_lo,
        Chunk.head_hi == head_hi,
        Chunk.state == "ready",
    )
    usable = (
        sa.select(sa.literal(1))
        .select_from(Chunk)
        .join(Replica, Replica.blob_key == Chunk.blob_key)
        .where(
            Chunk.prefix_hash == PrefixNode.prefix_hash,
            *ident,
            # The outer node's namespace (already `ns`), not the parameter: a constant here
            # would let PostgreSQL start from the namespace's replica rows instead.
            Replica.namespace_id == PrefixNode.namespace_id,
            Replica.state.in_(USABLE_STATES),
        )
        .offset(0)
        .exists()
    )
    base = sa.select(PrefixNode.prefix_hash).where(
        PrefixNode.parent_hash == sa.bindparam("parent", type_=Hash),
        PrefixNode.namespace_id == ns,
        PrefixNode.quarantined.is_(False),
        usable,
    )
    head, full = PrefixNode.tokens_head, PrefixNode.tokens_be
    same = base.where(head == q_head)
    probes = [
        base.where(head <= q_head).order_by(head.desc()).limit(1),
        base.where(head > q_head).order_by(head.asc()).limit(1),
        same.where(full <= q_be).order_by(full.desc()).limit(1),
        same.where(full > q_be).order_by(full.asc()).limit(1),
    ]
    # At most four candidates, computed once: materialized, so that no plan (say one
    # made on a young table's stale statistics) re-runs the probes per chunk row.
    candidates = (
        sa.union_all(*(sa.select(p.subquery()) for p in probes))
        .cte("sibling_candidates")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    return (
        sa.select(
            Chunk.prefix_hash,
            PrefixNode.parent_hash,
            Chunk.blob_key,
            PrefixNode.token_start,
            PrefixNode.token_count,
            Chunk.codec,
            Chunk.stored_bytes,
            Chunk.kv_bytes,
            Replica.location,
            Replica.tier,
            Replica.state,
            Replica.size,
            Replica.worker,
            PrefixNode.tokens_be,
        )
        .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
        .join(Replica, Replica.blob_key == Chunk.blob_key)
        .where(
            *ident,
            # The candidates are `ns`'s nodes (the probes filter on it); naming the
            # constant again here would let PostgreSQL start from the namespace's rows.
            PrefixNode.quarantined.is_(False),
            Replica.namespace_id == PrefixNode.namespace_id,
            Replica.state.in_(USABLE_STATES),
            Chunk.prefix_hash
            == sa.func.any(sa.func.array(sa.select(candidates.c.prefix_hash).scalar_subquery()))
            if dialect == "postgresql"
            else Chunk.prefix_hash.in_(sa.select(candidates.c.prefix_hash)),
        )
    )


_ChunkRow = tuple[Any, tuple[ReplicaInfo, ...]]


def _chunk_match(row: _ChunkRow, used: int) -> ChunkMatch:
    r, replicas = row
    return ChunkMatch(
        r.prefix_hash,
        r.parent_hash,
        r.blob_key,
        r.token_start,
        r.token_count,
        used,
        r.codec,
        r.stored_bytes,
        r.kv_bytes,
        replicas,
    )


def _group(rows: Sequence[Any]) -> dict[bytes, _ChunkRow]:
    """Fold chunk x replica rows into one entry per chunk, replicas best tier first."""
    out: dict[bytes, _ChunkRow] = {}
    for r in rows:
        h = r.prefix_hash
        rep = ReplicaInfo(r.location, r.tier, r.state, r.size, r.worker)
        prev = out.get(h)
        if prev is None:
            out[h] = (r, (rep,))
        else:
            out[h] = (prev[0], _best_first((*prev[1], rep)))
    return out


_HOT_SELECT = (
    "SELECT c.prefix_hash, c.blob_key, c.codec, c.stored_bytes, c.kv_bytes,"
    " r.location, r.tier, r.state, r.size, r.worker, NULL, NULL, NULL, NULL, NULL"
    " FROM chunks c JOIN replicas r ON r.blob_key = c.blob_key"
    " WHERE c.prefix_hash {hashes}"
    " AND c.fingerprint = {p} AND c.layer_lo = {p} AND c.layer_hi = {p}"
    " AND c.head_lo = {p} AND c.head_hi = {p} AND c.state = 'ready'"
    " AND r.namespace_id = {p} AND r.state IN ('durable', 'ready')"
    # Quarantined nodes are few: probe only their partial index (SQLite would
    # otherwise pick the primary key and read every node's row).
    " AND NOT EXISTS (SELECT 1 FROM prefixes q{indexed}"
    " WHERE q.prefix_hash = c.prefix_hash AND q.quarantined)"
)
_HOT_SQL_PG = _HOT_SELECT.format(hashes="= ANY(%s)", p="%s", indexed="")


@functools.lru_cache(maxsize=64)
def _hot_sql_sqlite(n: int) -> str:
    """The hot statement for n hashes (SQLite has no array parameter); the text is cached."""
    return _HOT_SELECT.format(
        hashes=f"IN ({','.join('?' * n)})", p="?", indexed=" INDEXED BY ix_prefixes_quarantined"
    )


def _best_first(replicas: tuple[ReplicaInfo, ...]) -> tuple[ReplicaInfo, ...]:
    """Replicas best tier first, then by location (a stable, documented order)."""
    return tuple(sorted(replicas, key=lambda x: (_TIER_RANK.get(x.tier, 99), x.location)))


# NamedTuples built without their Python-level __new__ (a lookup builds hundreds).
_new = tuple.__new__


_TIER_RANK = {t: i for i, t in enumerate(TIERS)}
