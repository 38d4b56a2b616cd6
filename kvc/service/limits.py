"""A cap on request body bytes, enforced before anything parses the body."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 64 << 20  # far above a `max_prompt_tokens` prompt as JSON


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413, read no further than that.

    A Content-Length over the limit is refused unread; a body without one (chunked)
    is read up to the limit, then refused or handed on whole. So no request makes
    the service hold more than `max_bytes` of body, whatever the route parses.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops at Content-Length
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"the request body is larger than this service's limit of {self.max_bytes} bytes"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def again() -> Message:
        return messages.pop(0) if messages else await receive()

    return again
