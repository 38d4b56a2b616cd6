"""Time as the catalog records it: timezone-aware UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, in UTC, timezone-aware (every time the catalog stores or compares)."""
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """`value` as aware UTC; a naive value (SQLite returns those) is taken to be UTC already."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
