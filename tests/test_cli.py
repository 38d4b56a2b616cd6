"""The `kvc` console script: installed, versioned, and self-explaining."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from catalog.database import head_revision
from kvc import __version__

HEAD = head_revision()


def _kvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The console script installed beside this interpreter, as a user would run it.
    exe = Path(sys.executable).parent / "kvc"
    assert exe.exists(), f"console script not installed at {exe}"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    full_env.update(env or {})
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, env=full_env)


def test_version() -> None:
    out = _kvc("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"kvc, version {__version__}"


def test_help_explains() -> None:
    out = _kvc("--help")
    assert out.returncode == 0
    assert "KV cache" in out.stdout and "Example:" in out.stdout


def test_unknown_command_is_usage_error() -> None:
    out = _kvc("no-such-command")
    assert out.returncode == 2
    assert "No such command" in out.stderr


def test_db_upgrade_and_current(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    out = _kvc("db", "current", "--catalog", url, "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["current"] is None and doc["up_to_date"] is False
    up = _kvc("db", "upgrade", "--catalog", url)
    assert up.returncode == 0 and f"-> {HEAD}" in up.stdout
    again = _kvc("db", "upgrade", "--catalog", url, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["from"] == HEAD
    cur = _kvc("db", "current", "--json", env={"KVC_CATALOG_URL": url})
    assert cur.returncode == 0 and json.loads(cur.stdout)["up_to_date"] is True


def test_db_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    out = _kvc("db", "current", "--catalog", "mysql://u:hunter2@h/db")
    assert out.returncode == 2
    assert out.stderr.startswith("kvc: error:") and "Traceback" not in out.stderr
    assert "hunter2" not in out.stderr


def test_default_home(tmp_path: Path) -> None:
    out = _kvc("db", "upgrade", env={"KVC_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "home" / "catalog.db").exists()


def test_init_is_idempotent(tmp_path: Path) -> None:
    env = {"KVC_HOME": str(tmp_path / "home")}
    first = _kvc("init", "--json", env=env)
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["schema"] == HEAD and doc["stores"] == [f"file://{tmp_path / 'home' / 'blobs'}"]
    again = _kvc("init", "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout) == doc


def test_settings_precedence_flag_env_file(tmp_path: Path) -> None:
    (tmp_path / "kvc.toml").write_text('namespace = "from-file"\nchunk_size = 64\n')
    env = {"KVC_HOME": str(tmp_path / "h"), "KVC_CONFIG": str(tmp_path / "kvc.toml")}
    assert json.loads(_kvc("init", "--json", env=env).stdout)["namespace"] == "from-file"
    env["KVC_NAMESPACE"] = "from-env"
    assert json.loads(_kvc("init", "--json", env=env).stdout)["namespace"] == "from-env"
    out = _kvc("init", "--json", "--namespace", "from-flag", env=env)
    assert json.loads(out.stdout)["namespace"] == "from-flag"
    bad = _kvc("init", env={**env, "KVC_CHUNK_SIZE": "-1"})
    assert bad.returncode == 2 and "chunk_size" in bad.stderr and "Traceback" not in bad.stderr
