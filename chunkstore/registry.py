"""Opening a chunk store from its URL: `file:///abs/dir` or `s3://bucket/prefix?options`."""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.base import ChunkStore, parse_tier
from chunkstore.errors import StoreURLError

if TYPE_CHECKING:
    import boto3

_SIZE_RE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib)", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
}
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,62}")
_REGION_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def _size(value: str) -> int:
    m = _SIZE_RE.fullmatch(value.strip())
    if m is None:
        raise ValueError("expected a byte count such as 8388608 or 8MiB")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def _seconds(value: str) -> float:
    x = float(value)
    if not x >= 0:  # also rejects NaN
        raise ValueError("must be a non-negative number of seconds")
    return x


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


def _region(value: str) -> str:
    if _REGION_RE.fullmatch(value) is None:
        raise ValueError("expected a region name such as us-east-1")
    return value


def _endpoint_url(value: str) -> str:
    parts = urllib.parse.urlsplit(value)
    # Checked before anything echoes the value: it must not leak a secret.
    if "@" in parts.netloc:
        raise StoreURLError(
            "the endpoint_url option must not contain credentials; S3 credentials come "
            "from the AWS credential chain (environment, profile, instance role)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected http(s)://host[:port]")
    if parts.query or parts.fragment:
        raise ValueError("expected no query or fragment")
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc.lower(), parts.path.rstrip("/"), "", "")
    )


@dataclass(frozen=True)
class _Option:
    parse: Callable[[str], object]
    kind: type | tuple[type, ...]


# Only endpoint_url and region say *which* store it is (they go into
# `store.name`, see `S3Store`); the other options tune it.
_S3_OPTIONS: Mapping[str, _Option] = {
    "endpoint_url": _Option(_endpoint_url, str),
    "region": _Option(_region, str),
    "retry_mode": _Option(_choice("standard", "adaptive"), str),
    "max_attempts": _Option(_positive_int, int),
    "connect_timeout": _Option(_seconds, (int, float)),
    "read_timeout": _Option(_seconds, (int, float)),
    "multipart_threshold": _Option(_size, int),
    "part_size": _Option(_size, int),
    "max_concurrency": _Option(_positive_int, int),
    "addressing_style": _Option(_choice("path", "virtual", "auto"), str),
    "refresh_after_s": _Option(_seconds, (int, float)),
    "tier": _Option(parse_tier, str),
}
_FILE_OPTIONS: Mapping[str, _Option] = {
    "refresh_after_s": _Option(_seconds, (int, float)),
    "temp_grace_s": _Option(_seconds, (int, float)),
    "tier": _Option(parse_tier, str),
}


def _options(
    scheme: str, spec: Mapping[str, _Option], query: str, overrides: Mapping[str, object]
) -> dict[str, object]:
    """Parse and check the URL's query options, then apply keyword overrides."""
    raw: dict[str, str] = {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StoreURLError(f"malformed query string in {scheme}: store URL") from None
    for name, text in pairs:
        # Never echo the value of an unknown option: it might be a secret.
        if name not in spec:
            raise StoreURLError(
                f"unknown option {name!r} in {scheme}: store URL (known: {', '.join(sorted(spec))})"
            )
        if name in raw:
            raise StoreURLError(f"option {name!r} is given twice in {scheme}: store URL")
        raw[name] = text
    options: dict[str, object] = {}
    merged: list[tuple[str, object]] = [*raw.items(), *overrides.items()]
    for name, value in merged:
        if name not in spec:
            raise StoreURLError(
                f"unknown option {name!r} for a {scheme}: store (known: {', '.join(sorted(spec))})"
            )
        option = spec[name]
        if isinstance(value, str):
            if not value:
                raise StoreURLError(f"option {name!r} of {scheme}: store URL has an empty value")
            try:
                options[name] = option.parse(value)
            except (TypeError, ValueError) as exc:
                if isinstance(exc, StoreURLError):
                    raise
                raise StoreURLError(f"invalid value {value!r} for option {name!r}: {exc}") from None
        elif isinstance(value, option.kind) and not isinstance(value, bool):
            options[name] = value
        else:
            raise StoreURLError(
                f"option {name!r} must be a {option.kind}, got {type(value).__name__}"
            )
    return options


def _open_file(
    parts: urllib.parse.SplitResult, overrides: Mapping[str, object]
) -> Callable[[], ChunkStore]:
    from chunkstore.local import LocalStore

    if parts.netloc:
        raise StoreURLError(
            f"file: store URL names a host ({parts.netloc!r}); use file:///absolute/path"
        )
    path = urllib.parse.unquote(parts.path)
    if "\x00" in path:
        raise StoreURLError("file: store URL path contains a NUL byte")
    if not path.startswith("/"):
        raise StoreURLError(f"file: store URL needs an absolute path, got {path!r}")
    options = _options("file", _FILE_OPTIONS, parts.query, overrides)
    return functools.partial(LocalStore, path, **options)  # type: ignore[arg-type]


def _open_s3(
    parts: urllib.parse.SplitResult,
    overrides: Mapping[str, object],
    session: boto3.session.Session | None,
) -> Callable[[], ChunkStore]:
    from chunkstore.s3 import S3Store

    bucket = parts.netloc
    if not bucket:
        raise StoreURLError("s3: store URL has an empty bucket name; use s3://bucket/prefix")
    if _BUCKET_RE.fullmatch(bucket) is None:
        raise StoreURLError(
            f"invalid bucket name {bucket!r} in s3: store URL "
            "(3-63 lowercase letters, digits, dots, hyphens)"
        )
    prefix = "/".join(p for p in urllib.parse.unquote(parts.path).split("/") if p)
    options = _options("s3", _S3_OPTIONS, parts.query, overrides)
    return functools.partial(S3Store, bucket, prefix, session=session, **options)  # type: ignore[arg-type]


def open_store(
    url: str, *, session: boto3.session.Session | None = None, **options: object
) -> ChunkStore:
    """Open the chunk store that `url` names.

    - `file:///abs/dir[?refresh_after_s=..&temp_grace_s=..&tier=..]`: a `LocalStore`.
    - `s3://bucket[/prefix]?endpoint_url=..&region=..&<tuning>`: an `S3Store`;
      tuning options are `retry_mode` (standard|adaptive), `max_attempts`,
      `connect_timeout`, `read_timeout`, `multipart_threshold`, `part_size`,
      `max_concurrency`, `addressing_style` (path|virtual|auto),
      `refresh_after_s`. Credentials come from the AWS chain or `session`.

    Both take `tier` (resident|local|object): the tier the store's replicas
    are catalogued in. A directory defaults to `local`, S3 to `object`; a
    directory on a network mount or a MinIO next to the GPU can say otherwise.

    Keyword `options` (same names, typed values or strings) override the
    URL's. A URL with user-info (credentials), an unknown scheme or option,
    or a malformed value raises `StoreURLError`, whose message never repeats
    a credential or an unknown option's value.
    """
    return _parse(url, session, options)()


def check_store_url(url: str) -> None:
    """Raise `StoreURLError` naming what is wrong if `url` is not a store URL `open_store`
    accepts; opens, creates and connects to nothing."""
    _parse(url, None, {})


def _parse(
    url: str, session: boto3.session.Session | None, options: Mapping[str, object]
) -> Callable[[], ChunkStore]:
    """The store `url` names, validated, as a constructor not yet called."""
    if not isinstance(url, str):
        raise StoreURLError(f"store URL must be a string, got {type(url).__name__}")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise StoreURLError("malformed store URL") from None
    # Checked before any message quotes a part of the URL.
    if "@" in parts.netloc:
        raise StoreURLError(
            f"{parts.scheme or 'store'} URL must not contain credentials (user-info before '@'); "
            "S3 credentials come from the AWS credential chain (environment, profile, instance role)"
        )
    if parts.fragment:
        raise StoreURLError("store URL must not have a #fragment")
    if parts.scheme == "file":
        if session is not None:
            raise StoreURLError("a boto3 session only applies to s3: stores")
        return _open_file(parts, options)
    if parts.scheme == "s3":
        return _open_s3(parts, options, session)
    if not parts.scheme:
        shown = f" {url!r}" if "@" not in url else ""
        raise StoreURLError(
            f"store URL{shown} has no scheme; use file:///absolute/path or s3://bucket/prefix"
        )
    raise StoreURLError(f"unknown store URL scheme {parts.scheme!r} (known: file, s3)")
