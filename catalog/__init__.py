"""Facts: identity, the relational catalog of chunks, prefixes, replicas, refs and history."""

from __future__ import annotations

from catalog.errors import CatalogError, IdentityError
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

__all__ = [
    "DTYPES",
    "AttentionLayout",
    "CatalogError",
    "Fingerprint",
    "IdentityError",
    "canonical_json",
    "chain_hash",
    "chain_root",
    "fingerprint_hex",
    "prefix_hashes",
]
