"""Time as the catalog records it: timezone-aware UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, in UTC, timezone-aware (every time the catalog stores or compares)."""
    return datetime.now(UTC)
