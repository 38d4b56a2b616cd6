"""Run in a fresh process by tests/restore/engines/test_hf.py: load a saved model, restore a prefix through kvc,
generate greedily, print what it restored and generated (digests of K/V and logits) as JSON.

Also the home of the helpers both processes use, so the two sides compute alike.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import blake3
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from catalog.base import CatalogAPI
from catalog.catalog import Catalog
from catalog.remote import RemoteCatalog
from chunkstore import open_store
from restore.engines.hf import HFAdapter, cache_kwarg

# Small models of each architecture the tests cover: GQA everywhere it exists, random
# biases (Qwen2's qkv bias), no end-of-sequence token so every run generates in full.
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**COMMON, "num_key_value_heads": 2},
    "qwen2": {**COMMON, "num_key_value_heads": 2},
    "mistral": {**COMMON, "num_key_value_heads": 2, "sliding_window": None},
    "gpt_neox": {**COMMON},
}


def load(model_dir: str, dtype: str, attn: str = "sdpa") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
    )
    return model.eval()  # type: ignore[no-any-return]


def tensor_digest(t: torch.Tensor) -> str:
    """blake3 of a tensor's bytes (bit patterns, so bfloat16 compares exactly)."""
    return blake3.blake3(
        t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    ).hexdigest()


def cache_digests(cache: DynamicCache) -> list[list[str] | None]:
    """Per layer, digests of K and V (None for a layer that holds nothing)."""
    return [
        [tensor_digest(layer.keys), tensor_digest(layer.values)] if layer.is_initialized else None  # type: ignore[union-attr]
        for layer in cache.layers
    ]


@torch.no_grad()
def prefill(model: PreTrainedModel, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids], device=model.device), **{cache_kwarg(model): cache}, use_cache=True)
    return cache


@torch.no_grad()
def generate(model: PreTrainedModel, ids: list[int], cache: DynamicCache, n: int) -> dict[str, Any]:
    """n greedy tokens after `ids` from `cache`: the tokens and a digest of every logits vector."""
    out = model.generate(
        torch.tensor([ids], device=model.device),
        **{cache_kwarg(model): cache},
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return {
        "tokens": out.sequences[0, len(ids) :].tolist(),
        "logits": [tensor_digest(x) for x in out.logits],
    }


def main() -> None:
    args = json.loads(sys.argv[1])
    model = load(args["model_dir"], args["dtype"])
    remote = args.get("remote")
    cat: CatalogAPI = (
        RemoteCatalog(remote["url"], remote["token"]) if remote else Catalog.open(args["catalog"])
    )
    stores = [open_store(u) for u in args["stores"]]
    prompt = args["prompt"]
    with HFAdapter(model, cat, stores, args["namespace"], args["chunk_size"]) as kv:
        cache, n = kv.restore(prompt)
        kv_digests = cache_digests(cache)
        gen = generate(model, prompt, cache, args["new_tokens"])
        fingerprint = kv.fingerprint.hex
    cat.close()
    print(json.dumps({"restored": n, "kv": kv_digests, "fingerprint": fingerprint, **gen}))


if __name__ == "__main__":
    main()
