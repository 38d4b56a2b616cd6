"""Rebuild: a lost catalog comes back from blob headers, and restores stay bit-identical.

More (several stores, descriptors, dry run, conflicts, S3 and PostgreSQL): tests/maintenance/test_recovery.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.base import DOCUMENTS_DIR
from maintenance.rebuild import rebuild
from restore import Checkpointer, PagePool, Restorer
from restore.engines.reference import ReferenceModel

PAGE = 16
CHUNK = 32
MODEL = ReferenceModel.small(seed=0)
FPS = {MODEL.fingerprint.hex: MODEL.fingerprint}
CLI = "from kvc.cli import cli; from kvc.commands import rebuild; rebuild.register(cli); cli(prog_name='kvc')"


def prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, MODEL.vocab_size, n)]


P = prompt(100)
Q = [*P[:70], *prompt(30, seed=2)]  # shares P's first two chunks, diverges inside the third


def digest(x: np.ndarray[Any, Any]) -> str:
    return blake3.blake3(x.tobytes()).hexdigest()


def resume(pool: PagePool, route: int, rest: list[int], n: int) -> tuple[list[int], list[str]]:
    out, logits = MODEL.trace(pool, route, rest, n)
    return out, [digest(x) for x in logits]


def straight(tokens: list[int], n: int) -> tuple[list[int], list[str]]:
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    return resume(pool, pool.new_route(), tokens, n)


@dataclass
class Lost:
    """A store whose catalog was deleted; `keys` are P's chunk blob keys, in order."""

    store: ChunkStore
    store_url: str
    keys: list[str]
    tmp: Path

    def fresh_catalog(self, name: str = "new.db") -> Catalog:
        return Catalog.open(f"sqlite:///{self.tmp / name}", upgrade=True)


@pytest.fixture
def lost(tmp_path: Path) -> Any:
    db = tmp_path / "c.db"
    store_url = f"file://{tmp_path / 'blobs'}"
    store = open_store(store_url)
    with Catalog.open(f"sqlite:///{db}", upgrade=True) as cat:
        with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
            for toks in (P, Q):
                pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
                route = pool.new_route()
                MODEL.prefill(pool, route, toks)
                cp.checkpoint(pool, route, toks, MODEL.fingerprint, name=f"c{len(toks)}")
        keys = [c.blob_key for c in cat.lookup("default", MODEL.fingerprint, P).chunks]
    db.unlink()  # the catalog is lost; the blobs remain
    yield Lost(store, store_url, keys, tmp_path)
    store.close()


def strip_descriptors(lost: Lost) -> None:
    """Make the store look like one written before stores kept fingerprint descriptors."""
    shutil.rmtree(lost.tmp / "blobs" / DOCUMENTS_DIR)
    assert not list(lost.store.documents())


def corrupt(store: ChunkStore, key: str) -> None:
    path = store.path_of(key)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def test_rebuilt_catalog_restores_bit_identically(lost: Lost) -> None:
    with lost.fresh_catalog() as cat:
        seen: list[tuple[str, int, int | None]] = []
        report = rebuild(
            cat, lost.store, fingerprints=FPS, progress=lambda s, d, t: seen.append((s, d, t))
        )
        assert report.complete, report.to_dict()
        assert report.blobs == 6 and report.recorded == 6  # 4 chunks of P, 2 of Q's own
        assert report.namespaces == {"default": CHUNK}
        assert ("rebuild read", 6, 6) in seen and seen[-1] == ("rebuild record", 6, 6)
        for toks in (P, Q):
            pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
            with Restorer(cat, [lost.store]) as r:
                res = r.restore(pool, toks, MODEL.fingerprint)
            assert res.restored_tokens == 99 and res.route is not None
            assert resume(pool, res.route, toks[99:], 5) == straight(toks, 5)


def test_rebuilding_twice_changes_nothing(lost: Lost) -> None:
    with lost.fresh_catalog() as cat:
        first = rebuild(cat, lost.store, fingerprints=FPS)
        stats = cat.stats()
        # The descriptor is now catalogued, so it need not be given again.
        second = rebuild(cat, lost.store)
        assert (first.recorded, second.recorded) == (6, 0)
        assert second.already_present == 6 and second.replicas_added == 0
        assert second.complete and cat.stats() == stats


def test_corrupt_blob_is_skipped_and_its_descendants_are_orphans(lost: Lost) -> None:
    bad = lost.keys[1]  # tokens 32..64, shared by P and Q
    corrupt(lost.store, bad)
    with lost.fresh_catalog() as cat:
        report = rebuild(cat, lost.store, fingerprints=FPS)
        assert list(report.corrupt) == [bad] and report.lost == [bad]
        assert len(report.orphans) == 4  # P's and Q's chunks past token 64
        assert report.recorded == 1 and not report.complete
        assert cat.lookup("default", MODEL.fingerprint, P).matched_tokens == CHUNK
        # Headers alone do not see the payload damage: the chunk is catalogued.
        unverified = rebuild(cat, lost.store, verify=False)
        assert unverified.recorded == 5 and unverified.complete


def test_unknown_fingerprint_is_reported_not_guessed(lost: Lost) -> None:
    strip_descriptors(lost)  # an older store: its blobs name a fingerprint nothing describes
    with lost.fresh_catalog() as cat:
        report = rebuild(cat, lost.store)
        assert report.unknown_fingerprints == {MODEL.fingerprint.hex: 6}
        assert report.recorded == 0 and not report.complete
        assert cat.get_fingerprint(MODEL.fingerprint.hex) is None
        # Given as a fingerprint file (as before stores kept descriptors), it rebuilds.
        given = rebuild(cat, lost.store, fingerprints=FPS)
        assert given.recorded == 6 and given.complete
        assert given.fingerprints_added == [MODEL.fingerprint.hex]


def run_cli(lost: Lost, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=lost.tmp,
        env={**os.environ, "KVC_HOME": str(lost.tmp / "home")},
    )


def test_cli_rebuilds_with_json_and_exit_codes(lost: Lost) -> None:
    fp_file = lost.tmp / "fingerprints.jsonl"
    fp_file.write_text(MODEL.fingerprint.canonical.decode() + "\n")
    target = f"sqlite:///{lost.tmp / 'cli.db'}"
    base = ["rebuild", "--from", lost.store_url, "--catalog", target, "--json"]

    out = run_cli(lost, *base, "--fingerprint-file", str(fp_file))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["recorded"] == 6 and doc["complete"] and doc["skipped"] == 0
    assert "refs" in doc["not_recovered"] and doc["stores"] == [lost.store_url]
    with Catalog.open(target) as cat:
        assert cat.lookup("default", MODEL.fingerprint, P).matched_tokens == 99

    strip_descriptors(lost)  # an older store: without --fingerprint-file nothing is known
    other = run_cli(
        lost,
        "rebuild",
        "--from",
        lost.store_url,
        "--catalog",
        f"sqlite:///{lost.tmp / 'x.db'}",
        "--json",
    )
    assert other.returncode == 1
    assert json.loads(other.stdout)["unknown_fingerprints"] == {MODEL.fingerprint.hex: 6}

    bad = lost.tmp / "bad.json"
    bad.write_text('[{"weights": "x"}]')
    usage = run_cli(lost, *base, "--fingerprint-file", str(bad))
    assert usage.returncode == 2 and "kvc: error:" in usage.stderr
    assert run_cli(lost, "rebuild", "--from", "ftp://nope", "--catalog", target).returncode == 2

    helped = run_cli(lost, "rebuild", "--help")
    assert helped.returncode == 0 and "Example" in helped.stdout
