"""The S3-compatible chunk store: conditional puts, multipart uploads, ranged parallel gets (boto3).

The multipart upload is in `chunkstore.s3_multipart`, the error mapping in `chunkstore.s3_errors`,
stateless helpers in `chunkstore.s3_helpers`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
from typing_extensions import Buffer

from chunkstore.base import (
    DOCUMENTS_DIR,
    BlobStat,
    ChunkStore,
    Receipt,
    Tier,
    parse_tier,
    utcnow,
    validate_document_name,
    validate_key,
)
from chunkstore.errors import (
    BlobNotFoundError,
    ChunkIntegrityError,
    ChunkStoreError,
    StoreUnavailableError,
    StoreURLError,
)
from chunkstore.local import check_content_address
from chunkstore.record import blake3_hex
from chunkstore.s3_errors import STREAM_ERRORS, checksum_mismatch, map_error
from chunkstore.s3_helpers import (
    CONTENT_TYPE,
    MiB,
    clean_etag,
    http_status,
    object_version,
    read_into,
    run_all,
    server_time,
    sha256_b64,
    store_name,
    total_size,
    utc,
)
from chunkstore.s3_multipart import put_multipart

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_REFRESH_AFTER_S = 900.0

RetryMode = Literal["standard", "adaptive"]
AddressingStyle = Literal["path", "virtual", "auto"]


class S3Store(ChunkStore):
    """Blobs as objects `<prefix>/<key>` in an S3-compatible bucket.

    The key is already a uniformly random digest, so no extra sharding level
    is needed for S3's per-prefix request-rate partitioning. Only objects
    whose name below the prefix is a valid key are blobs; in-progress
    multipart uploads are invisible to `keys()` and `get()`.

    Puts are conditional (`If-None-Match: *`) with a SHA-256 transport
    checksum that the server verifies; both SeaweedFS and moto accept SHA-256
    (CRC32C would need the optional awscrt dependency in botocore).
    Credentials come from boto3's standard chain (or `session`), never from
    the store URL. `client` is the boto3 client, exposed so tests can hook
    its events. Blobs above `multipart_threshold` are uploaded in parts and
    fetched with parallel ranged GETs on a pool of `max_concurrency` threads.

    A 412 (already stored, or our own earlier attempt whose answer was lost)
    is confirmed with HEAD: a size (or single-part SHA-256) mismatch raises
    `ChunkIntegrityError`; an object with no whole-content SHA-256 to compare
    (uploaded in parts, or without a checksum) is read and its blake3 compared
    with the key first. A wrong object is refused rather than overwritten, since the evidence of
    whatever wrote it is worth keeping; an object older than
    `refresh_after_s` is refreshed with `touch` (GC grace counts from it).

    Errors: a put rejected with a 4xx, or a multipart put failing before its
    completion, raises `StoreWriteError` (did not land); a put failing after
    the retries with 5xx, timeouts or connection errors raises
    `StoreUnavailableError` (outcome unknown). Reads raise
    `BlobNotFoundError` for a missing key, `ChunkIntegrityError` when the
    body fails a checksum the server sent with it (botocore checks one when
    a GET answers with the whole object), and `StoreUnavailableError`
    otherwise. `max_attempts` is the total number of attempts per request,
    first one included (AWS config's meaning), with botocore's `retry_mode`
    backoff; messages say how many attempts were made.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        retry_mode: RetryMode = "standard",
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = 8,
        addressing_style: AddressingStyle | None = None,
        refresh_after_s: float = DEFAULT_REFRESH_AFTER_S,
        tier: Tier = "object",
        session: boto3.session.Session | None = None,
    ) -> None:
        self._tier = parse_tier(tier)
        if retry_mode not in ("standard", "adaptive"):
            raise StoreURLError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        if max_attempts < 1:
            raise StoreURLError(f"max_attempts must be at least 1, got {max_attempts}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise StoreURLError(
                f"part_size must be between {MIN_PART_SIZE} (5 MiB, S3's minimum) and "
                f"{MAX_PART_SIZE} bytes, got {part_size}"
            )
        if multipart_threshold < 1:
            raise StoreURLError(f"multipart_threshold must be positive, got {multipart_threshold}")
        if max_concurrency < 1:
            raise StoreURLError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise StoreURLError("connect_timeout and read_timeout must be positive")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.max_attempts = max_attempts
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.refresh_after_s = refresh_after_s
        self._name = store_name(bucket, self.prefix, endpoint_url, region)
        config = Config(
            retries={"mode": retry_mode, "total_max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # One connection per pool thread plus headroom for callers' own threads.
            max_pool_connections=max(10, 2 * max_concurrency),
            s3={"addressing_style": addressing_style} if addressing_style else None,
        )
        try:
            self.client: S3Client = (session or boto3.session.Session()).client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config
            )
        except BotoCoreError as exc:
            raise StoreUnavailableError(f"{self._name}: cannot create an S3 client: {exc}") from exc
        self._attempts = threading.local()
        # Counts every attempt (botocore creates the request anew for each
        # try) so that errors can say how often a request was tried.
        self.client.meta.events.register("request-created.s3", self._count_attempt)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def tier(self) -> Tier:
        return self._tier

    def __repr__(self) -> str:
        return f"S3Store({self._name!r})"

    def object_key(self, key: str) -> str:
        """The bucket object name of blob `key`."""
        key = validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- plumbing ---------------------------------------------------------

    def _count_attempt(self, **_: object) -> None:
        self._attempts.n = getattr(self._attempts, "n", 0) + 1

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._closed:
                raise StoreUnavailableError(f"{self._name}: the store is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="kvc-s3")
            return self._pool

    def _call(
        self,
        op: str,
        key: str | None,
        fn: Callable[[], _T],
        *,
        passthrough: frozenset[int] = frozenset(),
    ) -> _T:
        """Run one client call, mapping its failure to a domain error.

        `ClientError`s with an HTTP status in `passthrough` are re-raised
        as they are, for the caller to interpret (412, 416, ...).
        """
        self._attempts.n = 0
        try:
            return fn()
        except ClientError as exc:
            if http_status(exc) in passthrough:
                raise
            raise self._map_error(op, key, exc) from exc
        except BotoCoreError as exc:
            raise self._map_error(op, key, exc) from exc

    def _map_error(
        self, op: str, key: str | None, exc: Exception, *, attempts: int | None = None
    ) -> ChunkStoreError:
        if attempts is None:
            attempts = max(1, getattr(self._attempts, "n", 1))
        return map_error(self._name, op, key, exc, attempts)

    def _head(self, key: str) -> Mapping[str, Any]:
        obj = self.object_key(key)
        return self._call(
            "head",
            key,
            lambda: self.client.head_object(Bucket=self.bucket, Key=obj, ChecksumMode="ENABLED"),
        )

    # -- writes -----------------------------------------------------------

    def put(self, key: str, data: Buffer) -> Receipt:
        key = validate_key(key)
        view = memoryview(data).cast("B")
        check_content_address(key, view)
        return self._put(key, view)

    def put_hashed(self, key: str, data: Buffer) -> Receipt:
        return self._put(validate_key(key), memoryview(data).cast("B"))

    def _put(self, key: str, view: memoryview) -> Receipt:
        # A 412 followed by a 404 means GC deleted the blob in between: try again.
        for _ in range(3):
            if view.nbytes > self.multipart_threshold:
                receipt = put_multipart(self, key, view)
            else:
                receipt = self._put_single(key, view)
            if receipt is not None:
                return receipt
        raise StoreUnavailableError(
            f"{self._name}: put of blob {key} kept finding the blob present, then absent; "
            "outcome unknown"
        )

    def _put_single(self, key: str, view: memoryview) -> Receipt | None:
        obj = self.object_key(key)
        sha_b64, _ = sha256_b64(view)
        # botocore takes bytes or a bytearray as they are: a view of a whole one (a
        # checkpoint's record buffer) goes out without a copy.
        owner = view.obj
        whole = isinstance(owner, bytes | bytearray) and len(owner) == view.nbytes
        # botocore's validator takes bytearray too; its type stubs name only bytes.
        body = cast(bytes, owner) if whole else view.tobytes()
        try:
            resp = self._call(
                "put",
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket,
                    Key=obj,
                    Body=body,
                    IfNoneMatch="*",
                    ChecksumSHA256=sha_b64,
                    ContentType=CONTENT_TYPE,
                ),
                passthrough=frozenset({412}),
            )
        except ClientError:  # 412: an object is already stored under this key
            return self._existing(key, view.nbytes, sha_b64)
        logger.debug("%s: stored blob %s (%d bytes)", self._name, key, view.nbytes)
        return Receipt(
            store=self._name,
            key=key,
            size=view.nbytes,
            checksum=f"sha256:{resp.get('ChecksumSHA256') or sha_b64}",
            stored_at=server_time(resp),
            etag=clean_etag(resp.get("ETag")),
            version=object_version(resp.get("VersionId")),
        )

    def _existing(
        self, key: str, size: int, sha_b64: str | None, *, refresh: bool = True
    ) -> Receipt | None:
        """The receipt of an object already stored under `key`, after checking it is ours.

        Returns None when the object vanished meanwhile (the put should be retried).
        """
        try:
            head = self._head(key)
        except BlobNotFoundError:
            return None
        stored = int(head["ContentLength"])
        if stored != size:
            raise ChunkIntegrityError(
                f"{self._name}: object for blob {key} holds {stored} bytes, expected {size}: "
                "a wrong object sits under a content address"
            )
        etag = clean_etag(head.get("ETag"))
        remote_sha = head.get("ChecksumSHA256")
        # A single-part object's checksum is of its whole content and can be compared.
        comparable = bool(
            sha_b64 and remote_sha and etag and "-" not in etag and "-" not in remote_sha
        )
        if comparable and remote_sha != sha_b64:
            raise ChunkIntegrityError(
                f"{self._name}: object for blob {key} has SHA-256 {remote_sha}, expected {sha_b64}: "
                "a wrong object sits under a content address"
            )
        if not comparable and refresh:  # (refresh=False: the call after a touch, read already)
            # No whole-content checksum to compare (uploaded in parts, or by a client
            # that sent none): read it. Never a receipt for bytes that are not the key's.
            self._verify_content(key)
        last_modified = utc(head["LastModified"])
        if refresh and time.time() - last_modified.timestamp() >= self.refresh_after_s:
            # A publish reusing existing bytes must refresh them, so that GC's
            # orphan grace period (which must exceed refresh_after_s) never
            # deletes bytes a concurrent publish is about to catalogue.
            try:
                self.touch(key)
            except BlobNotFoundError:
                return None
            return self._existing(key, size, sha_b64, refresh=False)
        return Receipt(
            store=self._name,
            key=key,
            size=stored,
            checksum=f"sha256:{remote_sha}" if remote_sha else f"etag:{etag}",
            stored_at=last_modified,
            etag=etag,
            version=object_version(head.get("VersionId")),
        )

    def _verify_content(self, key: str) -> None:
        try:
            data = self.get(key)
        except BlobNotFoundError:
            return  # gone meanwhile: the caller's HEAD after a refresh, or its retry, sees it
        if blake3_hex(data) != key:
            raise ChunkIntegrityError(
                f"{self._name}: object for blob {key} does not hash to its key: "
                "a wrong object sits under a content address"
            )

    def touch(self, key: str) -> None:
        """Set the object's LastModified to now by copying it onto itself (GC grace counts from it).

        Works on AWS, SeaweedFS and moto. The ETag of a blob uploaded in parts
        changes (the copy is a single-part object); its bytes do not.
        """
        obj = self.object_key(key)
        self._call(
            "touch",
            key,
            lambda: self.client.copy_object(
                Bucket=self.bucket,
                Key=obj,
                CopySource={"Bucket": self.bucket, "Key": obj},
                MetadataDirective="REPLACE",
                ContentType=CONTENT_TYPE,
                Metadata={"kvc-touched": utcnow().isoformat()},
                ChecksumAlgorithm="SHA256",
            ),
        )

    def delete(self, key: str) -> None:
        obj = self.object_key(key)
        with contextlib.suppress(BlobNotFoundError):  # S3 itself says 204 for an absent key
            self._call(
                "delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=obj)
            )

    # -- reads ------------------------------------------------------------

    def get(self, key: str) -> Buffer:
        """The blob's bytes: one GET up to `multipart_threshold`, parallel ranged GETs beyond.

        The bytes are not verified here; callers check them against the key.
        """
        obj = self.object_key(key)
        window = self.multipart_threshold

        def first_window() -> tuple[bytes | bytearray, int, str | None]:
            """The blob (whole, or a buffer of its size with the first `got` bytes), `got`, ETag."""
            try:
                first = self._call(
                    "get",
                    key,
                    lambda: self.client.get_object(
                        Bucket=self.bucket, Key=obj, Range=f"bytes=0-{window - 1}"
                    ),
                    passthrough=frozenset({416}),
                )
            except ClientError:  # 416: a range cannot start inside an empty object
                whole = self._get_whole(key, obj)
                return whole, len(whole), None
            total = total_size(first)
            got = int(first["ContentLength"])
            body = first["Body"]
            with self._reading(key, body):
                if total == got:
                    data: bytes = body.read()
                    return data, got, None
                buf = bytearray(total)
                read_into(body, memoryview(buf)[:got])
            return buf, got, first.get("ETag")

        buf, got, etag = self._retry_stream(key, first_window)
        if got == len(buf):
            return buf
        assert isinstance(buf, bytearray)
        jobs = [
            functools.partial(
                self._fetch_range, key, obj, s, min(s + self.part_size, len(buf)), etag, buf
            )
            for s in range(got, len(buf), self.part_size)
        ]
        run_all(self._executor(), jobs)
        return buf

    def _retry_stream(self, key: str, read: Callable[[], _T]) -> _T:
        """Run `read` (one GET and the reading of its body), again while the body breaks off
        mid-stream (botocore retries a request, not the body streaming after it), up to
        `max_attempts` in all."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return read()
            except STREAM_ERRORS as exc:
                if attempt == self.max_attempts:
                    raise self._map_error("get", key, exc, attempts=attempt) from exc
                logger.debug("%s: get of blob %s broke off (%s); retrying", self._name, key, exc)
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _reading(self, key: str, body: Any) -> Iterator[None]:
        """Close a response body that failed while being read; a checksum failure is the
        store's integrity error, a broken stream is raised as it is (for `_retry_stream`)."""
        try:
            yield
        except FlexibleChecksumError as exc:
            body.close()
            raise checksum_mismatch(self._name, key, exc) from exc
        except STREAM_ERRORS:
            body.close()
            raise

    def _get_whole(self, key: str, obj: str) -> bytes:
        def read() -> bytes:
            resp = self._call(
                "get", key, lambda: self.client.get_object(Bucket=self.bucket, Key=obj)
            )
            with self._reading(key, resp["Body"]):
                data: bytes = resp["Body"].read()
            return data

        return self._retry_stream(key, read)

    def _fetch_range(
        self, key: str, obj: str, start: int, end: int, etag: str | None, buf: bytearray
    ) -> None:
        # If-Match pins every range to the object the first response came from.
        if_match = etag or "*"

        def read() -> None:
            try:
                resp = self._call(
                    "get",
                    key,
                    lambda: self.client.get_object(
                        Bucket=self.bucket,
                        Key=obj,
                        Range=f"bytes={start}-{end - 1}",
                        IfMatch=if_match,
                    ),
                    passthrough=frozenset({412}),
                )
            except ClientError as exc:
                raise StoreUnavailableError(
                    f"{self._name}: blob {key} was replaced while being read (ETag changed)"
                ) from exc
            if int(resp["ContentLength"]) != end - start:
                raise StoreUnavailableError(
                    f"{self._name}: ranged get of blob {key} returned {resp['ContentLength']} bytes, "
                    f"expected {end - start}"
                )
            with self._reading(key, resp["Body"]):
                read_into(resp["Body"], memoryview(buf)[start:end])

        self._retry_stream(key, read)

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except BlobNotFoundError:
            return False
        return True

    def stat(self, key: str) -> BlobStat:
        head = self._head(key)
        return BlobStat(size=int(head["ContentLength"]), mtime=utc(head["LastModified"]))

    # -- documents -------------------------------------------------------------------

    def _document_key(self, name: str) -> str:
        name = validate_document_name(name)
        return f"{self.prefix}/{DOCUMENTS_DIR}/{name}" if self.prefix else f"{DOCUMENTS_DIR}/{name}"

    def put_document(self, name: str, data: bytes) -> bool:
        obj = self._document_key(name)
        sha_b64, _ = sha256_b64(data)
        try:
            self._call(
                "put",
                f"document {name}",
                lambda: self.client.put_object(
                    Bucket=self.bucket,
                    Key=obj,
                    Body=bytes(data),
                    IfNoneMatch="*",
                    ChecksumSHA256=sha_b64,
                    ContentType="application/json",
                ),
                passthrough=frozenset({412}),
            )
        except ClientError:  # 412: a document is already stored under this name
            return False
        return True

    def get_document(self, name: str) -> bytes:
        obj = self._document_key(name)

        def read() -> bytes:
            resp = self._call(
                "get",
                f"document {name}",
                lambda: self.client.get_object(Bucket=self.bucket, Key=obj, ChecksumMode="ENABLED"),
            )
            return bytes(resp["Body"].read())

        return self._retry_stream(f"document {name}", read)

    def documents(self, prefix: str = "") -> Iterator[str]:
        top = f"{self.prefix}/{DOCUMENTS_DIR}/" if self.prefix else f"{DOCUMENTS_DIR}/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=top + prefix
        )
        it = iter(pages)
        while True:
            page = self._call("list", None, lambda: next(it, None))
            if page is None:
                return
            for item in page.get("Contents", []):
                yield item["Key"][len(top) :]

    def keys(self) -> Iterator[str]:
        list_prefix = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=list_prefix
        )
        it = iter(pages)
        while True:
            page = self._call("list", None, lambda: next(it, None))
            if page is None:
                return
            for item in page.get("Contents", []):
                name = item["Key"][len(list_prefix) :]
                try:
                    yield validate_key(name)
                except ValueError:
                    continue

    def close(self) -> None:
        with self._pool_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.client.close()
