"""Who may call the service: bearer tokens kept as sha256 hashes, one per namespace."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from catalog.wire import API_ROOT, NOT_FOUND

MISSING_TOKEN = "missing bearer token"
INVALID_TOKEN = "invalid bearer token"


def hash_token(token: str) -> str:
    """What a tokens file stores for `token`: the hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def namespaces_of(hashes: Mapping[str, bytes], token: str) -> set[str]:
    """The namespaces whose token `token` is: compared with every hash, so timing says nothing of which."""
    presented = hash_token(token).encode("ascii")
    return {ns for ns, h in hashes.items() if hmac.compare_digest(presented, h)}


def not_found() -> HTTPException:
    return HTTPException(status_code=404, detail=NOT_FOUND["detail"])


class Authenticate:
    """ASGI middleware: a namespace call without a namespace's bearer token is a 401, body unread.

    FastAPI reads and parses the body before it runs the dependencies, `authorize`
    among them: without this, a call with no token and a broken body got a 400 or
    a 422 echoing the body. `authorize` still decides between the namespace and 404.
    """

    def __init__(self, app: ASGIApp, hashes: Mapping[str, bytes]) -> None:
        self.app = app
        self.hashes = hashes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_ROOT):
            authorization = Headers(scope=scope).get("authorization")
            scheme, token = get_authorization_scheme_param(authorization)
            matches: set[str] = set()
            if scheme.lower() != "bearer" or not token:
                problem: str | None = MISSING_TOKEN
            else:
                matches = namespaces_of(self.hashes, token)
                problem = None if matches else INVALID_TOKEN
            if problem is None:
                # For `authorize`: the token is compared once per call.
                scope.setdefault("state", {})["token_namespaces"] = matches
            else:
                response = JSONResponse(
                    {"detail": problem}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


_bearer = HTTPBearer(auto_error=False, description="The namespace's token")


async def authorize(
    request: Request,
    namespace: str,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The path's namespace, if the bearer token is its token (401 without one, 404 for another's)."""
    # `Authenticate` compared the token and refused calls without one; `credentials`
    # is here so that the OpenAPI document declares the bearer scheme.
    matches: set[str] = getattr(request.state, "token_namespaces", set())
    if namespace in matches:
        return namespace
    if matches:
        raise not_found()  # another tenant's token: this namespace does not exist for it
    raise HTTPException(
        status_code=401, detail=INVALID_TOKEN, headers={"WWW-Authenticate": "Bearer"}
    )


Ns = Annotated[str, Depends(authorize)]
"""A route parameter: the namespace of the path, authorized for the call's token."""
