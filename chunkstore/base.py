"""The chunk store seam: a small content-addressed interface, its receipt, and key rules."""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, TypeGuard

from typing_extensions import Buffer

from chunkstore.errors import InvalidKeyError, StoreURLError

_KEY_RE = re.compile(r"[0-9a-f]{64}")

# The catalog's tiers (`catalog.models.Tier`, which this package cannot import), best first.
Tier = Literal["resident", "local", "object"]
TIERS: tuple[Tier, ...] = ("resident", "local", "object")


def parse_tier(value: object) -> Tier:
    """Return `value` if it names a tier, else raise `StoreURLError` listing the tiers."""
    for tier in TIERS:
        if value == tier:
            return tier
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise StoreURLError(f"invalid store tier {shown}: expected one of {', '.join(TIERS)}")


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC (the only clock the stores' receipts use)."""
    return datetime.now(UTC)


def is_hex_digest(value: object) -> TypeGuard[str]:
    """Whether `value` is a 64-character lowercase hex digest (a blob key, a blake3 hex)."""
    return isinstance(value, str) and _KEY_RE.fullmatch(value) is not None


def validate_key(key: object) -> str:
    """Return `key` if it is a 64-character lowercase hex digest, else raise `InvalidKeyError`.

    Keys become file names and object names; accepting only digests rules out
    path traversal and odd characters by construction.
    """
    if not is_hex_digest(key):
        shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        raise InvalidKeyError(f"invalid blob key {shown}: expected 64 lowercase hex characters")
    return key


@dataclass(frozen=True, slots=True)
class Receipt:
    """Proof from a store that a blob is durable there.

    `checksum` is `"<algorithm>:<value>"` as the store confirmed it (local: the
    blake3 of the bytes, verified against the key at put time; S3: the
    transport checksum the server computed). `etag` and `version` are set
    where the store has them.
    """

    store: str
    key: str
    size: int
    checksum: str
    stored_at: datetime
    etag: str | None = None
    version: str | None = None


@dataclass(frozen=True, slots=True)
class BlobStat:
    """Size in bytes and last modification time (UTC) of a stored blob."""

    size: int
    mtime: datetime


class ChunkStore(abc.ABC):
    """A content-addressed blob store: blobs are immutable and named by the blake3 of their bytes.

    Concurrency: `put` is safe from many threads and processes at once (one
    object results). `delete` racing a `put` of the same key may leave either
    outcome; callers (GC) guard that with a grace period.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The store's URL without credentials; replica rows refer to stores by it."""

    @property
    @abc.abstractmethod
    def tier(self) -> Tier:
        """The tier its replicas are catalogued in, as its configuration declares it
        (the `tier` URL option; per-kind defaults in docs/stores.md), never guessed."""

    @abc.abstractmethod
    def put(self, key: str, data: Buffer) -> Receipt:
        """Store `data` under `key` durably (idempotent) and return the receipt.

        Raises `ChunkIntegrityError` when `data` does not hash to `key`.
        """

    @abc.abstractmethod
    def get(self, key: str) -> Buffer:
        """Return the blob's bytes (bytes-like); raise `BlobNotFoundError` if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a blob is stored under `key`."""

    @abc.abstractmethod
    def stat(self, key: str) -> BlobStat:
        """Size and modification time; raise `BlobNotFoundError` if absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob; deleting an absent key is not an error."""

    @abc.abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over the keys of all stored blobs (never temporary or partial ones)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release resources held by the store."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
