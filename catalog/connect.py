"""A catalog by URL, for processes configured with strings (engine connectors): a SQL database or a `kvc serve` service."""

from __future__ import annotations

import os

from catalog.base import CatalogAPI
from catalog.catalog import Catalog
from catalog.errors import CatalogInputError

TOKEN_ENV = "KVC_SERVICE_TOKEN"


def connect(url: str, *, token: str | None = None, namespace: str = "default") -> CatalogAPI:
    """`http://` or `https://`: the `kvc serve` service there (`RemoteCatalog`), whose bearer
    token is `token` or else `$KVC_SERVICE_TOKEN`; anything else: the SQLite or PostgreSQL
    database (its schema must be current: `kvc init` or `kvc db upgrade` creates it)."""
    if not isinstance(url, str) or not url.strip():
        raise CatalogInputError("the catalog URL is empty")
    if url.startswith(("http://", "https://")):
        token = token or os.environ.get(TOKEN_ENV)
        if not token:
            raise CatalogInputError(
                f"catalog {url} is a kvc service: give its bearer token "
                f"(the 'token' setting or {TOKEN_ENV})"
            )
        from catalog.remote import RemoteCatalog

        return RemoteCatalog(url, token, namespace=namespace)
    return Catalog.open(url)
