"""Bytes: the self-describing blob record, its codecs, and content-addressed stores."""

from __future__ import annotations

from chunkstore.base import BlobStat, ChunkStore, Receipt, validate_key
from chunkstore.errors import (
    BlobNotFoundError,
    ChunkFormatError,
    ChunkIntegrityError,
    ChunkStoreError,
    InvalidKeyError,
    StoreUnavailableError,
    StoreURLError,
    StoreWriteError,
)
from chunkstore.registry import open_store

__all__ = [
    "BlobNotFoundError",
    "BlobStat",
    "ChunkFormatError",
    "ChunkIntegrityError",
    "ChunkStore",
    "ChunkStoreError",
    "InvalidKeyError",
    "Receipt",
    "StoreURLError",
    "StoreUnavailableError",
    "StoreWriteError",
    "open_store",
    "validate_key",
]
