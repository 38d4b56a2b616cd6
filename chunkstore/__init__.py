"""Bytes: the self-describing blob record, its codecs, and content-addressed stores."""

from __future__ import annotations

from chunkstore.base import TIERS, BlobStat, ChunkStore, Receipt, Tier, parse_tier, validate_key
from chunkstore.errors import (
    BlobNotFoundError,
    ChunkFormatError,
    ChunkIntegrityError,
    ChunkLayoutError,
    ChunkStoreError,
    InvalidKeyError,
    StoreUnavailableError,
    StoreURLError,
    StoreWriteError,
)
from chunkstore.registry import check_store_url, open_store

__all__ = [
    "TIERS",
    "BlobNotFoundError",
    "BlobStat",
    "ChunkFormatError",
    "ChunkIntegrityError",
    "ChunkLayoutError",
    "ChunkStore",
    "ChunkStoreError",
    "InvalidKeyError",
    "Receipt",
    "StoreURLError",
    "StoreUnavailableError",
    "StoreWriteError",
    "Tier",
    "check_store_url",
    "open_store",
    "parse_tier",
    "validate_key",
]
