"""The S3 store's error mapping: botocore failures onto `chunkstore.errors`, by whether a write landed."""

from __future__ import annotations

from botocore.exceptions import (
    ClientError,
    FlexibleChecksumError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
)

from chunkstore.errors import (
    BlobNotFoundError,
    ChunkIntegrityError,
    ChunkStoreError,
    StoreUnavailableError,
    StoreWriteError,
)
from chunkstore.s3_helpers import http_status

NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# Raised by a response body while it streams: outside botocore's retries.
STREAM_ERRORS = (ReadTimeoutError, IncompleteReadError, ResponseStreamingError)
# Nothing was sent at all: a put failing this way certainly did not land.
NOT_SENT_ERRORS = (NoCredentialsError, PartialCredentialsError, ProfileNotFound)

WRITE_OPS = ("put", "multipart put")


def map_error(
    store: str, op: str, key: str | None, exc: Exception, attempts: int
) -> ChunkStoreError:
    """The domain error for `op` (of blob or document `key`) on store `store` failing with `exc`
    after `attempts` attempts.

    A missing object is `BlobNotFoundError`; a write refused with a 4xx (not 408
    or 429), or failing before anything was sent, is `StoreWriteError` (did not
    land); everything else is `StoreUnavailableError` (for a write: outcome
    unknown).
    """
    what = (
        (f"{op} of {key}" if key.startswith("document ") else f"{op} of blob {key}") if key else op
    )
    tried = f"after {attempts} attempt(s) (retried {attempts - 1} times)"
    writing = op in WRITE_OPS
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "?"))
        status = http_status(exc)
        message = str(exc.response.get("Error", {}).get("Message", "")).strip()
        detail = f"{code} (HTTP {status}){': ' + message if message else ''}"
        if status == 404 and code in NOT_FOUND_CODES:
            return BlobNotFoundError(f"{store}: no {what.split(' of ', 1)[-1]}")
        if writing and 400 <= status < 500 and status not in (408, 429):
            return StoreWriteError(f"{store}: {what} was rejected, did not land: {detail}")
        outcome = "; outcome unknown" if writing else ""
        return StoreUnavailableError(f"{store}: {what} failed {tried}: {detail}{outcome}")
    if isinstance(exc, NOT_SENT_ERRORS):
        cls = StoreWriteError if writing else StoreUnavailableError
        return cls(f"{store}: {what} failed before sending: {type(exc).__name__}: {exc}")
    outcome = "; outcome unknown" if writing else ""
    return StoreUnavailableError(
        f"{store}: {what} failed {tried}: {type(exc).__name__}: {exc}{outcome}"
    )


def checksum_mismatch(store: str, key: str, exc: FlexibleChecksumError) -> ChunkIntegrityError:
    """A body failing the checksum the server sent with it, as the store's integrity error."""
    # The same evidence as bytes failing their digest (flipped in transit or
    # at rest), so callers apply the same policy: read again, then condemn.
    # Left as botocore's error it escaped every caller's handling.
    return ChunkIntegrityError(
        f"{store}: blob {key} does not match the checksum the server sent with it: {exc}"
    )
