"""The digest of a local model directory's weight files, hashed once per machine.

Hashing a 70B checkpoint reads 140 GB; vLLM's scheduler and every tensor-parallel rank
derive the fingerprint at start. So the digest is kept in a per-machine cache file (one
per model directory, under `cache_dir()`), valid while every weight file keeps its
path, size, modification time, change time and inode: a file rewritten, touched, or
replaced (even with its old modification time put back, which moves the change time) is
hashed again. A file lock makes processes starting together hash once: the first hashes,
the others wait for it and read its result. The cache file is written atomically (temp
file, fsync, rename); one that cannot be read or parsed is ignored and rewritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import blake3

from catalog.identity import canonical_json

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where per-machine caches live: `$KVC_CACHE_DIR`, else `$XDG_CACHE_HOME/kvc`, else
    `~/.cache/kvc`."""
    explicit = os.environ.get("KVC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvc"


def weight_files(root: Path) -> list[Path]:
    """The weight files under a model directory, in name order (none if it is not a directory)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def hash_weight_files(root: Path, files: list[Path]) -> str:
    """blake3 hex over each file's relative name, size and bytes, in the order given."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for path in files:
        h.update(canonical_json([path.relative_to(root).as_posix(), path.stat().st_size]))
        with path.open("rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
    return h.hexdigest()


def _file_states(root: Path, files: list[Path]) -> list[list[object]]:
    """What the cache is keyed on, per file: relative name, size, mtime, ctime, inode."""
    states: list[list[object]] = []
    for path in files:
        st = path.stat()
        states.append(
            [path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        )
    return states


def _read_entry(path: Path, model: str, states: list[list[object]]) -> str | None:
    """The cached digest if `path` holds one for exactly these files, else None."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable weights cache %s: %s", path, exc)
        return None
    if not isinstance(entry, dict):
        log.warning("ignoring weights cache %s: not a JSON object", path)
        return None
    digest = entry.get("digest")
    if (
        entry.get("format") != CACHE_FORMAT
        or entry.get("model") != model
        or entry.get("files") != states
        or not isinstance(digest, str)
        or len(digest) != 64
    ):
        return None
    return digest


def _write_entry(path: Path, model: str, states: list[list[object]], digest: str) -> None:
    body = json.dumps({"format": CACHE_FORMAT, "model": model, "files": states, "digest": digest})
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if absent), released when the block ends."""
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cached_weights_digest(root: Path, files: list[Path]) -> str:
    """`hash_weight_files(root, files)`, from this machine's cache when no file changed.

    A cache directory that cannot be written is logged and the files are hashed
    (every time): the cache saves reads, it never decides an identity."""
    model = str(root.resolve())
    states = _file_states(root, files)
    directory = cache_dir() / "weights"
    entry = directory / f"{blake3.blake3(model.encode()).hexdigest()[:32]}.json"
    digest = _read_entry(entry, model, states)
    if digest is not None:
        return digest
    with contextlib.ExitStack() as held:
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            held.enter_context(_locked(entry.with_suffix(".lock")))
        except OSError as exc:
            log.warning("weights cache %s unusable (%s): hashing %s", directory, exc, model)
            return hash_weight_files(root, files)
        digest = _read_entry(entry, model, states)  # another process may have hashed meanwhile
        if digest is not None:
            return digest
        digest = hash_weight_files(root, files)
        if _file_states(root, files) != states:  # changed while read: do not vouch for it
            log.warning("weight files of %s changed while hashed: not cached", model)
            return digest
        try:
            _write_entry(entry, model, states, digest)
        except OSError as exc:
            log.warning("could not write weights cache %s: %s", entry, exc)
        return digest
