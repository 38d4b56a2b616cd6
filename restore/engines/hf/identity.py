"""What kvc accepts of a transformers model and cache, and the model's identity: checks, layout, fingerprint, token ids."""

from __future__ import annotations

from typing import Any, cast

import blake3
import numpy as np
import torch
import transformers
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from catalog import AttentionLayout, Fingerprint
from catalog.identity import canonical_json, token_array
from restore.engines.identity import engine_fingerprint, numeric_config, revision_identity
from restore.engines.torch_kv import DTYPES
from restore.errors import InputError, UnsupportedModelError


def text_config(model: PreTrainedModel) -> Any:
    return model.config.get_text_config(decoder=True)


def check_supported(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModelError` naming what kvc cannot represent exactly in this model."""
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__}"
        )
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; kvc supports decoder-only models"
        )
    if model.dtype not in DTYPES:
        raise UnsupportedModelError(
            f"{name} computes in {model.dtype}; kvc supports float32, float16 and bfloat16"
        )
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"{name} is dispatched over several devices ({sorted(map(str, devices))}); "
            "kvc supports a model on one device"
        )
    if model.device.type == "meta":
        raise UnsupportedModelError(f"{name} has weights on the meta device (not loaded)")
    cfg = text_config(model)
    owner = f"{name} (model_type {getattr(cfg, 'model_type', None) or '?'})"
    layers = attention_layers(
        DynamicCache(config=model.config), owner, getattr(cfg, "layer_types", None)
    )
    if len(layers) != cfg.num_hidden_layers:
        raise UnsupportedModelError(
            f"{name} caches {len(layers)} layers for {cfg.num_hidden_layers} "
            "hidden layers (shared or missing KV layers are not supported)"
        )


def check_cache(cache: object) -> list[DynamicLayer]:
    """The layers of a `DynamicCache` of per-position KV layers, or `UnsupportedModelError` naming it."""
    if isinstance(cache, tuple | list):
        raise UnsupportedModelError(
            "legacy tuple caches are not supported: pass the DynamicCache the model returned"
        )
    if not isinstance(cache, DynamicCache):
        raise UnsupportedModelError(
            f"{type(cache).__name__} is not supported: kvc stores the exact KV of a DynamicCache "
            "(quantized, static, offloaded and encoder-decoder caches are refused)"
        )
    if getattr(cache, "offloading", False):
        raise UnsupportedModelError("an offloaded DynamicCache is not supported")
    return attention_layers(cache)


# The cache layers that hold K and V per position: full attention keeps every position; a
# sliding-window (or chunked) layer keeps the last `sliding_window - 1`, so it holds every
# position until the sequence reaches its window.
KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def attention_layers(
    cache: DynamicCache, owner: str = "the cache", layer_types: list[str] | None = None
) -> list[DynamicLayer]:
    """The cache's layers, if every one keeps per-position K and V (a `DynamicLayer` or a
    `DynamicSlidingWindowLayer`); transformers builds other kinds for linear-attention,
    convolution, hybrid and indexed layers, whose state kvc cannot restore exactly."""
    odd = {
        i: type(layer).__name__
        for i, layer in enumerate(cache.layers)
        if type(layer) not in KV_LAYERS
    }
    if odd:
        kinds = layer_types or []
        listed = ", ".join(
            f"{i}: {kinds[i]!r} ({k})" if i < len(kinds) else f"{i}: {k}"
            for i, k in list(odd.items())[:6]
        )
        raise UnsupportedModelError(
            f"{owner} has layers that do not keep per-position KV ({listed}"
            f"{', ...' if len(odd) > 6 else ''}): linear-attention, convolution, hybrid and "
            "indexed layers keep a state that kvc cannot restore exactly"
        )
    return cast(list[DynamicLayer], cache.layers)


def check_window(layer: DynamicLayer, index: int) -> None:
    """Raise `UnsupportedModelError` if a sliding-window layer has dropped positions: kvc stores
    the KV of every position, and the dropped ones cannot be given back."""
    if not isinstance(layer, DynamicSlidingWindowLayer) or layer.keys is None:
        return
    held, total = layer.keys.shape[-2], layer.cumulative_length
    if held < total:
        raise UnsupportedModelError(
            f"cache layer {index} is a DynamicSlidingWindowLayer (sliding_window "
            f"{layer.sliding_window}) that has dropped {total - held} of its {total} positions: "
            f"kvc checkpoints a sliding-window cache only while it holds every position "
            f"(fewer than {layer.sliding_window} tokens)"
        )


def model_layout(model: PreTrainedModel) -> AttentionLayout:
    """The K/V a token occupies in this model, from its config and dtype."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionLayout(cfg.num_hidden_layers, kv_heads, head_dim, DTYPES[model.dtype])


def weights_digest(model: PreTrainedModel) -> str:
    """blake3 over the state dict: every tensor's name, dtype, shape and bytes, in name order."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(canonical_json([name, str(t.dtype), list(t.shape)]))
        flat = t.to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def execution(model: PreTrainedModel) -> dict[str, object]:
    """Everything about how the model runs that can change its K/V numbers."""
    device = model.device
    parts: dict[str, object] = {
        "attn": getattr(model.config, "_attn_implementation", None) or "default",
        "kv": DTYPES[model.dtype],
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        parts["gpu"] = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
        parts["tf32"] = torch.backends.cuda.matmul.allow_tf32
    elif device.type == "cpu":
        parts["cpu"] = torch.backends.cpu.get_cpu_capability()
    return parts


def model_fingerprint(model: PreTrainedModel, *, weights_id: str | None = None) -> Fingerprint:
    """The fingerprint of a loaded transformers model (see docs/engines.md).

    `weights_id` replaces the weights digest with an immutable revision id the
    caller vouches for (a hub commit hash, a release tag that is never moved).
    """
    check_supported(model)
    weights = (
        f"blake3:{weights_digest(model)}" if weights_id is None else revision_identity(weights_id)
    )
    return engine_fingerprint(
        engine="transformers",
        weights=weights,
        architecture=type(model).__name__,
        config=numeric_config(text_config(model).to_dict()),
        layout=model_layout(model),
        execution=execution(model),
    )


def token_ids(ids: object, what: str = "input_ids") -> np.ndarray[Any, np.dtype[np.uint32]]:
    """A list of ints, a 1-D tensor or a `[1, T]` tensor as validated uint32 token ids."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise InputError(
                    f"{what} is a batch of {ids.shape[0]} rows; kvc checkpoints and restores "
                    "one sequence per call"
                )
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"{what} must be 1-D or [1, T], got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex():
            raise InputError(f"{what} must hold integer token ids, got {ids.dtype}")
        ids = ids.detach().to("cpu").numpy()
    try:
        return token_array(ids)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(f"{what}: {exc}") from exc
