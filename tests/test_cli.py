"""The `kvc` console script: installed, versioned, and self-explaining."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvc import __version__


def _kvc(*args: str) -> subprocess.CompletedProcess[str]:
    # The console script installed beside this interpreter, as a user would run it.
    exe = Path(sys.executable).parent / "kvc"
    assert exe.exists(), f"console script not installed at {exe}"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


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
