"""The `kvc` console script: installed, versioned, and self-explaining."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from sqlalchemy import exc as sa_exc

from catalog import database
from catalog.database import head_revision
from catalog.errors import SchemaVersionError
from chunkstore.errors import StoreUnavailableError
from kvc import __version__
from kvc.cli import cli

HEAD = head_revision()
ROOT = Path(__file__).resolve().parents[2]


def _kvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The console script installed beside this interpreter, as a user would run it.
    exe = Path(sys.executable).parent / "kvc"
    assert exe.exists(), f"console script not installed at {exe}"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    full_env["PYTHONPATH"] = str(ROOT)  # this checkout's code, wherever kvc is installed from
    full_env.update(env or {})
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=60, env=full_env
    )


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


def test_db_current_says_whether_the_schema_is_the_latest(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    (tmp_path / "c.db").touch()
    empty = _kvc("db", "current", "--catalog", url)
    assert empty.returncode == 1 and "schema empty (no kvc schema yet" in empty.stdout
    older = database.known_revisions() - {HEAD}
    assert older, "a schema with one revision has nothing to be behind"
    previous = max(older)
    assert _kvc("db", "upgrade", "--catalog", url, "--revision", previous).returncode == 0
    behind = _kvc("db", "current", "--catalog", url)
    assert behind.returncode == 1
    assert (
        f"schema {previous} (behind: the latest is {HEAD}; run `kvc db upgrade`)" in behind.stdout
    )
    doc = json.loads(_kvc("db", "current", "--catalog", url, "--json").stdout)
    assert doc["state"] == "behind" and doc["current"] == previous and doc["up_to_date"] is False
    stats = _kvc("stats", "--catalog", url)
    assert stats.returncode == 2 and "run `kvc db upgrade`" in stats.stderr
    # A revision only a newer kvc knows: upgrading with this one cannot help.
    with sqlite3.connect(tmp_path / "c.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    newer = _kvc("db", "current", "--catalog", url, "--json")
    assert newer.returncode == 1 and json.loads(newer.stdout)["state"] == "unknown"
    human = _kvc("db", "current", "--catalog", url)
    assert "not a revision this kvc knows" in human.stdout and "kvc db upgrade" not in human.stdout
    stats = _kvc("stats", "--catalog", url)
    assert stats.returncode == 2 and "a newer kvc upgraded it" in stats.stderr
    assert "kvc db upgrade" not in stats.stderr


def test_reading_a_missing_or_foreign_catalog_creates_nothing_and_exits_2(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for args in (("stats",), ("log", "x"), ("db", "current")):
        out = _kvc(*args, env={"KVC_HOME": str(home)})
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("kvc: error: catalog") and "does not exist" in out.stderr
        assert not home.exists()
    out = _kvc("fsck", "--catalog", f"sqlite:///{tmp_path / 'no' / 'such.db'}")
    assert out.returncode == 2 and "does not exist; run `kvc init`" in out.stderr
    assert not (tmp_path / "no").exists()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all")
    damaged = tmp_path / "damaged.db"  # SQLite's header, then nothing SQLite can read
    damaged.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4096)
    for path in (garbage, damaged, tmp_path):
        for args in (("stats",), ("log", "x"), ("fsck",), ("db", "current")):
            out = _kvc(*args, "--catalog", f"sqlite:///{path}")
            assert out.returncode == 2, (path, args, out.stderr)
            assert out.stderr.startswith(f"kvc: error: catalog sqlite:///{path} is ")
            assert "not a SQLite database" in out.stderr and out.stderr.count("\n") == 1
    assert garbage.read_bytes() == b"not a database at all"
    assert damaged.read_bytes() == b"SQLite format 3\x00" + b"\xff" * 4096


def test_filesystem_errors_are_one_line_with_a_usage_exit_code(tmp_path: Path) -> None:
    (tmp_path / "FILE").write_text("x")
    for home, why in (
        ("/proc/kvc", "No such file or directory"),
        (str(tmp_path / "FILE" / "sub"), "Not a directory"),
        (str(tmp_path / "FILE"), "a file is in the way"),
    ):
        for args in (("init",), ("db", "upgrade")):
            out = _kvc(*args, "--home", home)
            assert out.returncode == 2, out.stderr
            assert out.stderr == f"kvc: error: cannot create home {home}: {why}\n"
    bad_catalogs = (
        (tmp_path / "FILE" / "c.db", "Not a directory"),
        (tmp_path / "nodir" / "c.db", f"directory {tmp_path / 'nodir'} does not exist"),
        (tmp_path, f"{tmp_path} is a directory"),
    )
    for path, why in bad_catalogs:
        out = _kvc("init", "--catalog", f"sqlite:///{path}", "--home", str(tmp_path / "h"))
        assert out.returncode == 2, out.stderr
        assert out.stderr == f"kvc: error: cannot create catalog sqlite:///{path}: {why}\n"
    # A store root that cannot be created is the same kind of error as a home.
    home = str(tmp_path / "h")
    out = _kvc("init", "--home", home, "--store", f"file://{tmp_path}/FILE/blobs")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"kvc: error: file://{tmp_path}/FILE/blobs: cannot create")
    assert out.stderr.endswith("Not a directory\n")


def test_demo_on_a_home_it_cannot_create_is_one_line(tmp_path: Path) -> None:
    out = _kvc("demo", "--home", "/sys/kvc")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("kvc: error:") and out.stderr.count("\n") == 1
    assert "/sys/kvc" in out.stderr and "Traceback" not in out.stderr


def test_store_urls_are_validated_before_anything_is_opened(tmp_path: Path) -> None:
    for url, why in (("s3:/x", "empty bucket name"), ("file:relative", "absolute path")):
        out = _kvc("stats", "--store", url, env={"KVC_HOME": str(tmp_path / "h")})
        assert out.returncode == 2
        assert out.stderr.startswith("kvc: error: invalid setting stores:") and why in out.stderr
    out = _kvc(
        "stats", env={"KVC_HOME": str(tmp_path / "h"), "KVC_STORES": "file:///tmp/ok,ftp://x"}
    )
    assert out.returncode == 2 and "unknown store URL scheme 'ftp'" in out.stderr
    assert not (tmp_path / "h").exists()


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        elif any(p.name == "stores" for p in command.params):
            yield (*path, name)


# What each command needs besides its settings to get as far as reading them.
_REQUIRED = {
    ("lookup",): ["--fingerprint", "0" * 64],
    ("refs", "show"): ["x"],
    ("refs", "delete"): ["x"],
    ("log",): ["x"],
    ("show",): ["x"],
    ("quarantine",): ["0" * 64, "--reason", "r"],
    ("pins", "set"): ["x", "0" * 64],
    ("pins", "rm"): ["x"],
    ("rebuild",): ["--from", "file:///tmp/kvc-rebuild-source"],
    ("backup",): ["/tmp/kvc-backup.db"],
}


def test_every_command_that_takes_stores_checks_them_before_opening_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvc.cli import cli

    for key in [k for k in os.environ if k.startswith("KVC_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # no ./kvc.toml, and ./.kvc would show up here
    home = tmp_path / "h"
    commands = list(_commands(cli))
    assert ("stats",) in commands and ("daemon",) in commands and ("rebuild",) in commands
    for command in commands:
        args = [*command, *_REQUIRED.get(command, []), "--home", str(home)]
        for url, why in (("s3:/x", "empty bucket name"), ("file:relative", "absolute path")):
            out = CliRunner().invoke(cli, [*args, "--store", url])
            assert out.exit_code == 2, (command, url, out.output)
            assert out.stderr.startswith("kvc: error: invalid setting stores:"), (
                command,
                out.stderr,
            )
            assert why in out.stderr and out.stderr.count("\n") == 1
            assert out.stdout == ""
    assert not home.exists() and not (tmp_path / ".kvc").exists()
    # The environment and kvc.toml are checked alike; so are rebuild's --from stores.
    out = CliRunner().invoke(cli, ["gc", "--home", str(home)], env={"KVC_STORES": "s3:/x"})
    assert out.exit_code == 2 and "empty bucket name" in out.stderr
    (tmp_path / "kvc.toml").write_text('stores = ["file:relative"]\n')
    out = CliRunner().invoke(cli, ["fsck", "--home", str(home)])
    assert out.exit_code == 2 and "needs an absolute path" in out.stderr
    (tmp_path / "kvc.toml").unlink()
    catalog = f"sqlite:///{tmp_path / 'r.db'}"
    out = CliRunner().invoke(cli, ["rebuild", "--from", "s3:/x", "--catalog", catalog])
    assert out.exit_code == 2 and out.stderr.startswith("kvc: error:") and "bucket" in out.stderr
    assert not (tmp_path / "r.db").exists()


def _failing_cli(exc: Exception) -> click.Group:
    from kvc.cli import KvcGroup

    @click.group(cls=KvcGroup)
    def group() -> None:
        pass

    @group.command()
    def boom() -> None:
        raise exc

    return group


def test_errors_no_command_handled_are_one_line_from_any_entry_point() -> None:
    disk = sa_exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("disk I/O error"))
    for exc, code, line in (
        (disk, 1, "kvc: error: catalog error: OperationalError: disk I/O error"),
        (
            PermissionError(errno.EACCES, "Permission denied", "/srv/kvc"),
            2,
            "kvc: error: /srv/kvc: Permission denied",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/srv/kvc/x"),
            1,
            "kvc: error: /srv/kvc/x: No space left on device",
        ),
        (StoreUnavailableError("s3://b: unreachable"), 1, "kvc: error: s3://b: unreachable"),
        (
            SchemaVersionError("catalog x has no kvc schema"),
            2,
            "kvc: error: catalog x has no kvc schema",
        ),
    ):
        out = CliRunner().invoke(_failing_cli(exc), ["boom"])
        assert out.exit_code == code, (exc, out.output)
        assert out.stderr == line + "\n" and out.stdout == ""
    # A bug is not an expected failure: it still surfaces as itself.
    out = CliRunner().invoke(_failing_cli(KeyError("bug")), ["boom"])
    assert isinstance(out.exception, KeyError)


def test_python_dash_m_runs_the_cli(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "kvc.cli", "stats", "--home", str(tmp_path / "h")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2 and "does not exist; run `kvc init`" in out.stderr


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


def test_sizes_are_binary_units_everywhere() -> None:
    from chunkstore.units import human_bytes, human_rate
    from kvc.commands import format as fmt

    assert fmt.human_bytes is human_bytes  # one helper for every command
    cases = {0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 64 << 20: "64.0 MiB"}
    assert {n: human_bytes(n) for n in cases} == cases
    assert human_bytes(3 << 40) == "3.0 TiB" and human_bytes(5 << 50) == "5120.0 TiB"
    assert human_rate(20e6) == "19.1 MiB/s"


def test_serve_hash_token_refuses_a_short_token_without_echoing_it() -> None:
    """An unsalted sha256 of a short token can be searched offline from the tokens file:
    a token under 32 characters is refused (exit 2, nothing on stdout, the token not
    echoed); 32 characters hash as before."""
    short = "s3cret-but-short-31-characters!"
    assert len(short) == 31
    out = CliRunner().invoke(cli, ["serve-hash-token"], input=short + "\n")
    assert out.exit_code == 2
    assert out.stdout == ""
    assert "at least 32 characters" in out.stderr and "31 characters" in out.stderr
    assert short not in out.output
    long_enough = short + "x"
    out = CliRunner().invoke(cli, ["serve-hash-token"], input=long_enough + "\n")
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() == hashlib.sha256(long_enough.encode()).hexdigest()
    assert "32 characters" in CliRunner().invoke(cli, ["serve-hash-token", "--help"]).output
