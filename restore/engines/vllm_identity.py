"""The identity of what vLLM serves, for the kvc connector: the KV layout of the whole model,
the shard one tensor-parallel rank holds, the fingerprint, and the KV cache specs refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec

from catalog import AttentionLayout, Fingerprint
from catalog.models import Shard
from restore.engines.identity import engine_fingerprint, numeric_config, weights_identity
from restore.engines.torch_kv import DTYPES
from restore.errors import UnsupportedModelError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def vllm_layout(vllm_config: VllmConfig) -> AttentionLayout:
    """The K/V one token occupies in the whole model (all ranks), or `UnsupportedModelError`."""
    model = vllm_config.model_config
    name = model.model
    if getattr(model, "use_mla", False):
        raise UnsupportedModelError(f"{name} uses MLA (a latent KV): kvc stores K and V per head")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise UnsupportedModelError("pipeline parallelism is not supported by the kvc connector")
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = (
        model.dtype if cache_dtype in (None, "auto") else getattr(torch, cache_dtype, cache_dtype)
    )
    if dtype not in DTYPES:
        raise UnsupportedModelError(
            f"KV cache dtype {dtype}: kvc stores float32, float16 and bfloat16 KV exactly "
            "(quantized KV caches are refused)"
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    heads = model.get_total_num_kv_heads()
    if heads % tp:
        raise UnsupportedModelError(
            f"{heads} kv heads do not split evenly over {tp} tensor-parallel ranks "
            "(replicated kv heads are not supported)"
        )
    layers = model.get_num_layers(vllm_config.parallel_config)
    return AttentionLayout(layers, heads, model.get_head_size(), DTYPES[dtype])


def check_full_attention(kv_cache_config: KVCacheConfig) -> None:
    """Refuse, by name, every KV cache but one group of full attention: kvc restores and saves
    every position of every layer (a sliding window's dropped blocks are vLLM's null block)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModelError(
            f"the model has {len(groups)} KV cache groups "
            "(sliding-window, hybrid or linear-attention layers): the kvc connector supports "
            "models whose layers are all full attention"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise UnsupportedModelError(
            f"the model's KV cache is {type(spec).__name__}: the kvc connector supports models "
            "whose layers are all full attention (FullAttentionSpec)"
        )


def rank_shard(layout: AttentionLayout, rank: int, world: int) -> Shard:
    """The kv heads tensor-parallel rank `rank` of `world` holds, as a kvc shard."""
    per = layout.num_kv_heads // world
    return Shard(0, layout.num_layers, rank * per, (rank + 1) * per)


def vllm_fingerprint(vllm_config: VllmConfig, weights_id: str | None = None) -> Fingerprint:
    """The fingerprint of the model vLLM serves: weights, architecture, the numeric config, the
    layout, and how vLLM runs it (vLLM and torch versions, dtypes, attention backend, device)."""
    model = vllm_config.model_config
    layout = vllm_layout(vllm_config)
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    return engine_fingerprint(
        engine="vllm",
        weights=weights_identity(model.model, weights_id),
        architecture=",".join(model.architectures or []) or type(model.hf_config).__name__,
        config=numeric_config(model.hf_text_config.to_dict()),
        layout=layout,
        execution={
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "kv": layout.dtype,
            "attn": str(backend) if backend is not None else "auto",
            "device": vllm_config.device_config.device_type,
            "tp": vllm_config.parallel_config.tensor_parallel_size,
        },
    )
