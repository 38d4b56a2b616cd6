"""Domain errors of the catalog."""

from __future__ import annotations


class CatalogError(Exception):
    """Base class of every error raised by `catalog`."""


class IdentityError(CatalogError, ValueError):
    """An identity input (fingerprint descriptor, namespace, tokens, chunk size) is invalid."""
