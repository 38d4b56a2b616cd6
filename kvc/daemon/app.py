"""The daemon's HTTP face: `create_daemon_app`, its routes, the guard that answers only the
daemon's own clients, and the mapping of the core's refusals onto statuses."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from kvc import __version__
from kvc.daemon.core import Daemon
from kvc.daemon.errors import (
    DaemonConflictError,
    DaemonError,
    DaemonInputError,
    DaemonInternalError,
    DaemonNotFoundError,
    DaemonUnavailableError,
    PoolFullError,
)
from kvc.daemon.wire import (
    CheckpointRequest,
    ConfigureRequest,
    PrefillRequest,
    RestoreRequest,
    RouteRequest,
    field_name,
)

__all__ = ["create_daemon_app"]

log = logging.getLogger(__name__)

# The status of each refusal of the core (docs/daemon.md, "Status codes").
_STATUSES: dict[type[DaemonError], int] = {
    DaemonInputError: 422,
    DaemonNotFoundError: 404,
    DaemonConflictError: 409,
    PoolFullError: 507,
    DaemonUnavailableError: 503,
    DaemonInternalError: 500,
}
_STATUS_OF_KIND = {kind.__name__: status for kind, status in _STATUSES.items()}


def _status(exc: DaemonError) -> int:
    return next((_STATUSES[k] for k in type(exc).__mro__ if k in _STATUSES), 500)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_JSON_TYPES = ("application/json",)


def _host_name(name: str) -> str:
    name = name.strip().lower()
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


class _OwnOrigin:
    """Which Host headers and Origins are the daemon's own.

    The daemon has no credentials: anything that can reach its port can drive it. A web
    page the operator visits can reach loopback too, by a cross-site form post or fetch
    (it carries an `Origin`), or by DNS rebinding (a name of the attacker's that resolves
    to 127.0.0.1: the request's `Host` is that name). So a request is answered only when
    its `Host` is one of the daemon's names and its `Origin`, if any, is the daemon's own;
    a POST with a body must say it is JSON (a browser cannot send that cross-site without
    a preflight, which the daemon never grants)."""

    def __init__(self, host: str, port: int | None, extra: Sequence[str]) -> None:
        self.names = {_host_name(n) for n in (*LOOPBACK_NAMES, host, *extra) if n.strip()}
        self.names.discard("[::]")
        self.names.discard("0.0.0.0")  # a wildcard bind is no name a client may use
        self.port = port

    def _ours(self, authority: str, default_port: int) -> bool:
        authority = authority.strip().lower()
        if authority.startswith("["):  # [v6]:port
            name, _, rest = authority.partition("]")
            name += "]"
            if rest and not rest.startswith(":"):
                return False
            port_text = rest[1:]
        else:
            name, _, port_text = authority.partition(":")
        if name not in self.names:
            return False
        if self.port is None:
            return True
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            return False
        return port == self.port

    def refusal(self, method: str, headers: Any) -> str | None:
        host = headers.get("host")
        if host is None or not self._ours(host, 80):
            return (
                "this daemon does not answer to that Host header (allowed: loopback names and "
                "its bind address; add others with --allowed-host / KVC_DAEMON_ALLOWED_HOSTS)"
            )
        origin = headers.get("origin")
        if origin is not None:
            scheme, sep, rest = origin.partition("://")
            if not sep or scheme.lower() != "http" or not self._ours(rest.rstrip("/"), 80):
                return "cross-origin requests are refused: the Origin is not this daemon's own"
        if method == "POST":
            has_body = headers.get("transfer-encoding") is not None or (
                headers.get("content-length") not in (None, "0")
            )
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if has_body and not (ctype in _JSON_TYPES or ctype.endswith("+json")):
                return "a POST body must be JSON: send Content-Type: application/json"
        return None


def create_daemon_app(
    daemon: Daemon,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    allowed_hosts: Sequence[str] = (),
) -> FastAPI:
    """The daemon's HTTP API (see docs/daemon.md); serve it on loopback.

    `host` and `port`: where it is served. Only requests whose `Host` is a loopback name,
    `host` or one of `allowed_hosts` (with `port`, when given) are answered, and only
    from no web origin or the daemon's own; anything else is a 403 (a 415 for a POST body
    that is not declared JSON)."""
    app = FastAPI(
        title="kvc daemon",
        version=__version__,
        summary="Checkpoint and restore a page pool's routes through the kvc catalog.",
    )
    own = _OwnOrigin(host, port, allowed_hosts)

    @app.middleware("http")
    async def _own_origin_only(request: Request, call_next: Any) -> Response:
        why = own.refusal(request.method, request.headers)
        if why is not None:
            status = 415 if why.startswith("a POST body") else 403
            log.warning("refused %s %s: %s", request.method, request.url.path, why)
            return JSONResponse({"error": why}, status_code=status)
        response: Response = await call_next(request)
        return response

    @app.exception_handler(DaemonError)
    async def _daemon_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DaemonError)
        body: dict[str, Any] = {"error": exc.message}
        if exc.field is not None:
            body["field"] = exc.field
        return JSONResponse(body, status_code=_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems: list[str] = []
        fields: list[str] = []
        for e in exc.errors():
            name = field_name(e.get("loc", ()))
            if e.get("type") == "json_invalid":
                name = "body"
            if name not in fields:
                fields.append(name)
            # The message only: echoing the input could repeat a whole prompt.
            problems.append(f"{name}: {e.get('msg', 'invalid')}")
        return JSONResponse(
            {"error": "invalid request: " + "; ".join(problems[:5]), "fields": fields},
            status_code=422,
        )

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        stats = daemon.stats()
        return JSONResponse(
            {"ok": True, "worker": daemon.worker_id, "configured": stats["configured"]}
        )

    @app.get("/v1/stats")
    def stats() -> JSONResponse:
        doc = daemon.stats()
        # Over HTTP a past refusal is told by the status it was answered with.
        doc["last_errors"] = [
            {
                "at": e["at"],
                "op": e["op"],
                "status": _STATUS_OF_KIND.get(e["kind"], 500),
                "error": e["error"],
            }
            for e in doc["last_errors"]
        ]
        return JSONResponse(doc)

    @app.post("/v1/configure")
    def configure(body: ConfigureRequest) -> JSONResponse:
        return JSONResponse(
            daemon.configure(
                body.fingerprint, body.num_pages, body.page_size, body.prefill_tokens_per_s
            )
        )

    @app.post("/v1/prefill")
    def prefill(body: PrefillRequest) -> JSONResponse:
        return JSONResponse(daemon.prefill(body.tokens, body.route))

    @app.post("/v1/checkpoint")
    def checkpoint(body: CheckpointRequest) -> JSONResponse:
        return JSONResponse(daemon.checkpoint(body.route, body.tokens, body.name, body.pending))

    @app.post("/v1/restore", response_model=None)
    def restore(body: RestoreRequest) -> Response:
        result = daemon.restore(body.tokens)
        if result is None:
            return Response(status_code=204)
        return JSONResponse(result)

    @app.post("/v1/release")
    def release(body: RouteRequest) -> JSONResponse:
        return JSONResponse(daemon.release(body.route))

    @app.post("/v1/clear")
    def clear() -> JSONResponse:
        return JSONResponse(daemon.clear())

    @app.post("/v1/refresh")
    def refresh() -> JSONResponse:
        return JSONResponse(daemon.refresh())

    return app
