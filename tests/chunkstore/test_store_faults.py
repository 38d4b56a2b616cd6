"""Chunk stores under faults: writers killed mid-put, S3 requests that fail, time out or lose answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import (
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.retries import standard

from chunkstore import (
    BlobNotFoundError,
    StoreUnavailableError,
    StoreWriteError,
    open_store,
)
from chunkstore.local import LocalStore
from chunkstore.s3 import S3Store
from tests.chunkstore.test_stores import MOTO_REGION, MiB, make_blob, moto_s3

# -- local: a writer SIGKILLed mid-put --------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from chunkstore.local import LocalStore
    import blake3

    root, marker, stage = sys.argv[1], sys.argv[2], sys.argv[3]
    data = os.urandom(8 * 1024 * 1024)
    key = blake3.blake3(data).hexdigest()
    store = LocalStore(root)
    real_write, real_fsync = os.write, os.fsync

    def stop_here():
        with open(marker, "w") as f:
            f.write(key)
        while True:  # the parent SIGKILLs this process here
            time.sleep(60)

    def write(fd, buf):
        real_write(fd, memoryview(buf)[: len(buf) // 2])
        stop_here()

    def fsync(fd):
        real_fsync(fd)
        stop_here()

    if stage == "mid-write":
        os.write = write
    else:  # written and fsynced, not yet renamed into place
        os.fsync = fsync
    store.put(key, data)
    """
)


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("stage", ["mid-write", "before-rename"])
def test_writer_killed_mid_put_leaves_no_visible_blob(tmp_path: Path, stage: str) -> None:
    root = tmp_path / "store"
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(marker), stage])
    try:
        wait_for(
            lambda: (marker.exists() and marker.stat().st_size == 64) or child.poll() is not None,
            "the writer to reach its kill point",
        )
        assert child.poll() is None, f"writer exited early with {child.returncode}"
        key = marker.read_text()
        shard = root / key[:2] / key[2:4]
        temps = [p for p in shard.iterdir() if p.name.startswith(".tmp-")]
        assert len(temps) == 1  # the partial write exists, under its temp name
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)

    store = LocalStore(root)  # a fresh temp file survives the open-time sweep
    assert temps[0].exists()
    assert list(store.keys()) == []
    assert not store.exists(key)
    with pytest.raises(BlobNotFoundError):
        store.get(key)

    old = time.time() - 2 * 3600
    os.utime(temps[0], (old, old))
    LocalStore(root)  # reopening later sweeps the crashed writer's leftovers
    assert not temps[0].exists()
    assert list(shard.iterdir()) == []


# -- S3 on moto: requests that fail ----------------------------------------


@pytest.fixture
def s3_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Store]:
    """A moto-backed store that tries each request 3 times."""
    # The jittered backoff between attempts is not under test; the attempt
    # count is. Without it these tests would wait seconds for nothing.
    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", lambda self, context: 0.0)
    with moto_s3(monkeypatch, "kvc-faults"):
        url = f"s3://kvc-faults/p?region={MOTO_REGION}&max_attempts=3"
        with open_store(url, multipart_threshold=5 * MiB, part_size=5 * MiB) as store:
            assert isinstance(store, S3Store)
            yield store


def _error_response(url: str, status: int, code: str) -> AWSResponse:
    class Raw:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def stream(self, **_: object) -> Iterator[bytes]:
            yield self.body

    body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return AWSResponse(url, status, {"Content-Type": "application/xml"}, Raw(body))  # type: ignore[arg-type]


def _raise(exc: Exception) -> AWSResponse:
    raise exc


FAULTS: dict[str, Callable[[Any], AWSResponse]] = {
    "500-internal-error": lambda req: _error_response(req.url, 500, "InternalError"),
    "503-slow-down": lambda req: _error_response(req.url, 503, "SlowDown"),
    "read-timeout": lambda req: _raise(ReadTimeoutError(endpoint_url=req.url)),
    "connection-closed": lambda req: _raise(ConnectionClosedError(endpoint_url=req.url)),
    "connection-refused": lambda req: _raise(EndpointConnectionError(endpoint_url=req.url)),
}


def inject(store: S3Store, operation: str, fault: str, times: int) -> list[str]:
    """Make the first `times` attempts of `operation` fail with `fault`; return the attempt log.

    The hook runs before moto's. A hook that raises stops the request before
    moto sees it (it did not land); one that returns a response replaces
    moto's answer, but moto has still executed the request (it landed and
    the answer was lost), as a real server may do on a 5xx.
    """
    attempts: list[str] = []

    def handler(request: Any, **_: object) -> Any:  # a response, or None to let moto answer
        attempts.append(operation)
        if len(attempts) <= times:
            return FAULTS[fault](request)
        return None

    store.client.meta.events.register_first(f"before-send.s3.{operation}", handler)
    return attempts


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_transient_put_failures_are_retried(s3_store: S3Store, fault: str) -> None:
    attempts = inject(s3_store, "PutObject", fault, times=2)
    key, data = make_blob()
    receipt = s3_store.put(key, data)
    assert receipt.size == len(data)
    assert len(attempts) == 3
    assert bytes(s3_store.get(key)) == data


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_transient_get_failures_are_retried(s3_store: S3Store, fault: str) -> None:
    key, data = make_blob()
    s3_store.put(key, data)
    attempts = inject(s3_store, "GetObject", fault, times=2)
    assert bytes(s3_store.get(key)) == data
    assert len(attempts) == 3


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_persistent_put_failure_is_unavailable_after_all_attempts(
    s3_store: S3Store, fault: str
) -> None:
    attempts = inject(s3_store, "PutObject", fault, times=10**6)
    key, data = make_blob()
    with pytest.raises(StoreUnavailableError) as info:
        s3_store.put(key, data)
    assert isinstance(info.value, ConnectionError)
    message = str(info.value)
    assert s3_store.name in message and key in message
    assert "3 attempt" in message and "outcome unknown" in message
    assert len(attempts) == 3


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_persistent_read_failures_are_unavailable_not_missing(
    s3_store: S3Store, fault: str
) -> None:
    key, data = make_blob()
    s3_store.put(key, data)
    gets = inject(s3_store, "GetObject", fault, times=10**6)
    heads = inject(s3_store, "HeadObject", fault, times=10**6)
    with pytest.raises(StoreUnavailableError) as info:
        s3_store.get(key)
    assert s3_store.name in str(info.value) and key in str(info.value)
    assert "3 attempt" in str(info.value)
    assert len(gets) == 3
    # An unreachable store must not claim the blob is absent.
    with pytest.raises(StoreUnavailableError):
        s3_store.exists(key)
    with pytest.raises(StoreUnavailableError):
        s3_store.stat(key)
    assert len(heads) == 6


def test_put_whose_answer_was_lost_is_confirmed_by_head(s3_store: S3Store) -> None:
    # moto stores the object, then the connection drops before the answer:
    # the retry gets 412 and the store confirms the object with HEAD.
    lost: list[int] = []

    def drop_answer(request: Any, **_: object) -> None:
        if not lost:
            lost.append(1)
            raise ConnectionClosedError(endpoint_url=request.url)

    s3_store.client.meta.events.register_last("before-send", drop_answer)
    key, data = make_blob()
    receipt = s3_store.put(key, data)
    assert lost == [1]
    assert (receipt.key, receipt.size) == (key, len(data))
    assert receipt.etag is not None
    assert list(s3_store.keys()) == [key]


def test_multipart_completion_whose_answer_was_lost_is_confirmed(s3_store: S3Store) -> None:
    # The retried CompleteMultipartUpload finds the upload gone (404
    # NoSuchUpload) because the first one succeeded.
    lost: list[int] = []

    def drop_answer(request: Any, **_: object) -> None:
        if not lost and request.method == "POST" and "uploadId=" in request.url:
            lost.append(1)
            raise ConnectionClosedError(endpoint_url=request.url)

    s3_store.client.meta.events.register_last("before-send", drop_answer)
    key, data = make_blob(11 * MiB)
    receipt = s3_store.put(key, data)
    assert lost == [1]
    assert receipt.size == len(data)
    assert bytes(s3_store.get(key)) == data


def test_failed_part_upload_did_not_land_and_is_aborted(s3_store: S3Store) -> None:
    inject(s3_store, "UploadPart", "503-slow-down", times=10**6)
    aborts = inject(s3_store, "AbortMultipartUpload", "503-slow-down", times=0)
    key, data = make_blob(11 * MiB)
    with pytest.raises(StoreWriteError) as info:
        s3_store.put(key, data)
    assert key in str(info.value) and "did not land" in str(info.value)
    assert len(aborts) == 1
    assert not s3_store.exists(key)
    uploads = s3_store.client.list_multipart_uploads(Bucket="kvc-faults")
    assert uploads.get("Uploads", []) == []


def test_ranged_get_retries_a_failing_range(s3_store: S3Store) -> None:
    key, data = make_blob(12 * MiB)
    s3_store.put(key, data)
    attempts = inject(s3_store, "GetObject", "connection-closed", times=0)
    ranges: list[str] = []

    def fail_second_range_once(request: Any, **_: object) -> None:
        rng = request.headers.get("Range", b"")
        rng = rng.decode() if isinstance(rng, bytes) else rng
        ranges.append(rng)
        if rng.startswith(f"bytes={5 * MiB}-") and ranges.count(rng) == 1:
            raise ReadTimeoutError(endpoint_url=request.url)

    s3_store.client.meta.events.register_first("before-send.s3.GetObject", fail_second_range_once)
    assert bytes(s3_store.get(key)) == data
    assert len(attempts) == 4  # the window, two ranges, one retry
