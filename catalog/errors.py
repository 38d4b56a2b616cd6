"""Domain errors of the catalog."""

from __future__ import annotations


class CatalogError(Exception):
    """Base class of every error raised by `catalog`."""


class IdentityError(CatalogError, ValueError):
    """An identity input (fingerprint descriptor, namespace, tokens, chunk size) is invalid."""


class SchemaVersionError(CatalogError):
    """The database's schema revision is not the one this code needs (`kvc db upgrade`)."""


class PublishError(CatalogError, ValueError):
    """A publish record is inconsistent or its parent is not catalogued; nothing was recorded."""


class MissingParentError(PublishError):
    """A record's parent prefix is not catalogued (perhaps purged since the publisher
    planned): nothing was recorded; plan again and publish the parent too."""


class RefConflictError(CatalogError):
    """A compare-and-swap on a ref lost: its head was not the expected one."""


class NotFoundError(CatalogError, LookupError):
    """No such namespace, ref, prefix or fingerprint (in this namespace)."""


class PurgeInProgressError(CatalogError):
    """A chunk this call relies on is being purged by GC: nothing was changed.

    Retry once the GC run finishes (a publisher puts the bytes again and records
    them anew; `restore.Checkpointer` does this by itself).
    """

    def __init__(self, message: str, prefixes: tuple[bytes, ...] = ()) -> None:
        super().__init__(message)
        self.prefixes = prefixes
