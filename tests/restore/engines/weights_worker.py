"""Run in a fresh process by tests/restore/engines/test_weights_cache.py: compute a model
directory's weights identity with the steps of the per-machine cache logged to a shared file
(`<pid> miss` after a cache read found nothing, `<pid> hash` when hashing starts), hashing
held until a release file exists, and print the identity.

Usage: weights_worker.py MODEL_DIR LOG_FILE RELEASE_FILE
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from restore.engines import weights
from restore.engines.identity import weights_identity

DEADLINE_S = 60.0


def log_step(log: Path, step: str) -> None:
    with log.open("a") as f:  # one short append per line: lines of two processes do not mix
        f.write(f"{os.getpid()} {step}\n")


def main() -> None:
    model, log, release = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    read_entry, hash_files = weights._read_entry, weights.hash_weight_files

    def logged_read(*args: Any) -> str | None:
        digest = read_entry(*args)
        if digest is None:
            log_step(log, "miss")
        return digest

    def held_hash(*args: Any) -> str:
        log_step(log, "hash")
        deadline = time.monotonic() + DEADLINE_S
        while not release.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{release} did not appear")
            time.sleep(0.01)
        return hash_files(*args)

    weights._read_entry = logged_read  # type: ignore[assignment]
    weights.hash_weight_files = held_hash  # type: ignore[assignment]
    print(weights_identity(model))


if __name__ == "__main__":
    main()
