"""The S3 store's stateless helpers: response fields and times, checksums, body reads, parallel jobs, its name."""

from __future__ import annotations

import base64
import hashlib
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from botocore.exceptions import ClientError, IncompleteReadError
from typing_extensions import Buffer

from chunkstore.base import utcnow

_T = TypeVar("_T")

MiB = 1024 * 1024
CONTENT_TYPE = "application/octet-stream"


def utc(dt: datetime) -> datetime:
    return dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)


def clean_etag(raw: str | None) -> str | None:
    return raw.strip('"') if raw else None


def object_version(raw: str | None) -> str | None:
    # "null" is what S3 calls the version of an object in an unversioned bucket.
    return raw if raw and raw != "null" else None


def sha256_b64(data: Buffer) -> tuple[str, bytes]:
    digest = hashlib.sha256(data).digest()
    return base64.b64encode(digest).decode("ascii"), digest


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def server_time(resp: Mapping[str, Any]) -> datetime:
    # The server's clock, the one LastModified (and so GC) goes by.
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        try:
            return utc(parsedate_to_datetime(date))
        except (TypeError, ValueError):
            pass
    return utcnow()


def total_size(resp: Mapping[str, Any]) -> int:
    content_range = resp.get("ContentRange")  # "bytes 0-99/12345"
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return int(resp["ContentLength"])  # the server ignored Range and sent it all


def read_into(body: Any, target: memoryview) -> None:
    offset = 0
    for chunk in body.iter_chunks(MiB):
        end = offset + len(chunk)
        if end > len(target):
            raise IncompleteReadError(actual_bytes=end, expected_bytes=len(target))
        target[offset:end] = chunk
        offset = end
    if offset != len(target):
        raise IncompleteReadError(actual_bytes=offset, expected_bytes=len(target))


def run_all(pool: ThreadPoolExecutor, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
    """Run `jobs` on `pool`; on the first failure cancel what has not started, wait, and raise it."""
    futures: list[Future[_T]] = [pool.submit(job) for job in jobs]
    wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f.done() and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()
        wait(futures)  # let in-flight jobs finish before the caller cleans up
        exc = failed.exception()
        assert exc is not None
        raise exc
    return [f.result() for f in futures]


def store_name(bucket: str, prefix: str, endpoint_url: str | None, region: str | None) -> str:
    """`s3://bucket/prefix?endpoint_url=..&region=..`: only what says which store it is."""
    identity = {k: v for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v}
    query = urllib.parse.urlencode(sorted(identity.items()), safe=":/")
    path = f"/{urllib.parse.quote(prefix)}" if prefix else ""
    return f"s3://{bucket}{path}" + (f"?{query}" if query else "")
