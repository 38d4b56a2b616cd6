"""Disaster recovery: a catalog comes back from the stores alone (descriptors kept in the stores).

Checkpoint, drop the database, rebuild with nothing but the store URLs, restore in
a new process: bit-identical, on local and S3 stores with SQLite and PostgreSQL.
Also: several stores merged, tampered descriptors refused, dry runs, conflicts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import sqlalchemy as sa

from catalog.catalog import Catalog
from chunkstore import ChunkStore, open_store
from chunkstore.base import DOCUMENTS_DIR
from maintenance.rebuild import rebuild
from restore import Checkpointer, PagePool, Restorer
from restore.descriptors import descriptor_name, load_descriptors, read_descriptor
from restore.engines.reference import ReferenceModel
from tests.resume_worker import resume_in_new_process

SEED = 0
PAGE = 16
CHUNK = 32
ROOT = Path(__file__).resolve().parents[2]
MODEL = ReferenceModel.small(seed=SEED)
FP = MODEL.fingerprint
CLI = "from kvc.cli import cli; from kvc.commands import rebuild; rebuild.register(cli); cli(prog_name='kvc')"


def prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, MODEL.vocab_size, n)]


P = prompt(100)
Q = [*P[:70], *prompt(30, seed=2)]  # shares P's first two chunks, diverges inside the third
R = prompt(64, seed=3)  # two full chunks of its own


def digest(x: np.ndarray[Any, Any]) -> str:
    return blake3.blake3(x.tobytes()).hexdigest()


def resume(pool: PagePool, route: int, rest: list[int], n: int) -> tuple[list[int], list[str]]:
    out, logits = MODEL.trace(pool, route, rest, n)
    return out, [digest(x) for x in logits]


def straight(tokens: list[int], n: int) -> tuple[list[int], list[str]]:
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
    return resume(pool, pool.new_route(), tokens, n)


def checkpoint(
    cat: Catalog,
    store: ChunkStore,
    prompts: list[list[int]],
    write_behind: ChunkStore | None = None,
    codec: str = "raw",
) -> None:
    with Checkpointer(cat, store, chunk_size=CHUNK, write_behind=write_behind, codec=codec) as cp:
        for toks in prompts:
            pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
            route = pool.new_route()
            MODEL.prefill(pool, route, toks)
            cp.checkpoint(pool, route, toks, FP, name=f"c{len(toks)}")


def drop_database(url: str) -> None:
    """Lose the catalog: delete the SQLite file, or drop every table of the PostgreSQL database."""
    if url.startswith("sqlite"):
        Path(sa.make_url(url).database or "").unlink()
        return
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()


def restore_in_new_process(catalog_url: str, store_urls: list[str], toks: list[int]) -> Any:
    args = {
        "seed": SEED,
        "page_size": PAGE,
        "catalog": catalog_url,
        "stores": store_urls,
        "namespace": "default",
        "prompt": toks,
        "n": 6,
    }
    return resume_in_new_process(args)


def run_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env={**os.environ, "KVC_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)},
    )


# -- (a) checkpoint, drop the database, rebuild from the store URLs only, restore elsewhere --


@pytest.fixture(
    params=[("sqlite", "local"), ("sqlite", "s3"), ("postgres", "local"), ("postgres", "s3")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def setting(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    db, kind = request.param
    url = (
        f"sqlite:///{tmp_path / 'catalog.db'}"
        if db == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    return url, kind if kind == "local" else request.getfixturevalue("s3_url")


def test_dropped_catalog_rebuilt_from_the_store_alone_restores_bit_identically(
    setting: tuple[str, str], tmp_path: Path
) -> None:
    catalog_url, kind = setting
    local_url = f"file://{tmp_path / 'blobs'}"
    local = open_store(local_url)
    remote = None if kind == "local" else open_store(kind)
    source_url = local_url if remote is None else kind
    with Catalog.open(catalog_url, upgrade=True) as cat:
        # With S3 the blobs go there by write-behind: the uploads carry the descriptor too.
        checkpoint(cat, local, [P, Q], write_behind=remote)
        want = {h: cat.lookup("default", FP, t).chunks for h, t in (("P", P), ("Q", Q))}
    drop_database(catalog_url)
    source = local if remote is None else remote  # with S3 the local disk is lost as well
    with Catalog.open(catalog_url, upgrade=True) as cat:
        assert cat.get_fingerprint(FP.hex) is None and cat.stats()["chunks"] == 0
        report = rebuild(cat, source)  # nothing but the store
        assert report.complete, report.to_dict()
        assert (report.recorded, report.descriptors) == (6, 1)
        assert report.fingerprints_added == [FP.hex] and report.namespaces == {"default": CHUNK}
        for h, t in (("P", P), ("Q", Q)):
            got = cat.lookup("default", FP, t).chunks
            assert [c.blob_key for c in got] == [c.blob_key for c in want[h]]
            assert {r.location for c in got for r in c.replicas} == {source.name}
            assert {r.tier for c in got for r in c.replicas} == {source.tier}
    for toks in (P, Q):
        got = restore_in_new_process(catalog_url, [source_url], toks)
        assert got["restored"] == 99
        assert (got["tokens"], got["logits"]) == straight(toks, 6)
    local.close()
    if remote is not None:
        remote.close()


# -- several stores, each holding a part ------------------------------------------------


@dataclass
class Parts:
    """A: P's and R's chunks; B (tier object): P's (write-behind) and Q's own. Catalog lost."""

    a: ChunkStore
    b: ChunkStore
    a_url: str
    b_url: str
    tmp: Path

    def fresh(self, name: str = "new.db") -> Catalog:
        return Catalog.open(f"sqlite:///{self.tmp / name}", upgrade=True)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    a_url, b_url = f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}?tier=object"
    a, b = open_store(a_url), open_store(b_url)
    db = tmp_path / "lost.db"
    with Catalog.open(f"sqlite:///{db}", upgrade=True) as cat:
        checkpoint(cat, a, [P], write_behind=b)
        checkpoint(cat, b, [Q])  # only Q's own two chunks: the shared ones are catalogued
        checkpoint(cat, a, [R])
    db.unlink()
    assert (len(list(a.keys())), len(list(b.keys()))) == (6, 6)
    yield Parts(a, b, a_url, b_url, tmp_path)
    a.close()
    b.close()


def replicas(cat: Catalog, toks: list[int]) -> list[set[tuple[str, str]]]:
    return [
        {(r.location, r.tier) for r in c.replicas} for c in cat.lookup("default", FP, toks).chunks
    ]


def test_stores_are_merged_one_chunk_each_one_replica_per_store(parts: Parts) -> None:
    a, b = (parts.a.name, "local"), (parts.b.name, "object")
    with parts.fresh() as cat:
        report = rebuild(cat, [parts.a, parts.b])
        assert report.complete, report.to_dict()
        assert report.blobs == 8 and report.copies == {parts.a.name: 6, parts.b.name: 6}
        assert (report.recorded, report.replicas_added) == (8, 12)
        assert replicas(cat, P) == [{a, b}] * 4
        assert replicas(cat, Q) == [{a, b}] * 2 + [{b}] * 2  # Q's own chunks are only in B
        assert replicas(cat, R) == [{a}] * 2
        for toks in (P, Q, R):
            pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=256)
            with Restorer(cat, [parts.a, parts.b]) as r:
                res = r.restore(pool, toks, FP)
            assert res.restored_tokens == len(toks) - 1 and res.route is not None
            assert resume(pool, res.route, toks[-1:], 5) == straight(toks, 5)


def test_stores_one_after_the_other_add_only_what_is_missing(parts: Parts) -> None:
    with parts.fresh() as cat:
        first = rebuild(cat, parts.a)
        assert first.recorded == 6
        # Every checkpoint journaled its ref to every store the catalog had been handed, so
        # A's journal names Q's ref, whose head only B holds: unresolved until B is read.
        assert not first.complete and first.journal.unresolved
        assert first.journal.unresolved == [f"ref default/c{len(Q)}"]
        # Q's own chunks are only in B: its lookup stops inside P's third chunk.
        assert cat.lookup("default", FP, Q).matched_tokens == 70
        second = rebuild(cat, parts.b)
        assert (second.recorded, second.already_present, second.replicas_added) == (2, 4, 6)
        assert second.fingerprints_added == [] and second.namespaces_added == []
        assert cat.lookup("default", FP, Q).matched_tokens == 99
        assert second.complete, second.to_dict()


def test_a_copy_corrupt_in_one_store_is_reported_the_good_copy_is_used(parts: Parts) -> None:
    key = sorted(set(parts.a.keys()) & set(parts.b.keys()))[0]
    path = parts.b.path_of(key)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with parts.fresh() as cat:
        report = rebuild(cat, [parts.a, parts.b])
        assert list(report.corrupt) == [key] and list(report.corrupt[key]) == [parts.b.name]
        assert report.lost == [] and report.skipped == 0 and not report.complete
        assert report.recorded == 8 and report.replicas_added == 11  # no replica for the bad copy


# -- descriptors: verified, a tampered one refused ----------------------------------------


def descriptor_path(store_root: Path, hex_: str) -> Path:
    return store_root / DOCUMENTS_DIR / descriptor_name(hex_)


def test_every_store_a_blob_goes_to_holds_its_verified_descriptor(parts: Parts) -> None:
    for store in (parts.a, parts.b):
        assert list(store.documents("fingerprints/")) == [descriptor_name(FP.hex)]
        assert read_descriptor(store, FP.hex) == FP
        assert store.get_document(descriptor_name(FP.hex)) == FP.canonical
        assert blake3.blake3(FP.canonical).hexdigest() == FP.hex


def test_tampered_descriptor_is_refused_and_its_chunks_are_unknown(parts: Parts) -> None:
    path = descriptor_path(parts.tmp / "a", FP.hex)
    os.chmod(path, 0o644)
    path.write_bytes(path.read_bytes().replace(b'"format":1', b'"format":2'))
    # A valid descriptor under another fingerprint's name is refused too.
    other = "0" * 64
    parts.a.put_document(descriptor_name(other), FP.canonical)
    loaded = load_descriptors([parts.a])
    assert loaded.found == {}
    assert set(loaded.rejected) == {
        f"{parts.a.name} {descriptor_name(FP.hex)}",
        f"{parts.a.name} {descriptor_name(other)}",
    }
    with parts.fresh() as cat:
        report = rebuild(cat, parts.a)
        assert len(report.rejected_descriptors) == 2 and not report.complete
        assert report.unknown_fingerprints == {FP.hex: 6} and report.recorded == 0
        assert cat.get_fingerprint(FP.hex) is None and cat.stats()["chunks"] == 0
        assert cat.namespace_chunk_size("default") is None  # nothing wrong recorded
        # B's good copy of the descriptor is enough; A's bad one is still reported.
        both = rebuild(cat, [parts.a, parts.b])
        assert both.recorded == 8 and both.unknown_fingerprints == {}
        assert len(both.rejected_descriptors) == 2 and not both.complete


# -- dry run --------------------------------------------------------------------------------


def test_dry_run_writes_nothing_and_predicts_the_real_run(parts: Parts) -> None:
    with parts.fresh() as cat:
        rebuild(cat, parts.a)
        stats, events = cat.stats(), cat.events()
        dry = rebuild(cat, [parts.a, parts.b], dry_run=True)
        assert cat.stats() == stats and cat.events() == events
        assert dry.dry_run and (dry.recorded, dry.already_present, dry.replicas_added) == (2, 6, 6)
        real = rebuild(cat, [parts.a, parts.b])
        assert {**dry.to_dict(), "dry_run": False} == real.to_dict()
    nothing = rebuild(None, [parts.a, parts.b], dry_run=True)  # no catalog at all yet
    assert (nothing.recorded, nothing.replicas_added) == (8, 12)
    assert nothing.namespaces_added == ["default"] and nothing.fingerprints_added == [FP.hex]
    with pytest.raises(ValueError):
        rebuild(None, parts.a)


# -- a catalog that has data ------------------------------------------------------------------


def test_catalog_that_has_everything_gets_nothing_new(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path / 'blobs'}")
    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True) as cat:
        checkpoint(cat, store, [P, Q])
        stats = cat.stats()
        report = rebuild(cat, store)
        assert (report.recorded, report.already_present, report.replicas_added) == (0, 6, 0)
        assert report.complete and report.fingerprints_added == [] and cat.stats() == stats
    store.close()


def test_conflicting_blob_is_reported_and_the_catalogs_is_kept(tmp_path: Path) -> None:
    a = open_store(f"file://{tmp_path / 'a'}")
    b = open_store(f"file://{tmp_path / 'b'}")
    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True) as cat:
        checkpoint(cat, a, [P])
        with Catalog.open(f"sqlite:///{tmp_path / 'other.db'}", upgrade=True) as other:
            checkpoint(other, b, [P], codec="zstd")  # the same chunks, other bytes, later
        kept = [c.blob_key for c in cat.lookup("default", FP, P).chunks]
        rejected = sorted(b.keys())
        assert not set(kept) & set(rejected)
        stats = cat.stats()
        report = rebuild(cat, b)
        assert report.recorded == 0 and report.replicas_added == 0 and not report.complete
        assert sorted(c.rejected for c in report.conflicts) == rejected
        assert {c.kept for c in report.conflicts} == set(kept)
        assert all(c.stores == (b.name,) for c in report.conflicts)
        assert [c.blob_key for c in cat.lookup("default", FP, P).chunks] == kept
        assert cat.replicas_at(b.name) == [] and cat.stats() == stats
    with Catalog.open(f"sqlite:///{tmp_path / 'new.db'}", upgrade=True) as cat:
        # Both stores into an empty catalog: one chunk each, the blob stored first kept.
        both = rebuild(cat, [a, b])
        assert both.recorded == 4 and len(both.conflicts) == 4
        assert [c.blob_key for c in cat.lookup("default", FP, P).chunks] == kept
    a.close()
    b.close()


# -- the command line -----------------------------------------------------------------------


def test_cli_several_stores_json_and_dry_run(parts: Parts) -> None:
    db = parts.tmp / "cli.db"
    target = f"sqlite:///{db}"
    base = ["rebuild", "--from", parts.a_url, "--from", parts.b_url, "--catalog", target, "--json"]

    dry = run_cli(parts.tmp, *base, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["dry_run"] and doc["recorded"] == 8 and doc["replicas_added"] == 12
    assert doc["stores"] == [parts.a.name, parts.b.name] and doc["complete"]
    assert not db.exists()  # a dry run creates no catalog

    text = run_cli(parts.tmp, *base[:-1], "--dry-run")
    assert text.returncode == 0 and "dry run: nothing was written" in text.stdout

    real = run_cli(parts.tmp, *base)
    assert real.returncode == 0, real.stderr
    doc = json.loads(real.stdout)
    assert not doc["dry_run"] and doc["recorded"] == 8 and doc["fingerprints_added"] == [FP.hex]
    assert "journal" in doc["not_recovered"]
    with Catalog.open(target) as cat:
        assert cat.lookup("default", FP, Q).matched_tokens == 99
        stats = cat.stats()

    again = run_cli(parts.tmp, *base, "--dry-run")
    doc = json.loads(again.stdout)
    assert again.returncode == 0 and (doc["recorded"], doc["already_present"]) == (0, 8)
    with Catalog.open(target) as cat:
        assert cat.stats() == stats

    twice = run_cli(parts.tmp, "rebuild", "--from", parts.a_url, "--from", parts.a_url)
    assert twice.returncode == 2 and "twice" in twice.stderr


def test_fsck_repair_into_a_store_also_restores_its_descriptor(tmp_path: Path) -> None:
    from maintenance.fsck import fsck

    a = open_store(f"file://{tmp_path / 'a'}")
    b = open_store(f"file://{tmp_path / 'b'}?tier=object")
    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True) as cat:
        checkpoint(cat, a, [R], write_behind=b)
        shutil.rmtree(tmp_path / "b")  # the object store lost everything, documents included
        b = open_store(f"file://{tmp_path / 'b'}?tier=object")
        report = fsck(cat, [a, b])
        assert len(report.repaired) == 2
    assert read_descriptor(b, FP.hex) == FP  # B describes its blobs again
    a.close()
    b.close()
