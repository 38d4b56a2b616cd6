"""The S3 store's multipart upload: parts with SHA-256 checksums, a conditional completion, abort on failure."""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import math
from typing import TYPE_CHECKING

from botocore.exceptions import ClientError

from chunkstore.base import Receipt
from chunkstore.errors import BlobNotFoundError, ChunkStoreError, StoreWriteError
from chunkstore.s3_helpers import (
    CONTENT_TYPE,
    clean_etag,
    http_status,
    object_version,
    run_all,
    server_time,
    sha256_b64,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

    from chunkstore.s3 import S3Store

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000


def put_multipart(store: S3Store, key: str, view: memoryview) -> Receipt | None:
    """Upload blob `key` in parts and complete it only if the key is absent; the receipt, or
    None when an object under the key vanished meanwhile (the put should be retried).

    Part of `S3Store.put`, kept apart for size: it runs on the store's own request
    plumbing (`_call`, `_existing`, `_executor`), so errors map the same way."""
    # Hand-rolled rather than s3transfer: it must end with a conditional
    # CompleteMultipartUpload (If-None-Match: *), which SeaweedFS and moto
    # both honour (412 when the key exists), and carry per-part SHA-256
    # checksums, which both verify and echo.
    obj = store.object_key(key)
    size = view.nbytes
    part_size = max(store.part_size, math.ceil(size / MAX_PARTS))
    ranges = [
        (i + 1, off, min(off + part_size, size)) for i, off in enumerate(range(0, size, part_size))
    ]
    created = store._call(
        "multipart put",
        key,
        lambda: store.client.create_multipart_upload(
            Bucket=store.bucket, Key=obj, ChecksumAlgorithm="SHA256", ContentType=CONTENT_TYPE
        ),
    )
    upload_id = created["UploadId"]

    def upload(part: int, start: int, end: int) -> tuple[int, str, bytes]:
        piece = view[start:end]
        sha_b64, digest = sha256_b64(piece)
        resp = store._call(
            f"upload of part {part} in multipart put",
            key,
            lambda: store.client.upload_part(
                Bucket=store.bucket,
                Key=obj,
                UploadId=upload_id,
                PartNumber=part,
                Body=piece.tobytes(),
                ChecksumSHA256=sha_b64,
            ),
        )
        return part, str(resp["ETag"]), digest

    try:
        parts = run_all(
            store._executor(), [functools.partial(upload, p, s, e) for p, s, e in ranges]
        )
    except ChunkStoreError as exc:
        _abort(store, key, obj, upload_id)
        # Until CompleteMultipartUpload nothing is visible under the key.
        raise StoreWriteError(
            f"{store.name}: multipart put of blob {key} did not land: {exc}"
        ) from exc
    except BaseException:
        _abort(store, key, obj, upload_id)
        raise
    parts.sort()
    digests = b"".join(d for _, _, d in parts)
    composite = (
        base64.b64encode(hashlib.sha256(digests).digest()).decode("ascii") + f"-{len(parts)}"
    )
    listing: list[CompletedPartTypeDef] = [
        {"PartNumber": n, "ETag": etag, "ChecksumSHA256": base64.b64encode(d).decode("ascii")}
        for n, etag, d in parts
    ]
    try:
        resp = store._call(
            "multipart put",
            key,
            lambda: store.client.complete_multipart_upload(
                Bucket=store.bucket,
                Key=obj,
                UploadId=upload_id,
                MultipartUpload={"Parts": listing},
                IfNoneMatch="*",
            ),
            passthrough=frozenset({404, 412}),
        )
    except ClientError as exc:
        if http_status(exc) == 412:
            _abort(store, key, obj, upload_id)
            return store._existing(key, size, None)
        # 404 NoSuchUpload: an earlier attempt whose response was lost
        # completed the upload; the object says whether it landed.
        try:
            return store._existing(key, size, None)
        except BlobNotFoundError:
            raise store._map_error("multipart put", key, exc) from exc
    except BaseException:
        _abort(store, key, obj, upload_id)
        raise
    logger.debug("%s: stored blob %s (%d bytes, %d parts)", store.name, key, size, len(parts))
    return Receipt(
        store=store.name,
        key=key,
        size=size,
        checksum=f"sha256:{resp.get('ChecksumSHA256') or composite}",
        stored_at=server_time(resp),
        etag=clean_etag(resp.get("ETag")),
        version=object_version(resp.get("VersionId")),
    )


def _abort(store: S3Store, key: str, obj: str, upload_id: str) -> None:
    try:
        store._call(
            "abort of multipart put",
            key,
            lambda: store.client.abort_multipart_upload(
                Bucket=store.bucket, Key=obj, UploadId=upload_id
            ),
            passthrough=frozenset({404}),
        )
    except (ChunkStoreError, ClientError) as exc:
        # The parts cost storage until a bucket lifecycle rule
        # (AbortIncompleteMultipartUpload) reaps them; they are never visible.
        logger.warning("%s: could not abort multipart upload of blob %s: %s", store.name, key, exc)
