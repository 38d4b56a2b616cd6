"""The local-directory chunk store: sharded files, atomic durable writes, mmap reads."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from typing_extensions import Buffer

from chunkstore.base import (
    DOCUMENTS_DIR,
    BlobStat,
    ChunkStore,
    Receipt,
    Tier,
    parse_tier,
    validate_document_name,
    validate_key,
)
from chunkstore.errors import (
    BlobNotFoundError,
    ChunkIntegrityError,
    StoreUnavailableError,
    StoreURLError,
    StoreWriteError,
)
from chunkstore.record import blake3_hex

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
"""Temporary files are `<shard dir>/.tmp-<key>-<uuid hex>`; never listed, swept when stale."""

DEFAULT_TEMP_GRACE_S = 3600.0
DEFAULT_REFRESH_AFTER_S = 900.0

# Blobs are read-only files: an in-place write would show through every live
# mmap of the blob (and a truncation would SIGBUS its readers).
_BLOB_MODE = 0o444


def check_content_address(key: str, data: Buffer) -> None:
    """Raise `ChunkIntegrityError` unless `data` hashes to `key`."""
    actual = blake3_hex(data)
    if actual != key:
        raise ChunkIntegrityError(
            f"refusing to store blob under key {key}: its bytes hash to {actual}"
        )


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(ChunkStore):
    """Blobs as files `root/<key[:2]>/<key[2:4]>/<key>` in a local directory.

    A put writes a temporary file in the blob's directory, fsyncs it, renames
    it into place and fsyncs the directory, so a crash leaves either the whole
    blob or nothing visible (plus a temp file that `sweep_temp` removes).
    Opening the store sweeps temp files older than `temp_grace_s` once.
    `get` returns a read-only `memoryview` over an mmap of the file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        refresh_after_s: float = DEFAULT_REFRESH_AFTER_S,
        temp_grace_s: float = DEFAULT_TEMP_GRACE_S,
        tier: Tier = "local",
    ) -> None:
        self._tier = parse_tier(tier)
        path = Path(root)
        if not path.is_absolute():
            raise StoreURLError(f"local store root must be an absolute path, got {str(root)!r}")
        self._root = Path(os.path.normpath(path))
        self._root_prefix = os.path.join(self._root, "")
        self._name = "file://" + urllib.parse.quote(str(self._root))
        self.refresh_after_s = refresh_after_s
        self.temp_grace_s = temp_grace_s
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreURLError(f"{self._name}: the store root is not a directory") from None
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: cannot create the store root: {exc.strerror}"
            ) from exc
        self.sweep_temp(temp_grace_s)

    @property
    def name(self) -> str:
        return self._name

    @property
    def tier(self) -> Tier:
        return self._tier

    @property
    def root(self) -> Path:
        """The directory holding the shard tree."""
        return self._root

    def __repr__(self) -> str:
        return f"LocalStore({self._name!r})"

    def path_of(self, key: str) -> Path:
        """Where the blob `key` lives (whether or not it exists)."""
        return Path(self._file_of(key))

    def _file_of(self, key: str) -> str:
        """`path_of` as a string: what a read opens (pathlib costs more than the open)."""
        key = validate_key(key)
        return f"{self._root_prefix}{key[:2]}/{key[2:4]}/{key}"

    def _receipt(self, key: str, st: os.stat_result) -> Receipt:
        return Receipt(
            store=self._name,
            key=key,
            size=st.st_size,
            checksum=f"blake3:{key}",
            stored_at=_utc(st.st_mtime),
        )

    def put(self, key: str, data: Buffer) -> Receipt:
        key = validate_key(key)
        view = memoryview(data).cast("B")
        check_content_address(key, view)
        return self._put(key, view)

    def put_hashed(self, key: str, data: Buffer) -> Receipt:
        return self._put(validate_key(key), memoryview(data).cast("B"))

    def _put(self, key: str, view: memoryview) -> Receipt:
        final = self.path_of(key)
        try:
            st = final.stat()
        except FileNotFoundError:
            pass
        else:
            if st.st_size == view.nbytes:
                held = self._hashes_to(final, key)
                if held:
                    fresh = self._refresh_if_stale(final, st)
                    if fresh is not None:
                        return self._receipt(key, fresh)
                # Deleted (by GC) between stat and refresh: write it again.
                if held is False:
                    # Never a receipt for bytes that are not the key's: a corrupt replica
                    # would be marked durable again. The right bytes are in hand.
                    logger.warning(
                        "%s: blob %s on disk does not hash to its key; rewriting it",
                        self._name,
                        key,
                    )
            else:
                # The right bytes are in hand (just verified), so replacing
                # the wrong ones repairs the store rather than hiding anything.
                logger.warning(
                    "%s: blob %s has %d bytes on disk, expected %d; rewriting it",
                    self._name,
                    key,
                    st.st_size,
                    view.nbytes,
                )
        created = self._make_shard_dirs(key)
        tmp = final.parent / f"{TEMP_PREFIX}{key}-{uuid.uuid4().hex}"
        try:
            _write_synced(tmp, view)
            os.rename(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreWriteError(
                f"{self._name}: put of blob {key} did not land: {exc.strerror or exc}"
            ) from exc
        try:
            _fsync_entry(final, created)
            st = final.stat()
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: blob {key} was written but making it durable failed "
                f"({exc.strerror or exc}); outcome unknown"
            ) from exc
        logger.debug("%s: stored blob %s (%d bytes)", self._name, key, st.st_size)
        return self._receipt(key, st)

    def _make_shard_dirs(self, key: str) -> list[Path]:
        created: list[Path] = []
        for d in (self._root / key[:2], self._root / key[:2] / key[2:4]):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise StoreWriteError(
                    f"{self._name}: put of blob {key} did not land: cannot create {d.name}/: "
                    f"{exc.strerror or exc}"
                ) from exc
            created.append(d)
        return created

    def _hashes_to(self, path: Path, key: str) -> bool | None:
        """Whether the file at `path` hashes to `key`; None if it is gone (GC deleted it)."""
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return blake3_hex(b"") == key
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    return blake3_hex(m) == key
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: cannot read blob {key} to verify it: {exc.strerror or exc}"
            ) from exc

    def _refresh_if_stale(self, path: Path, st: os.stat_result) -> os.stat_result | None:
        # A publish reusing existing bytes must refresh them, so that GC's
        # orphan grace period (which must exceed refresh_after_s) never
        # deletes bytes a concurrent publish is about to catalogue.
        if time.time() - st.st_mtime < self.refresh_after_s:
            return st
        try:
            os.utime(path)
            return path.stat()
        except FileNotFoundError:
            return None

    def get(self, key: str) -> Buffer:
        """The blob as a read-only `memoryview` over an mmap (released when the view is)."""
        path = self._file_of(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return memoryview(b"")  # mmap cannot map an empty file
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self._name}: no blob {key}") from None
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: get of blob {key} failed: {exc.strerror or exc}"
            ) from exc
        return memoryview(mm)

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def stat(self, key: str) -> BlobStat:
        path = self.path_of(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self._name}: no blob {key}") from None
        return BlobStat(size=st.st_size, mtime=_utc(st.st_mtime))

    def touch(self, key: str) -> None:
        """Set the blob's mtime to now (GC's grace period counts from it)."""
        path = self.path_of(key)
        try:
            os.utime(path)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self._name}: no blob {key}") from None

    def delete(self, key: str) -> None:
        # No directory fsync: a delete lost in a crash leaves an orphan that GC
        # deletes again, which is harmless.
        path = self.path_of(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _temp_dirs(self) -> Iterator[Path]:
        """Every directory a writer puts temp files in: the shards and the documents tree."""
        yield from self._shard_dirs()
        for dirpath, _, _ in os.walk(self._root / DOCUMENTS_DIR):
            yield Path(dirpath)

    def _shard_dirs(self) -> Iterator[Path]:
        for top in _subdirs(self._root):
            yield from _subdirs(top)

    def keys(self) -> Iterator[str]:
        for shard in self._shard_dirs():
            prefix = shard.parent.name + shard.name
            for entry in _entries(shard):
                name = entry.name
                if name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    try:
                        yield validate_key(name)
                    except ValueError:
                        continue

    # -- documents -------------------------------------------------------------------

    def _document_path(self, name: str) -> Path:
        return self._root / DOCUMENTS_DIR / validate_document_name(name)

    def put_document(self, name: str, data: bytes) -> bool:
        final = self._document_path(name)
        if final.exists():
            return False
        created: list[Path] = []
        for d in reversed(final.parents):
            if d == self._root or self._root not in d.parents:
                continue
            try:
                d.mkdir()
                created.append(d)
            except FileExistsError:
                continue
            except OSError as exc:
                raise StoreWriteError(
                    f"{self._name}: put of document {name} did not land: {exc.strerror or exc}"
                ) from exc
        tmp = final.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            _write_synced(tmp, memoryview(data))
            try:
                os.link(tmp, final)  # never replaces: the first document under a name wins
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreWriteError(
                f"{self._name}: put of document {name} did not land: {exc.strerror or exc}"
            ) from exc
        try:
            _fsync_entry(final, created)
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: document {name} was written but making it durable failed "
                f"({exc.strerror or exc}); outcome unknown"
            ) from exc
        return True

    def get_document(self, name: str) -> bytes:
        path = self._document_path(name)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFoundError(f"{self._name}: no document {name}") from None
        except OSError as exc:
            raise StoreUnavailableError(
                f"{self._name}: get of document {name} failed: {exc.strerror or exc}"
            ) from exc

    def documents(self, prefix: str = "") -> Iterator[str]:
        top = self._root / DOCUMENTS_DIR
        names: list[str] = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            rel = os.path.relpath(dirpath, top)
            for f in filenames:
                if f.startswith(TEMP_PREFIX):
                    continue
                name = f if rel == "." else f"{rel}/{f}"
                if name.startswith(prefix):
                    names.append(name)
        yield from sorted(names)

    def sweep_temp(self, older_than_s: float = DEFAULT_TEMP_GRACE_S) -> int:
        """Remove temp files not modified for `older_than_s` seconds; return how many.

        A live writer's temp file is younger than any sensible threshold, so
        it survives; only files left by crashed writers go.
        """
        cutoff = time.time() - older_than_s
        removed = 0
        for directory in self._temp_dirs():
            for entry in _entries(directory):
                if not entry.name.startswith(TEMP_PREFIX):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    continue  # its writer renamed or removed it meanwhile
        if removed:
            logger.info("%s: swept %d stale temp file(s)", self._name, removed)
        return removed


def _write_synced(path: Path, data: memoryview) -> None:
    """Write `data` to the new file `path` (read-only) and fsync it; OSError on failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _BLOB_MODE)
    try:
        written = 0
        while written < data.nbytes:
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_entry(path: Path, created: list[Path]) -> None:
    """Make `path`'s new directory entry durable: a rename or link is durable only once its
    directory is, and directories created for it need their own entries made durable."""
    _fsync_dir(path.parent)
    for d in created:
        _fsync_dir(d.parent)


def _hex2(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []


def _subdirs(directory: Path) -> Iterator[Path]:
    for entry in _entries(directory):
        if _hex2(entry.name) and entry.is_dir(follow_symlinks=False):
            yield Path(entry.path)
