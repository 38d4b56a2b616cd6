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
    assert out.returncode == 2 and "does not exist; run `kvc init`" in out.stderr
    assert not (tmp_path / "c.db").exists()  # reading creates nothing
    (tmp_path / "c.db").touch()  # an empty database: no schema yet
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
    human = _kvc("db", "current", "--catalog", url)
    assert human.returncode == 0 and f"schema {HEAD} (the latest)" in human.stdout


def test_reading_a_missing_or_foreign_catalog_creates_nothing_and_exits_2(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for args in (("stats",), ("log", "x"), ("db", "current")):
        out = _kvc(*args, env={"KVC_HOME": str(home)})
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("kvc: error: catalog") and "does not exist" in out.stderr
        assert not home.exists()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all")
    for args in (("stats",), ("db", "current")):
        out = _kvc(*args, "--catalog", f"sqlite:///{garbage}")
        assert out.returncode == 2 and "is not a SQLite database" in out.stderr, out.stderr
    assert garbage.read_bytes() == b"not a database at all"


def test_filesystem_errors_are_one_line_with_a_usage_exit_code(tmp_path: Path) -> None:
    (tmp_path / "FILE").write_text("x")
    for home in ("/proc/kvc", str(tmp_path / "FILE" / "sub")):
        out = _kvc("init", "--home", home)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("kvc: error:") and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1 and home in out.stderr


def test_store_urls_are_validated_before_anything_is_opened(tmp_path: Path) -> None:
    for url, why in (("s3:/x", "empty bucket name"), ("file:relative", "absolute path")):
        out = _kvc("stats", "--store", url, env={"KVC_HOME": str(tmp_path / "h")})
        assert out.returncode == 2
        assert out.stderr.startswith("kvc: error: invalid setting stores:") and why in out.stderr
    out = _kvc("stats", env={"KVC_HOME": str(tmp_path / "h"), "KVC_STORES": "file:///tmp/ok,ftp://x"})
    assert out.returncode == 2 and "unknown store URL scheme 'ftp'" in out.stderr
    assert not (tmp_path / "h").exists()


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
