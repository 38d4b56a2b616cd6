"""The weights identity is hashed once per machine: a per-machine cache keyed by each weight
file's path, size and times, shared by processes starting together, rebuilt when a file
changes or the cache file is corrupt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from restore.engines import weights
from restore.engines.identity import weights_identity

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model directory with two weight files and a config (not a weight file)."""
    path = tmp_path / "model"
    (path / "sub").mkdir(parents=True)
    (path / "model-00001.safetensors").write_bytes(os.urandom(4096))
    (path / "sub" / "model-00002.safetensors").write_bytes(os.urandom(1000))
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The model directories whose weight files were read (hashed), one entry per hashing."""
    seen: list[Path] = []
    real = weights.hash_weight_files

    def counted(root: Path, files: list[Path]) -> str:
        seen.append(root)
        return real(root, files)

    monkeypatch.setattr(weights, "hash_weight_files", counted)
    return seen


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("KVC_CACHE_DIR", str(path))
    return path


def cache_files(cache: Path) -> list[Path]:
    return sorted((cache / "weights").glob("*.json"))


def test_a_second_call_does_not_read_the_weights(model: Path, cache: Path, hashes: list[Path]) -> None:
    first = weights_identity(str(model))
    assert first.startswith("blake3:") and hashes == [model]
    assert len(cache_files(cache)) == 1
    # the cached value is the digest of the files themselves
    assert first == f"blake3:{weights.hash_weight_files(model, weights.weight_files(model))}"
    hashes.clear()
    assert weights_identity(str(model)) == first
    assert hashes == []


def test_a_touched_or_rewritten_file_is_hashed_again(model: Path, cache: Path, hashes: list[Path]) -> None:
    first = weights_identity(str(model))
    shard = model / "model-00001.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert weights_identity(str(model)) == first  # same bytes, same digest...
    assert len(hashes) == 2  # ...but read again
    # New bytes of the same size with the old modification time put back: the change
    # time moved, so it is hashed again and the identity follows the bytes.
    st = shard.stat()
    shard.write_bytes(os.urandom(4096))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = weights_identity(str(model))
    assert len(hashes) == 3 and changed != first
    # a weight file added is a different identity too
    (model / "extra.bin").write_bytes(b"x")
    assert weights_identity(str(model)) not in (first, changed)
    assert len(hashes) == 4


def test_a_corrupt_cache_file_is_ignored_and_rewritten(
    model: Path, cache: Path, hashes: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    first = weights_identity(str(model))
    [entry] = cache_files(cache)
    for garbage in (b"\x00\xffnot json", b"[1, 2]", json.dumps({"format": 1, "digest": 5}).encode()):
        entry.write_bytes(garbage)
        hashes.clear()
        assert weights_identity(str(model)) == first
        assert hashes == [model]
        assert json.loads(entry.read_text())["digest"] == first.removeprefix("blake3:")
    assert "ignoring" in caplog.text
    hashes.clear()
    assert weights_identity(str(model)) == first and hashes == []


def test_the_cache_location_follows_the_environment(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.cache_dir() == tmp_path / "xdg" / "kvc"
    weights_identity(str(model))
    assert len(list((tmp_path / "xdg" / "kvc" / "weights").glob("*.json"))) == 1
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert weights.cache_dir() == tmp_path / "home" / ".cache" / "kvc"


def test_an_unwritable_cache_still_gives_the_identity(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: list[Path]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVC_CACHE_DIR", str(blocker / "below-a-file"))
    first = weights_identity(str(model))
    assert weights_identity(str(model)) == first
    assert len(hashes) == 2  # nothing cached, nothing wrong


def steps_of(log: Path) -> list[tuple[int, str]]:
    """The (pid, step) lines weights_worker.py logged."""
    if not log.exists():
        return []
    return [(int(pid), step) for pid, step in (line.split() for line in log.read_text().splitlines())]


def test_processes_starting_together_hash_once(model: Path, cache: Path, tmp_path: Path) -> None:
    """Two processes both miss the cache; one hashes, and is held there until the other has
    missed too. The other then waits on the lock and reads the first one's result: the
    weights are read once."""
    log, release = tmp_path / "steps.log", tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVC_CACHE_DIR": str(cache)}
    script = str(Path(__file__).with_name("weights_worker.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(model), str(log), str(release)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    pids = {p.pid for p in procs}
    try:
        deadline = time.monotonic() + 60
        while True:
            steps = steps_of(log)
            if {pid for pid, step in steps if step == "miss"} == pids and any(
                step == "hash" for _pid, step in steps
            ):
                break
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, steps
            time.sleep(0.01)
        release.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [step for _pid, step in steps_of(log)].count("hash") == 1
    identities = {out.strip() for out, _err in outs}
    assert identities == {f"blake3:{weights.hash_weight_files(model, weights.weight_files(model))}"}
