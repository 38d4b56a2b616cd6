"""Facts: identity, the relational catalog of chunks, prefixes, replicas, refs and history."""

from __future__ import annotations

from catalog.catalog import Catalog
from catalog.errors import (
    CatalogError,
    IdentityError,
    MissingParentError,
    NotFoundError,
    PublishError,
    PurgeInProgressError,
    RefConflictError,
    SchemaVersionError,
)
from catalog.identity import (
    DTYPES,
    AttentionLayout,
    Fingerprint,
    canonical_json,
    chain_hash,
    chain_root,
    fingerprint_hex,
    prefix_hashes,
)
from catalog.models import ChunkMatch, ChunkRecord, Match, ReplicaReceipt, Shard

__all__ = [
    "DTYPES",
    "AttentionLayout",
    "Catalog",
    "CatalogError",
    "ChunkMatch",
    "ChunkRecord",
    "Fingerprint",
    "IdentityError",
    "Match",
    "MissingParentError",
    "NotFoundError",
    "PublishError",
    "PurgeInProgressError",
    "RefConflictError",
    "ReplicaReceipt",
    "SchemaVersionError",
    "Shard",
    "canonical_json",
    "chain_hash",
    "chain_root",
    "fingerprint_hex",
    "prefix_hashes",
]
