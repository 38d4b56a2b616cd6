"""What every router shares: the app's catalog and metrics as dependencies, and the refusals
each route declares in the OpenAPI document.

The dependencies here and in `auth` are `async def` although they never await: FastAPI runs
a plain `def` dependency in its threadpool, one thread hand-off each, per request."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import HTTPException

from catalog import Catalog
from catalog.wire import ErrorModel, InvalidRequestModel
from kvc.service.metrics import Metrics


async def _catalog(request: Request) -> Catalog:
    catalog: Catalog = request.app.state.catalog
    return catalog


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


class PromptLimit:
    """Refuses (413) more tokens than the service's `max_prompt_tokens`."""

    def __init__(self, max_prompt_tokens: int) -> None:
        self.max_prompt_tokens = max_prompt_tokens

    def check(self, n: int) -> None:
        if n > self.max_prompt_tokens:
            raise HTTPException(
                status_code=413,
                detail=f"{n} tokens exceed this service's limit of {self.max_prompt_tokens} tokens",
            )


async def _limit(request: Request) -> PromptLimit:
    limit: PromptLimit = request.app.state.prompt_limit
    return limit


Cat = Annotated[Catalog, Depends(_catalog)]
Counters = Annotated[Metrics, Depends(_metrics)]
Limit = Annotated[PromptLimit, Depends(_limit)]


def _refusal(description: str, model: Any = ErrorModel, **more: Any) -> dict[str, Any]:
    return {"model": model, "description": description, **more}


# What each status means on this API, declared in the OpenAPI document for the
# routes that can answer it (schemathesis holds the service to that document).
_REFUSALS: dict[int, dict[str, Any]] = {
    400: _refusal("The body is not JSON: malformed, or not sent as application/json"),
    401: _refusal(
        "No bearer token, or one of no namespace",
        headers={"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}},
    ),
    404: _refusal("Nothing of that name in this namespace, or the token is another namespace's"),
    409: _refusal(
        "A ref moved or exists already, or GC is purging what the call names (`Retry-After`)",
        headers={"Retry-After": {"schema": {"type": "string"}, "required": False}},
    ),
    413: _refusal("More tokens than this service's limit, or a body over its byte limit"),
    422: _refusal(
        "Invalid input: each field named by `loc`, or the catalog's refusal with its `error`",
        model=InvalidRequestModel | ErrorModel,
    ),
}


def refusals(*statuses: int, body: bool = True) -> dict[int | str, dict[str, Any]]:
    """The refusals of a namespace route: 401, 404 and 422; with a body 400 (not JSON) and
    413 (over the byte limit, `BodyLimit`); and `statuses`."""
    codes = sorted({401, 404, 422, *statuses, *((400, 413) if body else ())})
    return {code: _REFUSALS[code] for code in codes}
