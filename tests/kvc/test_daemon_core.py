"""The daemon's core without HTTP: a Python caller gets domain errors it can branch on."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvc.daemon.core as core
from catalog.catalog import Catalog
from chunkstore import open_store
from kvc.daemon.errors import (
    DaemonConflictError,
    DaemonError,
    DaemonInputError,
    DaemonNotFoundError,
)
from restore.engines.reference import ReferenceModel

MODEL = ReferenceModel.small(seed=0)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[core.Daemon]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    store = open_store(f"file://{tmp_path / 'blobs'}")
    d = core.Daemon(
        cat, [store], worker_id="core", chunk_size=32, engines=[MODEL], invalidation_interval=0
    )
    yield d
    d.close()
    store.close()
    cat.close()


def test_the_core_raises_domain_errors_not_http_ones(daemon: core.Daemon) -> None:
    # No web framework in the core's namespace: statuses are the app's business.
    roots = {
        str(v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", ""))
        for v in vars(core).values()
    }
    assert not {r.split(".")[0] for r in roots} & {"fastapi", "starlette"}

    with pytest.raises(DaemonConflictError, match="no pool is configured") as conflict:
        daemon.restore([1, 2, 3])
    assert isinstance(conflict.value, RuntimeError) and not hasattr(conflict.value, "status")

    with pytest.raises(ValueError, match="not catalogued") as bad:
        daemon.configure("ab" * 32, num_pages=4)
    assert isinstance(bad.value, DaemonInputError) and bad.value.field == "fingerprint"

    daemon.configure("reference", num_pages=8)
    with pytest.raises(LookupError) as missing:
        daemon.release(99)
    assert isinstance(missing.value, DaemonNotFoundError) and missing.value.field == "route"

    kinds = [e["kind"] for e in daemon.stats()["last_errors"]]
    assert kinds == ["DaemonConflictError", "DaemonInputError", "DaemonNotFoundError"]
    assert all(issubclass(getattr(core, k), DaemonError) for k in kinds)
