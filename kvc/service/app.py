"""The catalog service's app: `create_app`, the mapping of catalog errors onto statuses, and the
guard that turns anything unexpected into a bare 500."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from catalog import Catalog
from catalog.errors import (
    AccessDeniedError,
    CatalogConflictError,
    CatalogError,
    CatalogInputError,
    CatalogUnavailableError,
    NotFoundError,
    OutcomeUnknownError,
    PurgeInProgressError,
)
from catalog.wire import NOT_FOUND, Health
from kvc.service import routes_catalog, routes_refs, routes_replicas
from kvc.service.auth import Authenticate
from kvc.service.deps import PromptLimit
from kvc.service.gate import WriteGate, write_slots
from kvc.service.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, body_caps
from kvc.service.metrics import CONTENT_TYPE_LATEST, Metrics

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"[0-9a-f]{64}")
DEFAULT_THREADS = 40  # anyio's default threadpool


class Guard:
    """ASGI middleware: an unexpected exception becomes a bare 500, logged and counted, never echoed."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
            self.metrics.after_request()
        except Exception as exc:
            self.metrics.errors.inc()
            # The type and the request line only: messages may carry values from the request.
            log.error(
                "internal error on %s %s: %s",
                scope.get("method"),
                scope.get("path"),
                exc.__class__.__name__,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if started:
                raise
            await JSONResponse({"detail": "internal error"}, status_code=500)(scope, receive, send)


def _finite(value: Any) -> Any:
    """`value` (JSON-able) with NaN and +-Inf as strings: JSON responses cannot carry them."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _refused(exc: Exception, status: int, **headers: str) -> JSONResponse:
    """A catalog error's answer: its message and its class name (`RemoteCatalog` raises that class)."""
    body = {"detail": str(exc), "error": exc.__class__.__name__}
    return JSONResponse(body, status_code=status, headers=headers or None)


# What a tenant learns when the catalog's database fails: not its URL, host or driver's
# message (those go to the service's log).
UNAVAILABLE = "catalog unavailable"
OUTCOME_UNKNOWN = (
    "the catalog's database stopped answering while committing; "
    "the change may or may not have landed"
)


def _withheld(
    request: Request, exc: Exception, status: int, detail: str, **headers: str
) -> JSONResponse:
    """A catalog failure's answer: a fixed `detail` and the class name; the message is logged
    (it names the database: `Database` keeps passwords out of its URL)."""
    log.warning("%s %s: %s: %s", request.method, request.url.path, exc.__class__.__name__, exc)
    body = {"detail": detail, "error": exc.__class__.__name__}
    return JSONResponse(body, status_code=status, headers=headers or None)


def _unreadable_body(request: Request, exc: RequestValidationError) -> str | None:
    """What makes the request body unreadable (malformed JSON, or a body not sent as JSON),
    or None when it is JSON that validation refused (422)."""
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            return f"the body is not valid JSON{': ' + str(reason) if reason else ''}"
    # FastAPI parses a body as JSON only when sent as application/json (or */*+json);
    # otherwise it hands the route's model the raw bytes, which no model accepts.
    if isinstance(exc.body, bytes | bytearray) and exc.body:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        sent_as = f"is sent as {media}" if media else "has no content type"
        return f"the body {sent_as}: send JSON (application/json)"
    return None


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Catalog errors onto statuses; the table is in docs/http-api.md. Starlette picks the
    handler of the nearest class in the exception's MRO, so subclasses come out right."""

    @app.exception_handler(RequestValidationError)
    def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        unreadable = _unreadable_body(request, exc)
        if unreadable is not None:  # 400: the body is not JSON at all (docs/http-api.md)
            return JSONResponse({"detail": unreadable}, status_code=400)
        # As FastAPI's own handler, but a NaN or Infinity in the request can be echoed.
        return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(NotFoundError)
    def on_not_found(request: Request, exc: Exception) -> JSONResponse:
        # The one body of every "no such thing": nothing tells which namespaces exist.
        return JSONResponse(NOT_FOUND, status_code=404)

    @app.exception_handler(CatalogInputError)
    def on_input(request: Request, exc: Exception) -> JSONResponse:
        return _refused(exc, 422)

    @app.exception_handler(CatalogConflictError)
    def on_conflict(request: Request, exc: Exception) -> JSONResponse:
        return _refused(exc, 409)

    @app.exception_handler(PurgeInProgressError)
    def on_purging(request: Request, exc: Exception) -> JSONResponse:
        # GC is deleting what the call names: a conflict that clears, so retry later.
        return _refused(exc, 409, **{"Retry-After": "1"})

    @app.exception_handler(CatalogUnavailableError)
    def on_unavailable(request: Request, exc: Exception) -> JSONResponse:
        metrics.unavailable.inc()
        return _withheld(request, exc, 503, UNAVAILABLE, **{"Retry-After": "1"})

    @app.exception_handler(OutcomeUnknownError)
    def on_outcome_unknown(request: Request, exc: Exception) -> JSONResponse:
        metrics.unavailable.inc()
        return _withheld(request, exc, 504, OUTCOME_UNKNOWN)

    @app.exception_handler(AccessDeniedError)
    def on_denied(request: Request, exc: Exception) -> JSONResponse:
        return _refused(exc, 401, **{"WWW-Authenticate": "Bearer"})

    @app.exception_handler(CatalogError)
    def on_catalog_error(request: Request, exc: Exception) -> JSONResponse:
        # Any other catalog error (a schema at the wrong revision): not serving for now.
        metrics.unavailable.inc()
        return _withheld(request, exc, 503, UNAVAILABLE, **{"Retry-After": "1"})


def create_app(
    catalog: Catalog,
    tokens: Mapping[str, str],
    *,
    max_prompt_tokens: int,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    threads: int | None = None,
    metrics_dir: str | None = None,
    on_close: Callable[[], None] | None = None,
) -> FastAPI:
    """The service over `catalog`; `tokens` maps each namespace to the sha256 hex of its bearer token.

    `threads`: requests handled at once (the event loop's threadpool, set when the server
    starts the app; default anyio's 40).
    `metrics_dir`: the processes of one service share their metrics there (`Metrics`).
    `on_close` runs when the server shuts the app down (its lifespan), after the last request.
    """
    hashes: dict[str, bytes] = {}
    for ns, h in tokens.items():
        if not isinstance(ns, str) or not ns:
            raise ValueError("tokens: namespace names must be non-empty strings")
        if not isinstance(h, str) or not _HEX64.fullmatch(h.lower()):
            raise ValueError(f"tokens: the hash for namespace {ns!r} is not a sha256 hex digest")
        hashes[ns] = h.lower().encode("ascii")
    if max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")
    if threads is not None and threads < 1:
        raise ValueError("threads must be >= 1")

    metrics = Metrics(metrics_dir)
    metrics.watch_journal(lambda: catalog.journal_failures)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if threads is not None:
            # The routes are plain `def`s run in this pool. With many threads at once they
            # mostly wait for the GIL and hand it to each other: fewer threads do more.
            anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield
        if on_close is not None:
            on_close()

    app = FastAPI(
        lifespan=lifespan,
        title="kvc catalog service",
        version="1",
        description="The kvc catalog over HTTP; see docs/http-api.md.",
    )
    app.state.catalog = catalog
    app.state.metrics = metrics
    app.state.prompt_limit = PromptLimit(max_prompt_tokens)
    app.state.token_hashes = hashes
    # Innermost: only an authenticated write within its size limit waits for a slot.
    app.add_middleware(
        WriteGate, slots=write_slots(catalog.db.engine.dialect.name, threads or DEFAULT_THREADS)
    )
    # Added last, so outermost: `Guard` also covers `Authenticate`.
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        per_route=body_caps(max_prompt_tokens, max_body_bytes),
    )
    app.add_middleware(Authenticate, hashes=hashes)
    app.add_middleware(Guard, metrics=metrics)
    _add_error_handlers(app, metrics)

    @app.get(
        "/healthz",
        response_model=Health,
        tags=["ops"],
        responses={503: {"description": "The catalog's database does not answer"}},
    )
    def healthz() -> Any:
        """Readiness: one round trip to the catalog's database (no auth)."""
        try:
            catalog.ping()
        except Exception as exc:
            log.warning("health check: the catalog does not answer: %s", exc.__class__.__name__)
            return JSONResponse({"detail": "catalog unavailable"}, status_code=503)
        return Health(status="ok")

    @app.get("/metrics", response_class=Response, tags=["ops"])
    def get_metrics() -> Response:
        """Prometheus counters, process-wide, no labels (no auth: they name no tenant)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(routes_catalog.router)
    app.include_router(routes_replicas.router)
    app.include_router(routes_refs.router)
    return app
