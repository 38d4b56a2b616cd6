"""The weights part of an engine's fingerprint, for engines that load the model themselves (vLLM, SGLang)."""

from __future__ import annotations

from pathlib import Path

import blake3

from catalog.identity import canonical_json
from restore.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_identity(model: str, weights_id: str | None = None) -> str:
    """`revision:<weights_id>` when the user vouches for an immutable revision id; else blake3
    over a local model directory's weight files (relative names, sizes and bytes, in name
    order). A hub name without `weights_id` is refused: a name alone does not pin the numbers."""
    if weights_id is not None:
        if not isinstance(weights_id, str) or not weights_id.strip():
            raise InputError("weights_id must be a non-empty string (an immutable revision id)")
        return f"revision:{weights_id}"
    root = Path(model)
    files = (
        sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        if root.is_dir()
        else []
    )
    if not files:
        raise InputError(
            f"model {model!r} is not a local directory with weight files: set 'weights_id' "
            "(an immutable revision id, e.g. the hub commit hash) to name these exact weights"
        )
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for path in files:
        h.update(canonical_json([path.relative_to(root).as_posix(), path.stat().st_size]))
        with path.open("rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
    return f"blake3:{h.hexdigest()}"
