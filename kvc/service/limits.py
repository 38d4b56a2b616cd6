"""A cap on request body bytes, enforced before anything parses the body."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from catalog.identity import MAX_TOKEN_ID
from catalog.wire import API_ROOT, KnownRequest, LookupRequest, ShardModel

DEFAULT_MAX_BODY_BYTES = 64 << 20  # any call; lookups and `known` get less (`body_caps`)

# The largest JSON element of a list, with its separator: a token id has at most 10
# digits (MAX_TOKEN_ID), a prefix hash 64 hex digits in quotes; ", " as Python's json.
TOKEN_BYTES = len(str(MAX_TOKEN_ID)) + len(", ")
HASH_BYTES = 64 + 2 + len(", ")
_LARGEST = 2**63 - 1
_SHARD = ShardModel(layer_lo=_LARGEST, layer_hi=_LARGEST, head_lo=_LARGEST, head_hi=_LARGEST)
# Everything of a lookup or `known` body but its list, at the largest values it may hold,
# and room for white space between the fields.
_ENVELOPE_SLACK = 1024
LOOKUP_ENVELOPE = _ENVELOPE_SLACK + len(
    LookupRequest(fingerprint="f" * 64, tokens=[0], shard=_SHARD, max_tokens=_LARGEST)
    .model_dump_json()
    .encode()
)
KNOWN_ENVELOPE = _ENVELOPE_SLACK + len(
    KnownRequest(fingerprint="f" * 64, prefix_hashes=[], shard=_SHARD).model_dump_json().encode()
)


def body_caps(max_prompt_tokens: int, max_body_bytes: int) -> dict[str, int]:
    """The byte cap of a POST to each namespace route whose body size the token limit bounds,
    by the route's last path segment: a lookup of `max_prompt_tokens` token ids and a
    `known` of as many prefix hashes (its limit) are the largest bodies those routes accept.
    `max_body_bytes` caps them too, and every other call (a publish's records carry
    receipts and descriptors besides their tokens)."""
    return {
        "lookup": min(max_body_bytes, LOOKUP_ENVELOPE + max_prompt_tokens * TOKEN_BYTES),
        "known": min(max_body_bytes, KNOWN_ENVELOPE + max_prompt_tokens * HASH_BYTES),
        "with-tokens": min(max_body_bytes, LOOKUP_ENVELOPE + max_prompt_tokens * TOKEN_BYTES),
    }


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413, read no further than that.

    A Content-Length over the limit is refused unread; a body without one (chunked)
    is read up to the limit, then refused or handed on whole. So no request makes
    the service hold more than `max_bytes` of body, whatever the route parses.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        per_route: dict[str, int] | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        self.app = app
        self.max_bytes = max_bytes
        self.per_route = per_route or {}

    def limit(self, scope: Scope) -> int:
        """The cap of this request: its route's (`body_caps`), else `max_bytes`."""
        path: str = scope.get("path", "")
        if self.per_route and scope.get("method") == "POST" and path.startswith(API_ROOT):
            parts = path[len(API_ROOT) :].split("/")
            if len(parts) == 2:
                return self.per_route.get(parts[1], self.max_bytes)
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limit(scope)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit():
            if int(length) > cap:
                await self._refuse(scope, receive, send, cap)
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
            if len(body) > cap:
                await self._refuse(scope, receive, send, cap)
                return
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, cap: int) -> None:
        detail = f"the request body is larger than this call's limit of {cap} bytes"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def again() -> Message:
        return messages.pop(0) if messages else await receive()

    return again
