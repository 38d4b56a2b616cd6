"""README.md's code runs as written (so it never drifts from the code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rebuild_helpers import kvc_rebuild, lose_catalog, names

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, wherever kvc is installed from
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_the_readme_has_python_to_run() -> None:
    assert BLOCKS, "README.md lost its python example"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_python_block_runs_in_a_fresh_directory(code: str, tmp_path: Path) -> None:
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "restored 600 of 640 tokens, verified" in out.stdout
    assert (tmp_path / "kvc-example" / "catalog.db").is_file()  # under the working directory
    # Run again where it ran: it finds what it made and still works.
    again = _run(code, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "restored 600 of 640 tokens, verified" in again.stdout


def test_ci_runs_the_readme_test_command() -> None:
    section = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", section)
    assert len(commands) == 2  # the demo, the test suite
    # The first thing a reader runs, exactly (pip installs, then the demo).
    assert (
        commands[0] == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kvc demo"
    )
    assert commands[1] == "./scripts/test"
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci


# What a user does next with the example's catalog: pin the system prompt, name a draft and
# delete it, through a session (nothing about journals). Then the catalog is lost.
AFTER = """
from pathlib import Path
from catalog import Catalog
from restore import Session
home = Path("kvc-example").resolve()
catalog = Catalog.open(f"sqlite:///{home / 'catalog.db'}")
with Session(catalog, [f"file://{home / 'blobs'}"]) as kvc:
    head = catalog.get_ref("default", "system-v1")
    catalog.pin("default", "system", head.head_hash, reason="the shared prompt")
    catalog.create_ref("default", "draft", head.fingerprint, head.head_hash)
    catalog.delete_ref("default", "draft")
catalog.close()
"""


def test_the_readme_examples_catalog_comes_back_from_its_store_alone(tmp_path: Path) -> None:
    assert _run(BLOCKS[0], tmp_path).returncode == 0
    after = _run(AFTER, tmp_path)
    assert after.returncode == 0, after.stderr
    home = tmp_path / "kvc-example"
    url = f"sqlite:///{home / 'catalog.db'}"
    refs_before, pins_before = names(url, "default")
    assert set(refs_before) == {"system-v1"} and set(pins_before) == {"system"}
    lose_catalog(url)
    report = kvc_rebuild(url, [f"file://{home / 'blobs'}"])
    assert report["complete"], report
    # Every name is back (the deleted draft stays deleted), and a new process restores.
    assert names(url, "default") == (refs_before, pins_before)
    again = _run(BLOCKS[0], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "restored 600 of 640 tokens, verified" in again.stdout
