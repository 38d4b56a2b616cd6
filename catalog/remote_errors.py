"""How the kvc service's refusals become `catalog.errors` again in `RemoteCatalog`: the status and name tables."""

from __future__ import annotations

from typing import NoReturn

import httpx

import catalog.errors
from catalog.errors import (
    AccessDeniedError,
    CatalogConflictError,
    CatalogError,
    CatalogInputError,
    CatalogUnavailableError,
    NotFoundError,
    OutcomeUnknownError,
)

__all__ = ["raise_error"]

# The service names the class of a catalog error in its body (`error`); these are
# raised again by `RemoteCatalog`. A name not in the table falls back to the status's class.
_BY_NAME: dict[str, type[CatalogError]] = {
    name: cls
    for name, cls in vars(catalog.errors).items()
    if isinstance(cls, type) and issubclass(cls, CatalogError)
}
# The class of each 4xx status, when the body names none (or one that is not a subclass).
_BY_STATUS: dict[int, type[CatalogError]] = {
    400: CatalogInputError,
    401: AccessDeniedError,
    403: AccessDeniedError,
    404: NotFoundError,
    409: CatalogConflictError,
    413: CatalogInputError,
    422: CatalogInputError,
}


def _detail(resp: httpx.Response) -> tuple[str, str | None]:
    try:
        body = resp.json()
    except ValueError:
        return resp.reason_phrase or f"HTTP {resp.status_code}", None
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}", None
    detail = body.get("detail")
    if isinstance(detail, list):  # request validation: name the fields, never echo the input
        parts = []
        for err in detail:
            if isinstance(err, dict):
                loc = ".".join(str(x) for x in err.get("loc", ()))
                parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return "; ".join(parts) or "invalid request", None
    error = body.get("error")
    return str(detail), error if isinstance(error, str) else None


def raise_error(
    resp: httpx.Response,
    method: str,
    path: str,
    *,
    write: bool,
    default_error: type[CatalogError] | None,
) -> NoReturn:
    """Raise the `catalog.errors` class the SQL catalog would for the service's refusal `resp`
    of `method path` (the class the body names, if the status allows it); `write` says
    whether a lost outcome is unknown, `default_error` refines a 4xx's class."""
    message, error = _detail(resp)
    code = resp.status_code
    base: type[CatalogError]
    if code == 404:
        raise NotFoundError(f"not found in namespace: {method} {path}")
    if 400 <= code < 500:
        base = _BY_STATUS.get(code, CatalogInputError)
        if default_error is not None and issubclass(default_error, base):
            base = default_error
    elif code in (500, 504) and write:
        base = OutcomeUnknownError
    else:  # 502, 503, another 5xx on a read, or a status no kvc service answers
        base = CatalogUnavailableError
    named = _BY_NAME.get(error or "")
    cls = named if named is not None and issubclass(named, base) else base
    if cls in (OutcomeUnknownError, CatalogUnavailableError) and error is None:
        message = f"the kvc service answered {code} to {method} {path}: {message}"
    if code == 401 and cls is AccessDeniedError and error is None:
        message = f"the kvc service refused the token: {message}"
    raise cls(message)
