"""One behaviour suite for every chunk store (local, S3 on SeaweedFS, S3 on moto), plus URL handling."""

from __future__ import annotations

import abc
import contextlib
import hashlib
import logging
import mmap
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import blake3
import boto3
import numpy as np
import pytest

from chunkstore import (
    BlobNotFoundError,
    ChunkIntegrityError,
    ChunkStore,
    InvalidKeyError,
    StoreURLError,
    open_store,
)
from chunkstore.local import LocalStore
from chunkstore.s3 import S3Store
from tests.services import S3Server

MiB = 1024 * 1024
MOTO_REGION = "us-east-1"


def make_blob(size: int = 4096) -> tuple[str, bytes]:
    data = os.urandom(size)
    return blake3.blake3(data).hexdigest(), data


class Backend(abc.ABC):
    """How a test reaches one kind of store, and what it can do to it from outside."""

    url: str
    has_etag: bool
    # Options that push blobs of a few MiB onto the multipart / ranged-get path.
    large_options: dict[str, object] = {}  # noqa: RUF012 - read-only class default
    # A put over wrong bytes of the right size: the local store rewrites them (atomically,
    # with the right bytes in hand); S3 cannot replace an object conditionally and refuses.
    repairs_on_put = False

    def open(self, **options: object) -> ChunkStore:
        return open_store(self.url, **options)  # type: ignore[arg-type]  # no `session` among them

    @abc.abstractmethod
    def raw_names(self) -> list[str]:
        """Every file or object under the store, temporary ones included."""

    @abc.abstractmethod
    def overwrite(self, key: str, data: bytes) -> None:
        """Replace the bytes stored under `key` behind the store's back."""

    @abc.abstractmethod
    def write_foreign(self, name: str, data: bytes) -> None:
        """Put a file/object that is not a blob next to the blobs."""

    @abc.abstractmethod
    def backdate(self, key: str, age: timedelta) -> None:
        """Make the blob's modification time `age` old (or skip the test)."""


class LocalBackend(Backend):
    repairs_on_put = True
    has_etag = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4] / key

    def raw_names(self) -> list[str]:
        return sorted(
            str(Path(d, f).relative_to(self.root))
            for d, _, files in os.walk(self.root)
            for f in files
        )

    def overwrite(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.chmod(0o644)
        path.write_bytes(data)

    def write_foreign(self, name: str, data: bytes) -> None:
        (self.root / name).write_bytes(data)

    def backdate(self, key: str, age: timedelta) -> None:
        t = time.time() - age.total_seconds()
        os.utime(self._path(key), (t, t))


class S3Backend(Backend):
    has_etag = True
    large_options = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}  # noqa: RUF012

    def __init__(self, url: str, client: Any, bucket: str, prefix: str) -> None:
        self.url = url
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def raw_names(self) -> list[str]:
        resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/")
        return sorted(o["Key"] for o in resp.get("Contents", []))

    def overwrite(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def write_foreign(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}", Body=data)

    def backdate(self, key: str, age: timedelta) -> None:
        pytest.skip("SeaweedFS offers no way to set an object's LastModified")


class MotoBackend(S3Backend):
    def backdate(self, key: str, age: timedelta) -> None:
        from moto.core.models import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        # moto keeps naive UTC datetimes.
        obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(self.bucket, f"{self.prefix}/{key}")
        assert obj is not None
        obj.last_modified = datetime.now(UTC).replace(tzinfo=None) - age


def moto_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials where the AWS chain finds them, and nothing else from this machine."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-access")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", MOTO_REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch, bucket: str = "kvc-moto") -> Iterator[Any]:
    """A moto-mocked S3 with `bucket` created; yields a client for it."""
    from moto import mock_aws
    from moto.core.botocore_stubber import BotocoreStubber

    moto_env(monkeypatch)
    # moto checks If-None-Match and writes the key in separate steps, and an
    # overwrite closes the buffer a concurrent request is still reading: it
    # is not linearizable under concurrent puts of one key. Real S3 is, so
    # let moto handle one request at a time.
    serial = threading.Lock()
    process = BotocoreStubber.process_request

    def process_serially(self: BotocoreStubber, request: Any) -> Any:
        with serial:
            return process(self, request)

    monkeypatch.setattr(BotocoreStubber, "process_request", process_serially)
    with mock_aws():
        client = boto3.client("s3", region_name=MOTO_REGION)
        client.create_bucket(Bucket=bucket)
        yield client


@pytest.fixture
def moto_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str]]:
    """A moto-mocked S3 bucket and a client for it."""
    with moto_s3(monkeypatch, "kvc-moto") as client:
        yield client, "kvc-moto"


def counter(store: ChunkStore, operation: str) -> list[str]:
    """Record every attempt of `operation` (e.g. "GetObject") the store's client sends."""
    assert isinstance(store, S3Store)
    seen: list[str] = []

    def record(**kwargs: object) -> None:
        seen.append(operation)

    store.client.meta.events.register(f"before-send.s3.{operation}", record)
    return seen


BAD_KEYS: list[object] = [
    "ab" * 10,  # too short
    "AB" * 32,  # uppercase hex
    "../" + "a" * 61,  # traversal, right length
    "../../etc/passwd",
    "a" * 63 + "/",
    "a" * 65,
    "",
    b"a" * 64,  # bytes, not str
    12345,
    None,
]


class StoreConformance:
    """What every chunk store must do; subclasses provide `backend`."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError

    @pytest.fixture
    def store(self, backend: Backend) -> Iterator[ChunkStore]:
        with backend.open() as store:
            yield store

    def test_round_trip(self, store: ChunkStore) -> None:
        for size in (1, 4096, 300_000):
            key, data = make_blob(size)
            store.put(key, data)
            assert bytes(store.get(key)) == data
            assert store.exists(key)
            assert store.stat(key).size == size

    def test_put_accepts_any_contiguous_buffer(self, store: ChunkStore) -> None:
        array = np.arange(1000, dtype=np.float16).reshape(10, 100)
        key = blake3.blake3(array.tobytes()).hexdigest()
        store.put(key, array.data)
        assert bytes(store.get(key)) == array.tobytes()

    def test_empty_blob_round_trips(self, store: ChunkStore) -> None:
        key = blake3.blake3(b"").hexdigest()
        assert store.put(key, b"").size == 0
        assert bytes(store.get(key)) == b""

    def test_put_is_idempotent(self, store: ChunkStore, backend: Backend) -> None:
        key, data = make_blob()
        first = store.put(key, data)
        second = store.put(key, data)
        assert (second.key, second.size) == (first.key, first.size) == (key, len(data))
        assert len(backend.raw_names()) == 1
        assert store.stat(key).size == len(data)
        assert list(store.keys()) == [key]

    def test_concurrent_puts_of_one_key_make_one_blob(
        self, store: ChunkStore, backend: Backend
    ) -> None:
        key, data = make_blob(1 * MiB)
        barrier = threading.Barrier(8)
        receipts: list[object] = []
        errors: list[BaseException] = []

        def put() -> None:
            barrier.wait()
            try:
                receipts.append(store.put(key, data))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=put) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert len(receipts) == 8
        assert len(backend.raw_names()) == 1  # no second object, no temp file left behind
        assert bytes(store.get(key)) == data

    def test_missing_key(self, store: ChunkStore) -> None:
        key, _ = make_blob()
        with pytest.raises(BlobNotFoundError):
            store.get(key)
        with pytest.raises(FileNotFoundError):
            store.stat(key)
        with pytest.raises(BlobNotFoundError):
            store.touch(key)  # type: ignore[attr-defined]
        assert not store.exists(key)

    @pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
    def test_invalid_keys_are_rejected_by_every_method(
        self, store: ChunkStore, bad: object
    ) -> None:
        calls: list[Callable[[Any], object]] = [
            lambda k: store.put(k, b"data"),
            store.get,
            store.exists,
            store.stat,
            store.delete,
            store.touch,  # type: ignore[attr-defined]
        ]
        for call in calls:
            with pytest.raises(InvalidKeyError):
                call(bad)

    def test_data_not_matching_its_key_is_refused(
        self, store: ChunkStore, backend: Backend
    ) -> None:
        key, _ = make_blob()
        _, other = make_blob()
        with pytest.raises(ChunkIntegrityError, match=key):
            store.put(key, other)
        assert not store.exists(key)
        assert backend.raw_names() == []

    def test_keys_lists_exactly_the_blobs(self, store: ChunkStore, backend: Backend) -> None:
        blobs = dict(make_blob(100 + i) for i in range(5))
        for key, data in blobs.items():
            store.put(key, data)
        backend.write_foreign("README", b"not a blob")
        backend.write_foreign("a" * 64 + ".bak", b"not a blob either")
        assert sorted(store.keys()) == sorted(blobs)

    def test_documents_are_immutable_named_records_apart_from_blobs(
        self, store: ChunkStore
    ) -> None:
        key, data = make_blob()
        store.put(key, data)
        assert store.put_document("fingerprints/ab", b'{"v": 1}')
        assert not store.put_document("fingerprints/ab", b'{"v": 2}')  # the first one wins
        assert store.get_document("fingerprints/ab") == b'{"v": 1}'
        assert store.put_document("journal/refs/ns/r1/0001-x.json", b"{}")
        assert store.put_document("journal/refs/ns/r2/0001-y.json", b"[]")
        assert list(store.documents()) == [
            "fingerprints/ab",
            "journal/refs/ns/r1/0001-x.json",
            "journal/refs/ns/r2/0001-y.json",
        ]
        assert list(store.documents("journal/refs/ns/r2")) == ["journal/refs/ns/r2/0001-y.json"]
        assert list(store.keys()) == [key]  # documents are not blobs
        with pytest.raises(BlobNotFoundError):
            store.get_document("fingerprints/cd")
        for bad in ["", "../x", "a/../../b", "a//b", "/abs", "a/./b", "sp ace", "x" * 600]:
            with pytest.raises(InvalidKeyError):
                store.put_document(bad, b"x")
            with pytest.raises(InvalidKeyError):
                store.get_document(bad)

    def test_delete(self, store: ChunkStore) -> None:
        key, data = make_blob()
        store.put(key, data)
        store.delete(key)
        assert not store.exists(key)
        with pytest.raises(BlobNotFoundError):
            store.get(key)
        assert list(store.keys()) == []
        store.delete(key)  # absent: not an error

    def test_receipt_fields(self, store: ChunkStore, backend: Backend) -> None:
        key, data = make_blob()
        before = datetime.now(UTC) - timedelta(minutes=5)
        receipt = store.put(key, data)
        assert receipt.store == store.name
        assert (receipt.key, receipt.size) == (key, len(data))
        algorithm, _, value = receipt.checksum.partition(":")
        assert algorithm and value
        assert receipt.stored_at.utcoffset() == timedelta(0)
        assert before <= receipt.stored_at <= datetime.now(UTC) + timedelta(minutes=5)
        assert (receipt.etag is not None) == backend.has_etag
        stat = store.stat(key)
        assert stat.size == len(data)
        assert stat.mtime.utcoffset() == timedelta(0)
        # The receipt of an already-stored blob describes the same bytes.
        again = store.put(key, data)
        assert (again.store, again.key, again.size, again.etag) == (
            receipt.store,
            receipt.key,
            receipt.size,
            receipt.etag,
        )

    def test_corrupted_blob_is_detected_by_decode_chunk(
        self, store: ChunkStore, backend: Backend
    ) -> None:
        from chunkstore.record import decode_chunk, encode_chunk

        rng = np.random.default_rng(7)
        tokens = list(range(100, 116))
        chunk = encode_chunk(
            fingerprint="f" * 64,
            namespace="tenant-a",
            prefix_hash=bytes(range(32)),
            parent_hash=bytes(32),
            token_start=0,
            tokens=tokens,
            kv=rng.standard_normal((2, 2, len(tokens), 2, 8)).astype(np.float16),
        )
        store.put(chunk.key, chunk.data)
        decode_chunk(store.get(chunk.key), expected_key=chunk.key)  # intact: decodes

        flipped = bytearray(chunk.data)
        flipped[len(flipped) // 2] ^= 0x40
        backend.overwrite(chunk.key, bytes(flipped))
        with pytest.raises(ChunkIntegrityError):
            decode_chunk(store.get(chunk.key), expected_key=chunk.key)

    @pytest.mark.parametrize("size", [4096, 12 * MiB + 123], ids=["single", "parts"])
    def test_a_put_over_damaged_bytes_never_answers_with_a_receipt_for_them(
        self, backend: Backend, size: int
    ) -> None:
        """The replica's bytes rotted (same size, one bit): putting the blob again must
        not vouch for them (a corrupt replica would be catalogued durable again). The
        local store rewrites them; S3 refuses with `ChunkIntegrityError`."""
        key, data = make_blob(size)
        flipped = bytearray(data)
        flipped[size // 2] ^= 0x40
        with backend.open(**backend.large_options) as store:
            store.put(key, data)
            backend.overwrite(key, bytes(flipped))
            if backend.repairs_on_put:
                receipt = store.put(key, data)
                assert receipt.size == size
                assert bytes(store.get(key)) == data
                assert len(backend.raw_names()) == 1  # replaced in place, no temp file left
            else:
                with pytest.raises(ChunkIntegrityError, match="does not hash to its key"):
                    store.put(key, data)
                assert bytes(store.get(key)) == bytes(flipped)  # the evidence is kept

    def test_large_blob_round_trips_in_parts(self, backend: Backend) -> None:
        key, data = make_blob(12 * MiB + 123)
        with backend.open(**backend.large_options) as store:
            gets = counter(store, "GetObject") if isinstance(store, S3Store) else []
            receipt = store.put(key, data)
            assert receipt.size == len(data)
            assert bytes(store.get(key)) == data
            again = store.put(key, data)  # idempotent on the multipart path too
            assert again.size == len(data)
            assert len(backend.raw_names()) == 1
            if isinstance(store, S3Store):
                assert receipt.etag is not None and receipt.etag.endswith("-3")  # 3 parts
                assert len(gets) >= 3  # one window, then ranges in parallel

    def test_touch_refreshes_mtime(self, store: ChunkStore, backend: Backend) -> None:
        key, data = make_blob()
        store.put(key, data)
        before = store.stat(key)
        store.touch(key)  # type: ignore[attr-defined]
        after = store.stat(key)
        assert after.size == before.size and after.mtime >= before.mtime
        assert bytes(store.get(key)) == data
        backend.backdate(key, timedelta(hours=2))
        assert store.stat(key).mtime < datetime.now(UTC) - timedelta(hours=1)
        store.touch(key)  # type: ignore[attr-defined]
        assert store.stat(key).mtime > datetime.now(UTC) - timedelta(minutes=5)
        assert bytes(store.get(key)) == data

    def test_putting_an_old_blob_again_refreshes_it(
        self, store: ChunkStore, backend: Backend
    ) -> None:
        # GC's grace period counts from the mtime: a publish reusing old bytes must renew it.
        key, data = make_blob()
        store.put(key, data)
        backend.backdate(key, timedelta(hours=2))
        receipt = store.put(key, data)
        recent = datetime.now(UTC) - timedelta(minutes=5)
        assert store.stat(key).mtime > recent
        assert receipt.stored_at > recent
        assert bytes(store.get(key)) == data


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(tmp_path / "store")


class TestS3StoreOnSeaweedFS(StoreConformance):
    @pytest.fixture
    def backend(self, s3_url: str, s3_server: S3Server) -> Backend:
        client = boto3.client(
            "s3", endpoint_url=s3_server.endpoint_url, region_name=s3_server.region
        )
        prefix = s3_url.split("?")[0].removeprefix(f"s3://{s3_server.bucket}/")
        return S3Backend(s3_url, client, s3_server.bucket, prefix)


class TestS3StoreOnMoto(StoreConformance):
    @pytest.fixture
    def backend(self, moto_bucket: tuple[Any, str]) -> Backend:
        client, bucket = moto_bucket
        prefix = f"t-{uuid.uuid4().hex[:8]}"
        return MotoBackend(f"s3://{bucket}/{prefix}?region={MOTO_REGION}", client, bucket, prefix)


# -- S3 only ---------------------------------------------------------------


def test_s3_wrong_object_under_a_content_address_is_an_integrity_error(
    moto_bucket: tuple[Any, str],
) -> None:
    client, bucket = moto_bucket
    key, data = make_blob()
    with open_store(f"s3://{bucket}/p?region={MOTO_REGION}") as store:
        client.put_object(Bucket=bucket, Key=f"p/{key}", Body=data[:-1])  # wrong size
        with pytest.raises(ChunkIntegrityError, match=key):
            store.put(key, data)
        client.put_object(
            Bucket=bucket, Key=f"p/{key}", Body=data[::-1], ChecksumAlgorithm="SHA256"
        )
        with pytest.raises(ChunkIntegrityError, match=key):  # same size, other SHA-256
            store.put(key, data)


def test_s3_receipt_checksum_is_the_servers_sha256(moto_bucket: tuple[Any, str]) -> None:
    import base64

    _, bucket = moto_bucket
    key, data = make_blob()
    with open_store(f"s3://{bucket}/p?region={MOTO_REGION}") as store:
        receipt = store.put(key, data)
    assert receipt.checksum == "sha256:" + base64.b64encode(hashlib.sha256(data).digest()).decode()


# -- local only --------------------------------------------------------------


def test_local_temp_files_are_never_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key, data = make_blob()
    store.put(key, data)
    other, _ = make_blob()
    shard = tmp_path / other[:2] / other[2:4]
    shard.mkdir(parents=True, exist_ok=True)
    (shard / f".tmp-{other}-{uuid.uuid4().hex}").write_bytes(b"partial")
    assert list(store.keys()) == [key]
    assert not store.exists(other)


def test_local_sweep_removes_stale_temp_files_only(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key, _ = make_blob()
    shard = tmp_path / key[:2] / key[2:4]
    shard.mkdir(parents=True)
    stale = shard / f".tmp-{key}-stale"
    fresh = shard / f".tmp-{key}-fresh"
    stale.write_bytes(b"left by a crashed writer")
    fresh.write_bytes(b"a live writer is still busy")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert store.sweep_temp(older_than_s=3600) == 1
    assert not stale.exists()
    assert fresh.exists()


def test_local_opening_the_store_sweeps_once(tmp_path: Path) -> None:
    key, _ = make_blob()
    shard = tmp_path / key[:2] / key[2:4]
    shard.mkdir(parents=True)
    stale = shard / f".tmp-{key}-stale"
    stale.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    LocalStore(tmp_path)
    assert not stale.exists()


def test_local_get_returns_a_read_only_mmap(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key, data = make_blob()
    store.put(key, data)
    view = store.get(key)
    assert isinstance(view, memoryview)
    assert isinstance(view.obj, mmap.mmap)
    assert view.readonly
    assert view.tobytes() == data


def test_local_put_repairs_a_wrong_size_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key, data = make_blob()
    path = tmp_path / key[:2] / key[2:4] / key
    path.parent.mkdir(parents=True)
    path.write_bytes(data[:10])  # e.g. a copy cut short by some other tool
    store.put(key, data)
    assert bytes(store.get(key)) == data


# -- URLs --------------------------------------------------------------------


def test_file_url_opens_a_local_store_with_a_normalized_name(tmp_path: Path) -> None:
    with open_store(f"file://{tmp_path}/a/./b/") as store:
        assert isinstance(store, LocalStore)
        assert store.name == f"file://{tmp_path}/a/b"
        assert (tmp_path / "a" / "b").is_dir()
    with open_store(f"file://{tmp_path}/c?refresh_after_s=60", temp_grace_s=10) as store:
        assert isinstance(store, LocalStore)
        assert (store.refresh_after_s, store.temp_grace_s) == (60, 10)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("file:relative/dir", "absolute"),
        ("file://host/abs/dir", "host"),
        ("file://./dir", "host"),
        ("/abs/dir", "no scheme"),
        ("gs://bucket/prefix", "'gs'"),
        ("file:///tmp/x?region=us-east-1", "'region'"),
        ("s3:///prefix", "empty bucket"),
        ("s3://Bad_Bucket!/p", "bucket"),
        ("s3://bucket/p?max_attempts=zero", "max_attempts"),
        ("s3://bucket/p?max_attempts=0", "max_attempts"),
        ("s3://bucket/p?retry_mode=legacy", "retry_mode"),
        ("s3://bucket/p?addressing_style=sideways", "addressing_style"),
        ("s3://bucket/p?part_size=1MiB", "part_size"),
        ("s3://bucket/p?connect_timeout=-1", "connect_timeout"),
        ("s3://bucket/p?region=", "region"),
        ("s3://bucket/p?region=us-east-1&region=eu-west-1", "twice"),
        ("s3://bucket/p?endpoint_url=ftp://host", "endpoint_url"),
        ("s3://bucket/p#frag", "fragment"),
    ],
)
def test_bad_urls_are_refused_with_the_problem_named(url: str, problem: str) -> None:
    with pytest.raises(StoreURLError, match=problem.replace("?", r"\?")):
        open_store(url)


def test_s3_url_name_keeps_identity_options_only(monkeypatch: pytest.MonkeyPatch) -> None:
    moto_env(monkeypatch)
    url = (
        "s3://kvc-bucket//runs/a/?read_timeout=5&region=eu-west-1&endpoint_url=http://127.0.0.1:9000/"
        "&max_attempts=3&part_size=8MiB&retry_mode=adaptive&addressing_style=path"
    )
    with open_store(url, max_concurrency=4) as store:
        assert isinstance(store, S3Store)
        assert (
            store.name
            == "s3://kvc-bucket/runs/a?endpoint_url=http://127.0.0.1:9000&region=eu-west-1"
        )
        assert (store.bucket, store.prefix) == ("kvc-bucket", "runs/a")
        assert (store.part_size, store.max_attempts, store.max_concurrency) == (8 * MiB, 3, 4)
        config: Any = store.client.meta.config
        assert config.retries == {"mode": "adaptive", "total_max_attempts": 3}
        assert config.read_timeout == 5
        assert config.max_pool_connections >= 4
        assert repr(store) == f"S3Store({store.name!r})"
    with open_store("s3://kvc-bucket") as store:
        assert store.name == "s3://kvc-bucket"


def test_keyword_options_override_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    moto_env(monkeypatch)
    with open_store("s3://kvc-bucket/p?max_attempts=5", max_attempts=2, read_timeout="7") as store:
        assert isinstance(store, S3Store)
        assert store.max_attempts == 2
        assert cast(Any, store.client.meta.config).read_timeout == 7
    with pytest.raises(StoreURLError, match="'colour'"):
        open_store("s3://kvc-bucket/p", colour="blue")


def test_a_store_declares_its_tier_with_a_per_kind_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto_env(monkeypatch)
    with open_store(f"file://{tmp_path / 'a'}") as store:
        assert store.tier == "local"
    with open_store(f"file://{tmp_path / 'b'}?tier=object") as store:
        assert store.tier == "object"
        # The tier is configuration, not identity: replica rows name the same store.
        assert store.name == f"file://{tmp_path / 'b'}"
    with open_store("s3://kvc-bucket/p") as store:
        assert store.tier == "object"
    with open_store("s3://kvc-bucket/p?tier=local") as store:
        assert store.tier == "local"
    with open_store(f"file://{tmp_path / 'c'}", tier="resident") as store:
        assert store.tier == "resident"


@pytest.mark.parametrize("url", ["file:///tmp/kvc-x?tier=fast", "s3://kvc-bucket?tier=Object"])
def test_a_bad_tier_is_a_store_url_error_naming_the_tiers(url: str) -> None:
    with pytest.raises(StoreURLError, match=r"tier .*expected one of resident, local, object"):
        open_store(url)


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    "url",
    [
        f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/prefix?region=us-east-1",
        f"s3://:{SECRET}@bucket/prefix",
        f"s3://{SECRET}@bucket/prefix",
        f"s3://bucket/prefix?endpoint_url=http://minio:{SECRET}@127.0.0.1:9000",
        f"file://user:{SECRET}@/tmp/x",
        f"AKIA:{SECRET}@bucket/prefix",
        f"s3://bucket/prefix?aws_secret_access_key={SECRET}",
    ],
)
def test_credentials_in_urls_are_refused_without_leaking(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreURLError) as info:
        open_store(url)
    shown = "".join(traceback.format_exception(info.value)) + repr(info.value)
    assert SECRET not in shown
    assert SECRET not in caplog.text
