"""Lookup: the longest restorable prefix of a prompt in a constant number of round trips (section 5)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

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
        known = self._identity(namespace, fp_hex, shard)
        if known is None:
            return miss
        (ns_id, cs), shard = known
        # Full chunks that can serve at least one position below the limit.
        n_full = min(n // cs, -(-limit // cs))
        full = prefix_hashes(namespace, tok, cs, max_chunks=n_full) if n_full else []
        with self.db.read_rows() as rows:
            found = self._chunks_for(rows, ns_id, fp_hex, shard, full)
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
                partial = self._best_sibling(rows, ns_id, fp_hex, shard, parent, q_be)
                if partial is not None:
                    used = min(partial[1], limit - matched)
                    chunks.append(_chunk_match(partial[0], used))
                    matched += used
        if chunks:
            self._access.note([c.prefix_hash for c in chunks], fp_hex, shard)
        return Match(namespace, fp_hex, shard, n, matched, tuple(chunks))

    def _identity(
        self, namespace: str, fp_hex: str, shard: Shard | None
    ) -> tuple[tuple[int, int], Shard] | None:
        """The namespace's (id, chunk size) and the shard to look up (the fingerprint's whole
        layout when none is given); None if either is not catalogued. From the caches when
        they know both (they never change once committed), else read and cached."""
        ns = self.db.known_namespace(namespace)
        fp = None if ns is None or shard is not None else self.db.known_fingerprint(fp_hex, ns[0])
        if ns is None or (shard is None and fp is None):
            with self.db.read() as conn:
                ns = self.db.namespace(conn, namespace)
                if ns is None:
                    return None
                if shard is None:
                    fp = self.db.fingerprint(conn, fp_hex, ns[0])
                    if fp is None:
                        return None
        if shard is None:
            assert fp is not None
            shard = Shard.full(fp.layout)
        return ns, shard

    def _chunks_for(
        self, rows: _Rows, ns_id: int, fp_hex: str, shard: Shard, hashes: list[bytes]
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
        found: list[Any] = []
        sqlite = self.db.engine.dialect.name == "sqlite"
        # SQLite binds one variable per hash: a prompt of more than BIND_BATCH chunks
        # takes one statement per batch (PostgreSQL binds the array as one).
        for batch in batches(hashes) if sqlite else (hashes,):
            if sqlite:
                sql = _hot_sql_sqlite(len(batch))
                params = (*batch, *ident)
            else:
                sql = _HOT_SQL_PG
                params = (batch, *ident)
            found += rows(sql, params)
        return _fold(found)

    def _best_sibling(
        self,
        rows: _Rows,
        ns_id: int,
        fp_hex: str,
        shard: Shard,
        parent: bytes,
        q_be: bytes,
    ) -> tuple[_ChunkRow, int] | None:
        """The stored child of `parent` sharing the longest leading tokens with `q_be`
        (big-endian token ids), and how many it shares; None if none shares any."""
        params = {
            "ns": ns_id,
            "fp": fp_hex,
            "layer_lo": shard.layer_lo,
            "layer_hi": shard.layer_hi,
            "head_lo": shard.head_lo,
            "head_hi": shard.head_hi,
            "parent": parent,
            "q_head": q_be[: 4 * HEAD_TOKENS],
            "q_be": q_be,
        }
        found = rows(_sibling_sql(self.db.engine.dialect.name), params)
        best: tuple[_ChunkRow, int] | None = None
        for _, row in sorted(_fold(found).items()):
            shared = _common_prefix(q_be, row[0][_SIBLING_TOKENS])
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


_ChunkRow = tuple[Any, tuple[ReplicaInfo, ...]]
_Rows = Callable[[str, Any], list[Any]]  # one snapshot's driver-SQL reads (`Database.read_rows`)


def _fold(rows: Sequence[Any]) -> dict[bytes, _ChunkRow]:
    """Chunk x replica rows (`_HOT_COLUMNS` first) folded into one entry per chunk: its
    first row, and its replicas best tier first."""
    out: dict[bytes, _ChunkRow] = {}
    get = out.get
    for r in rows:
        # Columns 5-14 are exactly a ReplicaInfo's fields (the last five NULL).
        rep = _new(ReplicaInfo, r[5:15])
        prev = get(r[0])
        if prev is None:
            out[r[0]] = (r, (rep,))
        else:
            out[r[0]] = (prev[0], _best_first((*prev[1], rep)))
    return out


def _chunk_match(row: _ChunkRow, used: int) -> ChunkMatch:
    """The plan entry of a sibling row (`_sibling_sql`'s columns)."""
    r, replicas = row
    return _new(ChunkMatch, (r[0], r[15], r[1], r[16], r[17], used, r[2], r[3], r[4], replicas))


# A chunk's columns as both statements select them: the chunk, then its replica's
# columns in ReplicaInfo's order (the five it does not need NULL).
_HOT_COLUMNS = (
    "c.prefix_hash, c.blob_key, c.codec, c.stored_bytes, c.kv_bytes,"
    " r.location, r.tier, r.state, r.size, r.worker, NULL, NULL, NULL, NULL, NULL"
)
_IDENTITY = (
    "c.fingerprint = {fp} AND c.layer_lo = {layer_lo} AND c.layer_hi = {layer_hi}"
    " AND c.head_lo = {head_lo} AND c.head_hi = {head_hi} AND c.state = 'ready'"
)
_USABLE_REPLICA = "r.state IN (" + ", ".join(f"'{s}'" for s in USABLE_STATES) + ")"
_SIBLING_TOKENS = 18  # the column of a sibling row holding its token ids

# One of the four neighbour probes of the best-sibling statement: the child of `parent`
# nearest q in token order on one side. The sibling sharing the longest prefix with q is
# q's neighbour in token order; the index orders siblings by their first HEAD_TOKENS ids
# only, so two probes find the neighbours by that head, and two more order just the
# siblings whose head equals q's by their full token ids (the rare case of siblings
# agreeing on their first HEAD_TOKENS tokens).
_PROBE = (
    "SELECT p.prefix_hash FROM prefixes p{by_parent}"
    # The namespace is checked, never searched by (`+ 0`): the index by namespace and head
    # would walk every node of the namespace to find the children of one parent (planners
    # without statistics, and SQLite's always, took it: the probe grew with the namespace).
    " WHERE p.parent_hash = {parent} AND p.namespace_id + 0 = {ns} AND NOT p.quarantined"
    " AND {side}"
    # A usable chunk of this node: its own per-row plan (`OFFSET 0`: PostgreSQL does not
    # flatten it into a join, which without statistics became a scan of every chunk of the
    # fingerprint per sibling).
    " AND EXISTS (SELECT 1 FROM chunks c JOIN replicas r ON r.blob_key = c.blob_key"
    " WHERE c.prefix_hash = p.prefix_hash AND " + _IDENTITY + " AND r.namespace_id = p.namespace_id"
    " AND " + _USABLE_REPLICA + " LIMIT 1 OFFSET 0)"
    " ORDER BY {order} LIMIT 1"
)
_SIDES = (
    ("p.tokens_head <= {q_head}", "p.tokens_head DESC"),
    ("p.tokens_head > {q_head}", "p.tokens_head ASC"),
    ("p.tokens_head = {q_head} AND p.tokens_be <= {q_be}", "p.tokens_be DESC"),
    ("p.tokens_head = {q_head} AND p.tokens_be > {q_be}", "p.tokens_be ASC"),
)


@functools.cache
def _sibling_sql(dialect: str) -> str:
    """The best-sibling statement of a lookup (one round trip), as driver SQL with named
    parameters: the four neighbour probes (`_PROBE`), then those candidates' usable chunk
    rows, replicas and token ids.

    Plain driver SQL with cached text, like the hot statement: built with SQLAlchemy Core
    it ran 15 times slower on SQLite (0.44 ms against 0.03) and cost more to execute than
    to run. The candidates (at most four) are computed once: materialized, so that no plan
    (say one made on a young table's stale statistics) re-runs the probes per chunk row,
    and on PostgreSQL handed to the final query as an array its index condition takes
    (`= ANY`), so every chunk row is reached through the identity index.
    """
    pg = dialect == "postgresql"
    names = ("fp", "layer_lo", "layer_hi", "head_lo", "head_hi", "parent", "ns", "q_head", "q_be")
    marks = {n: f"%({n})s" if pg else f":{n}" for n in names}
    by_parent = "" if pg else " INDEXED BY ix_prefixes_parent_head"
    probes = " UNION ALL ".join(
        "SELECT prefix_hash FROM ("
        + _PROBE.format(by_parent=by_parent, side=side, order=order, **marks)
        + f") t{i}"
        for i, (side, order) in enumerate(_SIDES)
    ).format(**marks)
    candidates = (
        "c.prefix_hash = ANY(ARRAY(SELECT prefix_hash FROM sibling_candidates))"
        if pg
        else "c.prefix_hash IN (SELECT prefix_hash FROM sibling_candidates)"
    )
    return (
        f"WITH sibling_candidates AS {'MATERIALIZED ' if pg else ''}({probes})"
        f" SELECT {_HOT_COLUMNS}, n.parent_hash, n.token_start, n.token_count, n.tokens_be"
        " FROM chunks c JOIN prefixes n ON n.prefix_hash = c.prefix_hash"
        " JOIN replicas r ON r.blob_key = c.blob_key"
        f" WHERE {candidates} AND {_IDENTITY.format(**marks)} AND NOT n.quarantined"
        # The candidates are the namespace's nodes (the probes check it).
        f" AND r.namespace_id = n.namespace_id AND {_USABLE_REPLICA}"
    )


_HOT_SELECT = (
    "SELECT " + _HOT_COLUMNS + " FROM chunks c JOIN replicas r ON r.blob_key = c.blob_key"
    " WHERE c.prefix_hash {hashes} AND "
    + _IDENTITY.format(fp="{p}", layer_lo="{p}", layer_hi="{p}", head_lo="{p}", head_hi="{p}")
    + " AND r.namespace_id = {p} AND "
    + _USABLE_REPLICA
    # Quarantined nodes are few: probe only their partial index (SQLite would
    # otherwise pick the primary key and read every node's row).
    + " AND NOT EXISTS (SELECT 1 FROM prefixes q{indexed}"
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
