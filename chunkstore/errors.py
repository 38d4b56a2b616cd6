"""Domain errors of the chunk store: what went wrong with bytes, and whether they landed."""

from __future__ import annotations


class ChunkStoreError(Exception):
    """Base class of every error raised by `chunkstore`."""


class ChunkFormatError(ChunkStoreError, ValueError):
    """The bytes are not a well-formed kvc blob record (truncated, garbage, unknown version)."""


class ChunkIntegrityError(ChunkStoreError, ValueError):
    """The bytes are well formed but do not match their digest or what was expected of them."""


class ChunkLayoutError(ChunkIntegrityError):
    """A record declares a shape or dtype other than the layout expected of it.

    Raised from the header alone, before any payload is decoded or allocated:
    a small record may declare gigabytes (a zstd frame of RLE blocks expands
    32768x), so what it declares is checked against what the reader knows first.
    """


class InvalidKeyError(ChunkStoreError, ValueError):
    """A blob key is not a 64-character lowercase hex blake3 digest."""


class StoreURLError(ChunkStoreError, ValueError):
    """A store URL is malformed, has an unknown scheme or option, or carries credentials."""


class BlobNotFoundError(ChunkStoreError, FileNotFoundError):
    """The store has no blob under this key."""


class StoreWriteError(ChunkStoreError, OSError):
    """A put did not land: nothing is visible under the key; safe to retry or clean up."""


class StoreUnavailableError(ChunkStoreError, ConnectionError):
    """The store could not be reached or kept failing after retries.

    For a put, the outcome is unknown: the blob may or may not be stored, so
    callers must not catalogue it and must not delete it either.
    """
