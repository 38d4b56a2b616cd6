"""Request bodies parsed and validated in a worker thread, never on the event loop."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.to_thread
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


def parse_body(field: Any, raw: bytes) -> Any:
    """The route's body model from `raw` JSON, or the parsed JSON when it is not a valid one.

    Run in a worker thread: a body of a million token ids takes a CPU-second to parse
    and validate, and on the event loop that second would stall every other request
    of the process (`/metrics` and `/healthz` included)."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": e.msg},
                }
            ],
            body=e.doc,
        ) from None
    except Exception as e:  # not UTF-8, nested too deep: as FastAPI answers those
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    value, errors = field.validate(data, {}, loc=("body",))
    # An invalid body goes to FastAPI as parsed JSON: it validates it again with the
    # route's other parameters, so a 401 or 404 still comes before a 422.
    return data if errors else value


def _is_json(request: Request) -> bool:
    """Whether FastAPI would parse this body as JSON (it hands other bodies over as bytes)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class ThreadParsedRoute(APIRoute):
    """A route whose JSON body is parsed and validated in the threadpool.

    FastAPI parses a body on the event loop, also for a plain `def` route. This one does
    it in a worker thread first and hands FastAPI the validated model as the parsed JSON
    (`Request.json()`'s cache), which FastAPI's own validation then accepts as it is.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or getattr(self, "_embed_body_fields", False):
            return handler

        async def parsed_in_a_thread(request: Request) -> Response:
            if _is_json(request):
                raw = await request.body()
                if raw:
                    model = await anyio.to_thread.run_sync(parse_body, field, raw)
                    request._json = model  # what `await request.json()` answers
            return await handler(request)

        return parsed_in_a_thread
