"""Domain errors of the catalog, shared by every catalog implementation (SQL and HTTP).

Callers branch on the class, never on the message:

- `CatalogInputError` (a `ValueError`): the call was malformed; nothing changed.
- `NotFoundError` (a `LookupError`): no such namespace, ref, pin, prefix or fingerprint.
- `CatalogConflictError`: a concurrent change won (a ref CAS, a GC purge); nothing changed.
- `CatalogUnavailableError` (a `ConnectionError`): the catalog could not be reached or
  refused to work for now; the call is known not to have landed, so retrying is safe.
- `OutcomeUnknownError`: the call was sent but its answer was lost; it may have landed.
  A publish is idempotent, so publishing again is safe; nothing the call named may be
  deleted on the assumption that it did not land.
"""

from __future__ import annotations


class CatalogError(Exception):
    """Base class of every error raised by `catalog` and by `catalog.remote.RemoteCatalog`."""


class CatalogInputError(CatalogError, ValueError):
    """An argument is malformed or inconsistent (named in the message); nothing was changed."""


class IdentityError(CatalogInputError):
    """An identity input (fingerprint descriptor, namespace, tokens, chunk size) is invalid."""


class PublishError(CatalogInputError):
    """A publish record is inconsistent or its parent is not catalogued; nothing was recorded."""


class MissingParentError(PublishError):
    """A record's parent prefix is not catalogued (perhaps purged since the publisher
    planned): nothing was recorded; plan again and publish the parent too."""


class NotFoundError(CatalogError, LookupError):
    """No such namespace, ref, pin, prefix or fingerprint (in this namespace)."""


class CatalogConflictError(CatalogError):
    """A concurrent change won over this call; nothing was changed."""


class RefConflictError(CatalogConflictError):
    """A compare-and-swap on a ref lost: its head was not the expected one."""


class PurgeInProgressError(CatalogConflictError):
    """A chunk this call relies on is being purged by GC: nothing was changed.

    Retry once the GC run finishes (a publisher puts the bytes again and records
    them anew; `restore.Checkpointer` does this by itself).
    """

    def __init__(self, message: str, prefixes: tuple[bytes, ...] = ()) -> None:
        super().__init__(message)
        self.prefixes = prefixes


class CatalogUnavailableError(CatalogError, ConnectionError):
    """The catalog could not be reached or is not serving now; the call did not land.

    Safe to retry (with a backoff): nothing was changed.
    """


class OutcomeUnknownError(CatalogError):
    """The call was sent but its outcome was lost (a connection dropped mid-commit or
    mid-answer): it may or may not have landed. Publishing again is safe (idempotent);
    deleting what the call named is not."""


class SchemaVersionError(CatalogError):
    """The database's schema revision is not the one this code needs (`kvc db upgrade`)."""


class AccessDeniedError(CatalogError, PermissionError):
    """The catalog refused the credentials (a `kvc serve` token); nothing was changed."""
