"""Eight processes on one PostgreSQL catalog and one store for a bounded time: overlapping
publishes and restores, ref forks, moves and deletes, and `kvc gc` every couple of
seconds with a short age limit and grace period.

Afterwards: no unexpected error in any process, every restore matched a fresh prefill,
no duplicate rows, nothing left half-purged, `kvc fsck --read-data` clean, and every
ref restores token-exact from its lineage. CI runs 20 s; the long run is

    KVC_CONCURRENCY_SECONDS=300 .venv/bin/python -m pytest tests/restore/test_concurrency.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from catalog import Catalog
from chunkstore import open_store
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ReferenceModel.small(seed=0)
ROLES = ["gc", "refs", "refs", "work", "work", "work", "work", "work"]


def kvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "kvc"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVC_")},
    )


@pytest.mark.slow
def test_eight_processes_with_gc_racing_publishes(postgres_url: str, tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVC_CONCURRENCY_SECONDS", "20"))
    # refresh_after_s=1 keeps a reused blob younger than the 3 s grace period.
    store_url = f"file://{tmp_path / 'blobs'}?refresh_after_s=1"
    Catalog.open(postgres_url, upgrade=True).close()
    common = {
        "catalog": postgres_url,
        "store": store_url,
        "seconds": seconds,
        "max_age_s": 2,
        "grace_s": 3,
        "gc_every_s": 1.5,
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.restore.concurrency_worker",
                json.dumps({**common, "role": role, "id": i}),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, role in enumerate(ROLES)
    ]
    reports: list[dict[str, Any]] = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 240)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    total: Counter[str] = Counter()
    for r in reports:
        assert r["unexpected"] == [], f"worker {r['id']} ({r['role']}): {r['unexpected']}"
        total.update(r["counts"])
    print(json.dumps(dict(sorted(total.items())), indent=1))
    # It did race: everything ran, GC more than a few times, restores were verified.
    # Each worker goes on until it has done its share of these (see `done` in the worker).
    assert total["gc"] >= 3 and total["publish"] >= 20 and total["verified"] >= 20
    assert total["fork"] + total["move_ref"] + total["delete_ref"] + total["create_ref"] >= 10
    assert total["pin"] >= 6 and total["unpin"] >= 2 and total["keep"] == 2

    cat = Catalog.open(postgres_url)
    store = open_store(store_url)
    try:
        with cat.engine.connect() as conn:

            def one(q: str) -> int:
                return int(conn.execute(sa.text(q)).scalar_one())

            # No duplicates, nothing half purged, no replica without a chunk.
            assert (
                one(
                    "SELECT count(*) FROM (SELECT fingerprint, prefix_hash, layer_lo, layer_hi, "
                    "head_lo, head_hi FROM chunks GROUP BY 1,2,3,4,5,6 HAVING count(*) > 1) d"
                )
                == 0
            )
            assert one("SELECT count(*) FROM chunks WHERE state <> 'ready'") == 0
            assert one("SELECT count(*) FROM replicas WHERE state <> 'durable'") == 0
            assert (
                one(
                    "SELECT count(*) FROM replicas r WHERE NOT EXISTS "
                    "(SELECT 1 FROM chunks c WHERE c.blob_key = r.blob_key)"
                )
                == 0
            )
            # A chunk's parent node is catalogued (the chain is unbroken).
            assert (
                one(
                    "SELECT count(*) FROM prefixes p WHERE p.token_start > 0 AND NOT EXISTS "
                    "(SELECT 1 FROM prefixes q WHERE q.prefix_hash = p.parent_hash)"
                )
                == 0
            )
        fsck = kvc("fsck", "--catalog", postgres_url, "--store", store_url, "--read-data", "--json")
        assert fsck.returncode == 0, fsck.stdout[-2000:] + fsck.stderr[-2000:]
        # Every ref and every pin that never expires still restores its whole lineage,
        # token-exact (GC may have purged what expired pins held).
        refs = cat.list_refs("default")
        assert refs, "some refs should survive the run"
        heads = [(r.name, r.head_hash, r.processed) for r in refs]
        for pin in cat.list_pins("default"):
            if pin.expires_at is None:
                node = cat.lineage("default", pin.prefix_hash)[-1]
                heads.append((f"pin {pin.name}", pin.prefix_hash, node.token_end))
        assert len(heads) > len(refs), "some pins should survive the run"
        with Restorer(cat, [store], "default") as restorer:
            for name, head, processed in heads:
                lineage = cat.lineage("default", head)
                toks = [t for node in lineage for t in node.tokens]
                assert len(toks) == processed and lineage[0].token_start == 0, name
                pool = PagePool(MODEL.layout, page_size=16, num_pages=16)
                got = restorer.restore(pool, [*toks, 0], MODEL.fingerprint)
                assert got.restored_tokens == len(toks), (name, got.report)
                want = PagePool(MODEL.layout, page_size=16, num_pages=16)
                r = want.new_route()
                MODEL.prefill(want, r, toks)
                k, v = pool.read(got.route)
                k0, v0 = want.read(r)
                assert np.array_equal(k, k0) and np.array_equal(v, v0), name
    finally:
        cat.close()
        store.close()
