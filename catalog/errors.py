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


class RefConflictError(CatalogError):
    """A compare-and-swap on a ref lost: its head was not the expected one."""


class NotFoundError(CatalogError, LookupError):
    """No such namespace, ref, prefix or fingerprint (in this namespace)."""
