"""Fixtures for the SGLang tests. They run in SGLang's own environment, .venv-sglang, which
`./scripts/test` builds; the other environment's run ignores this directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from catalog import Catalog
from tests.sglang.harness import kvc_extra_config, single_rank_group

NS = "sglang-test"


@pytest.fixture(scope="session")
def rank_group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The one-rank process group SGLang's controller reduces over, for the whole session."""
    return single_rank_group(str(tmp_path_factory.mktemp("dist") / "init"))


@pytest.fixture
def kvc(tmp_path: Path) -> dict[str, Any]:
    """kvc's part of the extra config: a fresh SQLite catalog (`kvc init`) and a local store."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    Catalog.open(db, upgrade=True).close()
    return {
        "catalog": db,
        "stores": [f"file://{tmp_path / 'blobs'}"],
        "namespace": NS,
        "weights_id": "tiny-model@test",
    }


@pytest.fixture
def extra(kvc: dict[str, Any]) -> dict[str, Any]:
    """The whole `--hicache-storage-backend-extra-config` an operator passes for kvc."""
    return kvc_extra_config(kvc)
