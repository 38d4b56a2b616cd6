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
_DOCUMENT_SEGMENT = re.compile(r"[A-Za-z0-9_.=-]+")
MAX_DOCUMENT_NAME = 512
# Where documents live in a store, apart from the blobs (a directory or key prefix).
DOCUMENTS_DIR = "meta"

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


def validate_document_name(name: object) -> str:
    """Return `name` if it is a document name, else raise `InvalidKeyError`.

    A name is `/`-separated segments of letters, digits and `_ . = -`, none of
    them `.` or `..`, at most 512 characters: it becomes a relative path or an
    object key, so nothing can climb out of the documents area.
    """
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_DOCUMENT_NAME
        or any(
            seg in (".", "..") or _DOCUMENT_SEGMENT.fullmatch(seg) is None
            for seg in name.split("/")
        )
    ):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise InvalidKeyError(
            f"invalid document name {shown}: `/`-separated segments of [A-Za-z0-9_.=-]"
        )
    return name


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

    def put_hashed(self, key: str, data: Buffer) -> Receipt:
        """`put` for a caller that has just computed `key` as the blake3 of these very bytes
        (and holds them unchanged until this returns): a store may skip hashing them again.

        The default is `put`; the local and S3 stores skip their content-address check,
        one pass over the bytes (a checkpoint hashes every record as it builds it).
        """
        return self.put(key, data)

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

    # -- documents: small named records that describe the store's contents ---------------

    @abc.abstractmethod
    def put_document(self, name: str, data: bytes) -> bool:
        """Store `data` under `name` durably unless a document is there; True if this call did.

        Documents are immutable (the first write wins; callers give each record
        its own name) and live apart from blobs: `keys()` never lists them and GC
        never deletes them. A reader sees a whole document or none.
        Raises `InvalidKeyError` for a bad name, `StoreWriteError` /
        `StoreUnavailableError` as `put` does.
        """

    @abc.abstractmethod
    def get_document(self, name: str) -> bytes:
        """The document's bytes; `BlobNotFoundError` if there is none."""

    @abc.abstractmethod
    def documents(self, prefix: str = "") -> Iterator[str]:
        """Names of the stored documents that start with `prefix`, in name order."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release resources held by the store."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
