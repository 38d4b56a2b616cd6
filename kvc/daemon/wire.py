"""The daemon's wire: its request bodies (pydantic, extra fields refused)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

__all__ = [
    "MAX_TOKENS",
    "CheckpointRequest",
    "ConfigureRequest",
    "PrefillRequest",
    "RestoreRequest",
    "RouteRequest",
    "field_name",
]

MAX_TOKENS = 1 << 20

Token = Annotated[StrictInt, Field(ge=0, le=0xFFFFFFFF)]
Tokens = Annotated[list[Token], Field(min_length=1, max_length=MAX_TOKENS)]


class _Body(BaseModel):
    # A misspelt field is a 422 naming it, not a silently ignored option.
    model_config = ConfigDict(extra="forbid")


class ConfigureRequest(_Body):
    """`fingerprint`: a descriptor, the hex of a catalogued one, or "reference"."""

    fingerprint: dict[str, Any] | Annotated[StrictStr, Field(min_length=1, max_length=200)]
    num_pages: Annotated[StrictInt, Field(ge=1)]
    page_size: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
    prefill_tokens_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class PrefillRequest(_Body):
    """Reference-engine hook: feed `tokens` to a new route, or after the end of `route`."""

    tokens: Tokens
    route: StrictInt | None = None


class CheckpointRequest(_Body):
    route: StrictInt
    tokens: Tokens
    name: Annotated[StrictStr, Field(min_length=1, max_length=512)] | None = None
    pending: Token | None = None


class RestoreRequest(_Body):
    tokens: Tokens


class RouteRequest(_Body):
    route: StrictInt


def field_name(loc: Sequence[int | str]) -> str:
    """The body field a validation error's location names ("body" when none)."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    # Union members appear in the location (e.g. "str", "dict[str,any]"): not a field name.
    parts = [p for p in parts if p.isidentifier() or p.isdigit()]
    return ".".join(parts) or "body"
