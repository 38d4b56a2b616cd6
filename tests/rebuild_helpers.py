"""What every writer's recovery test does once its catalog is lost: `kvc rebuild --from` the
stores alone (the CLI, in its own process), then check the names that came back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from catalog.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]


def lose_catalog(catalog_url: str) -> None:
    """Delete a SQLite catalog's file (and its WAL files): the database is gone."""
    path = Path(catalog_url.removeprefix("sqlite:///"))
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)
    assert not path.exists()


def kvc_rebuild(catalog_url: str, store_urls: list[str]) -> dict[str, Any]:
    """`kvc rebuild --from URL ... --catalog URL --json`; its report (the run must succeed)."""
    args = [arg for url in store_urls for arg in ("--from", url)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "kvc.cli", "rebuild", *args, "--catalog", catalog_url, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def names(catalog_url: str, namespace: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The namespace's refs and live pins, name -> head / prefix hash."""
    with Catalog.open(catalog_url) as cat:
        refs = {r.name: r.head_hash for r in cat.list_refs(namespace)}
        pins = {p.name: p.prefix_hash for p in cat.list_pins(namespace, include_expired=False)}
    return refs, pins
