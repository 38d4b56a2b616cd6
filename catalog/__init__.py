"""Facts: identity, the relational catalog of chunks, prefixes, replicas, refs and history."""

from __future__ import annotations

from catalog.base import CatalogAPI
from catalog.catalog import Catalog
from catalog.errors import (
    AccessDeniedError,
    CatalogConflictError,
    CatalogError,
    CatalogInputError,
    CatalogUnavailableError,
    IdentityError,
    MissingParentError,
    NotFoundError,
    OutcomeUnknownError,
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
    "AccessDeniedError",
    "AttentionLayout",
    "Catalog",
    "CatalogAPI",
    "CatalogConflictError",
    "CatalogError",
    "CatalogInputError",
    "CatalogUnavailableError",
    "ChunkMatch",
    "ChunkRecord",
    "Fingerprint",
    "IdentityError",
    "Match",
    "MissingParentError",
    "NotFoundError",
    "OutcomeUnknownError",
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
