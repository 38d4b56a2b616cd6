"""The recovery runbook of docs/operations.md, followed step by step with the real `kvc` CLI.

Each block quotes the runbook step it follows ("(a) 3." is procedure (a), step 3).
If a step of the runbook changes, change the block here in the same commit.
The lost-database-from-the-stores-alone procedure ((c) "without a backup") is
not here: it depends on `kvc rebuild` needing no other input.
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
from chunkstore import open_store
from chunkstore.base import DOCUMENTS_DIR
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.journal import attach_journal
from restore.pool import PagePool
from restore.restore import Restorer

MODEL = ReferenceModel.small(seed=0)
CHUNK = 32
PAGE = 16
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Site:
    """A deployment: a SQLite catalog and two stores, a local one and an object-tier copy."""

    dir: Path
    prompt: list[int]

    @property
    def catalog_db(self) -> Path:
        return self.dir / "catalog.db"

    @property
    def catalog_url(self) -> str:
        return f"sqlite:///{self.catalog_db}"

    @property
    def store_a(self) -> Path:
        return self.dir / "store-a"

    @property
    def store_b(self) -> Path:
        return self.dir / "store-b"

    @property
    def store_urls(self) -> list[str]:
        # Store b is a directory declared object tier: it gets the write-behind copies,
        # as an S3 bucket after a local store would.
        return [f"file://{self.store_a}", f"file://{self.store_b}?tier=object"]

    @property
    def env(self) -> dict[str, str]:
        return {
            "KVC_HOME": str(self.dir / "home"),
            "KVC_CATALOG_URL": self.catalog_url,
            "KVC_STORES": ",".join(self.store_urls),
        }

    def kvc(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
        env.update(self.env, PYTHONPATH=str(ROOT))
        return subprocess.run(
            [sys.executable, "-c", "from kvc.cli import main; main()", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
        )

    def kvc_json(self, *args: str, code: int = 0) -> Any:
        out = self.kvc(*args, "--json")
        assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
        return json.loads(out.stdout)

    def blobs(self, store: Path) -> list[Path]:
        return sorted(
            p
            for p in store.rglob("*")
            if p.is_file() and len(p.name) == 64 and DOCUMENTS_DIR not in p.relative_to(store).parts
        )

    def replica_states(self) -> dict[tuple[str, str], str]:
        with Catalog.open(self.catalog_url) as cat, cat.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT blob_key, location, state FROM replicas").all()
        return {(k, loc): s for k, loc, s in rows}

    def checkpoint(self, tokens: list[int], name: str) -> None:
        pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=64)
        route = pool.new_route()
        MODEL.prefill(pool, route, tokens)
        a, b = (open_store(u) for u in self.store_urls)
        with Catalog.open(self.catalog_url, upgrade=True) as cat:
            attach_journal(cat, [a, b])  # as a worker embedding kvc does (docs/restore.md)
            with Checkpointer(cat, a, chunk_size=CHUNK, write_behind=b) as cp:
                cp.checkpoint(pool, route, tokens, MODEL.fingerprint, name=name)
        a.close()
        b.close()

    def restore(self, tokens: list[int], n: int = 5) -> tuple[int, list[int], list[str]]:
        """Restore `tokens` from both stores and decode n more: (restored, tokens, logits)."""
        pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=64)
        stores = [open_store(u) for u in self.store_urls]
        with Catalog.open(self.catalog_url) as cat, Restorer(cat, stores) as r:
            res = r.restore(pool, tokens, MODEL.fingerprint)
        for s in stores:
            s.close()
        route = res.route if res.route is not None else pool.new_route()
        out, logits = MODEL.trace(pool, route, tokens[res.restored_tokens :], n)
        return res.restored_tokens, out, [blake3.blake3(x.tobytes()).hexdigest() for x in logits]


def straight(tokens: list[int], n: int = 5) -> tuple[list[int], list[str]]:
    pool = PagePool(MODEL.layout, page_size=PAGE, num_pages=64)
    out, logits = MODEL.trace(pool, pool.new_route(), tokens, n)
    return out, [blake3.blake3(x.tobytes()).hexdigest() for x in logits]


@pytest.fixture
def site(tmp_path: Path) -> Site:
    s = Site(tmp_path, np.random.default_rng(1).integers(0, MODEL.vocab_size, 100).tolist())
    s.checkpoint(s.prompt, "chat")  # 3 full chunks of 32 and a 4-token tail, in both stores
    assert len(s.blobs(s.store_a)) == len(s.blobs(s.store_b)) == 4
    assert set(s.replica_states().values()) == {"durable"}
    return s


def assert_restores_exactly(site: Site, tokens: list[int]) -> None:
    restored, out, logits = site.restore(tokens)
    assert restored == len(tokens) - 1
    assert (out, logits) == straight(tokens)


def test_a_lost_store_replica(site: Site) -> None:
    shutil.rmtree(site.store_a)  # the store's directory is lost; store b holds copies

    # (a) 1. Configure every store, the lost one (recreated empty) and the one with copies.
    assert site.kvc("stores").returncode == 0
    # (a) 2. `kvc fsck --no-repair`: see what is missing (exit 1).
    doc = site.kvc_json("fsck", "--no-repair", code=1)
    a_name = open_store(site.store_urls[0]).name
    assert {m["location"] for m in doc["missing"]} == {a_name} and len(doc["missing"]) == 4
    assert doc["repaired"] == []
    assert sum(s == "missing" for s in site.replica_states().values()) == 4
    # (a) 3. `kvc fsck`: repairs each missing replica from a verified copy (exit 1: problems found).
    doc = site.kvc_json("fsck", code=1)
    assert len(doc["repaired"]) == 4 and {r["location"] for r in doc["repaired"]} == {a_name}
    assert len(site.blobs(site.store_a)) == 4
    assert set(site.replica_states().values()) == {"durable"}
    # (a) 4. `kvc fsck --read-data`: clean (exit 0).
    doc = site.kvc_json("fsck", "--read-data")
    assert doc["clean"] and doc["ok"] == 8
    assert set(site.replica_states().values()) == {"durable"}
    # (a) 5. Restores are whole again (here: token-exact, from either store).
    assert_restores_exactly(site, site.prompt)


def test_corrupt_blobs(site: Site) -> None:
    victim = site.blobs(site.store_a)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # bit rot: same size, so only reading the data finds it
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    key = victim.name
    a_name = open_store(site.store_urls[0]).name

    # Meanwhile restores verify every blob: the bad replica is marked corrupt and the other
    # store's copy is used, so the restore is still whole and token-exact.
    assert_restores_exactly(site, site.prompt)
    assert site.replica_states()[(key, a_name)] == "corrupt"
    # Plain fsck cannot see bit rot (existence and size), but it lists what a reader marked.
    doc = site.kvc_json("fsck", "--no-repair", code=1)
    assert [(c["blob_key"], c["location"]) for c in doc["corrupt"]] == [(key, a_name)]

    # (b) 1. `kvc fsck --read-data --no-repair`: finds it (exit 1).
    doc = site.kvc_json("fsck", "--read-data", "--no-repair", code=1)
    assert [(c["blob_key"], c["location"]) for c in doc["corrupt"]] == [(key, a_name)]
    # (b) 2. `kvc fsck --read-data`: repairs it from the verified copy (exit 1: found).
    doc = site.kvc_json("fsck", "--read-data", code=1)
    assert [(r["blob_key"], r["location"]) for r in doc["repaired"]] == [(key, a_name)]
    # (b) 3. `kvc fsck --read-data` again: clean (exit 0).
    assert site.kvc_json("fsck", "--read-data")["clean"]
    assert site.replica_states()[(key, a_name)] == "durable"
    assert_restores_exactly(site, site.prompt)

    # Without a good copy anywhere, a restore degrades to the verified prefix before it.
    last = max(site.blobs(site.store_a), key=lambda p: _start(site, p.name))  # the tail
    for store in (site.store_a, site.store_b):
        path = next(p for p in site.blobs(store) if p.name == last.name)
        rot = bytearray(path.read_bytes())
        rot[len(rot) // 2] ^= 0x01
        os.chmod(path, 0o644)
        path.write_bytes(bytes(rot))
    restored, out, logits = site.restore(site.prompt)
    assert restored == 96  # the three full chunks; the tail is recomputed
    assert (out, logits) == straight(site.prompt)


def _start(site: Site, key: str) -> int:
    with Catalog.open(site.catalog_url) as cat, cat.engine.connect() as conn:
        start: int = conn.exec_driver_sql(
            "SELECT p.token_start FROM chunks c JOIN prefixes p ON p.prefix_hash = c.prefix_hash"
            " WHERE c.blob_key = ?",
            (key,),
        ).scalar_one()
    return start


def test_a_lost_database_restored_from_a_backup(site: Site) -> None:
    # Before the loss: backups taken with `kvc backup` (Backup, SQLite).
    backup = site.dir / "backups" / "catalog-1.db"
    backup.parent.mkdir()
    doc = site.kvc_json("backup", str(backup))
    assert doc["integrity"] == "ok"
    later = np.random.default_rng(2).integers(0, MODEL.vocab_size, 70).tolist()
    site.checkpoint(later, "after-the-backup")
    for suffix in ("", "-wal", "-shm"):  # the database is lost
        Path(f"{site.catalog_db}{suffix}").unlink(missing_ok=True)

    # (c) 1. Stop everything that opens the catalog (nothing runs here).
    # (c) 2. Put the backup in place of the catalog file; no -wal or -shm file may remain.
    for suffix in ("-wal", "-shm"):
        assert not Path(f"{site.catalog_db}{suffix}").exists()
    shutil.copy2(backup, site.catalog_db)
    # (c) 3. `kvc db current`: the schema is the one this kvc needs (exit 0).
    assert site.kvc_json("db", "current")["up_to_date"]
    # (c) 4. `kvc fsck`: the stores hold everything the backup names (exit 0).
    doc = site.kvc_json("fsck")
    assert doc["clean"] and doc["ok"] == 8
    # (c) 5. Restores work for what the backup holds...
    assert_restores_exactly(site, site.prompt)
    assert site.kvc_json("refs", "show", "chat")["name"] == "chat"
    # ...and what was checkpointed after the backup is not catalogued: its blobs are
    # orphans in the stores until `kvc rebuild` catalogues them again (tested with rebuild).
    restored, _, _ = site.restore(later)
    assert restored == 0
    assert len(site.blobs(site.store_a)) == 4 + 3


def test_a_lost_database_rebuilt_from_the_stores_alone(site: Site) -> None:
    head = site.kvc_json("refs", "show", "chat")["head"]
    site.kvc_json("pins", "set", "system-prompt", head[:16])  # the CLI journals it too
    for suffix in ("", "-wal", "-shm"):  # the database is lost, and no backup is recent
        Path(f"{site.catalog_db}{suffix}").unlink(missing_ok=True)

    # (c, from the stores alone) 1. Stop everything that opens the catalog (nothing runs).
    # (c) 2. Rebuild into a new, empty catalog from every store; it must exit 0.
    doc = site.kvc_json(
        "rebuild",
        "--catalog",
        site.catalog_url,
        *(arg for url in site.store_urls for arg in ("--from", url)),
    )
    assert doc["complete"] and doc["recorded"] == 4
    assert doc["journal"]["refs_added"] == ["default/chat"]
    assert doc["journal"]["pins_added"] == ["default/system-prompt"]
    # (c) 3. `kvc fsck --read-data` must exit 0.
    assert site.kvc_json("fsck", "--read-data")["clean"]
    # (c) 4. The names are as they were; restores are token-exact.
    assert [r["name"] for r in site.kvc_json("refs", "list")["refs"]] == ["chat"]
    assert site.kvc_json("refs", "show", "chat")["head"] == head
    assert [p["name"] for p in site.kvc_json("pins", "list")["pins"]] == ["system-prompt"]
    assert_restores_exactly(site, site.prompt)
