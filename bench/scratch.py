"""Scratch directories for the benches: removed when the bench exits, however it exits but
killed (benches write gigabytes of blobs, models and catalogs under the system temp directory)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new directory under the system temp directory, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
