"""An engine's identity, one recipe for every adapter: the numeric config, the weights
identity and the execution variant string that make a fingerprint (docs/engines.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from catalog import AttentionLayout, Fingerprint
from restore.engines.weights import cached_weights_digest, weight_files
from restore.errors import InputError

# Config fields that never change a K/V value: names, paths, versions, labels,
# token ids and output switches. Everything else is part of the fingerprint, so
# a field this list does not know costs at most a cache miss, never a wrong hit.
# (The model's dtype is in the execution variant as the KV dtype.)
NOT_NUMERIC = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "id2label",
        "label2id",
        "problem_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "task_specific_params",
        "finetuning_task",
    }
)

def json_safe(value: Any) -> Any:
    """Config values as JSON data (dtypes and other objects by their string)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def numeric_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields that can change K/V (all but `NOT_NUMERIC`), as JSON data."""
    return json_safe({k: v for k, v in config.items() if k not in NOT_NUMERIC})  # type: ignore[no-any-return]


def revision_identity(weights_id: str) -> str:
    """`revision:<weights_id>`: an immutable revision id the user vouches for."""
    if not isinstance(weights_id, str) or not weights_id.strip():
        raise InputError("weights_id must be a non-empty string (an immutable revision id)")
    return f"revision:{weights_id}"


def engine_fingerprint(
    *,
    engine: str,
    weights: str,
    architecture: str,
    config: Mapping[str, Any],
    layout: AttentionLayout,
    execution: Mapping[str, object],
) -> Fingerprint:
    """The fingerprint of a model as `engine` runs it: `execution` holds everything about how
    it runs that can change its K/V numbers (versions, dtypes, kernels, device), written as
    the one variant string every adapter uses (`key=value` pairs in key order, `;`-joined)."""
    variant = {"engine": engine, **execution}
    return Fingerprint.create(
        weights=weights,
        architecture=architecture,
        config=config,
        attention_layout=layout,
        execution_variant=";".join(f"{k}={v}" for k, v in sorted(variant.items())),
    )


def weights_identity(model: str, weights_id: str | None = None) -> str:
    """`revision:<weights_id>` when the user vouches for an immutable revision id; else blake3
    over a local model directory's weight files (relative names, sizes and bytes, in name
    order), hashed once per machine (restore/engines/weights.py). A hub name without
    `weights_id` is refused: a name alone does not pin the numbers."""
    if weights_id is not None:
        return revision_identity(weights_id)
    root = Path(model)
    files = weight_files(root)
    if not files:
        raise InputError(
            f"model {model!r} is not a local directory with weight files: set 'weights_id' "
            "(an immutable revision id, e.g. the hub commit hash) to name these exact weights"
        )
    return f"blake3:{cached_weights_digest(root, files)}"
