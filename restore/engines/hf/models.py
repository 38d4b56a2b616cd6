"""Transformers models for tests, demos and benchmarks: random-weight checkpoints, loading, greedy decoding."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from restore.engines.hf.identity import token_ids


def save_random_model(
    directory: str | Path, model_type: str = "llama", *, seed: int = 0, **config: Any
) -> Path:
    """Build a causal LM of `model_type` ("llama", "qwen2", "mistral", ...) with random weights
    from `config` fields, `save_pretrained` it to `directory` and return the path.

    Nothing is downloaded; load it back with `AutoModelForCausalLM.from_pretrained`.
    Biases are random too (transformers initialises them to zero), so a bias in
    the K/V projections really changes K/V.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.02)
    path = Path(directory)
    model.save_pretrained(path)
    return path


@dataclass
class GreedyRun:
    """Greedy decoding from a cache: the tokens, each step's logits, time to the first token."""

    tokens: list[int]
    logits: list[np.ndarray[Any, Any]]
    first_token_s: float


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name `model`'s forward takes its cache by: `cache` (newer transformers 5.x, which
    deprecates the other) or `past_key_values` (earlier 5.x, which ignores `cache=`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy(
    model: PreTrainedModel, input_ids: object, cache: DynamicCache, start: int, new_tokens: int
) -> GreedyRun:
    """Feed `input_ids[start:]` after the `start` positions `cache` holds, then decode
    `new_tokens` greedily; logits come back as float32 numpy arrays (for digests)."""
    ids = token_ids(input_ids)
    t0 = time.perf_counter()
    x = torch.tensor(ids[start:].astype(np.int64), device=model.device).unsqueeze(0)
    # Logits of the last position only: a long prompt's full logits would not fit in memory.
    key = cache_kwarg(model)
    logits = model(x, **{key: cache}, use_cache=True, logits_to_keep=1).logits[0, -1]
    first = time.perf_counter() - t0
    out: list[int] = []
    seen: list[np.ndarray[Any, Any]] = []
    for _ in range(new_tokens):
        seen.append(logits.float().cpu().numpy())
        out.append(int(torch.argmax(logits)))
        if len(out) < new_tokens:
            x = torch.tensor([[out[-1]]], device=model.device)
            logits = model(x, **{key: cache}, use_cache=True, logits_to_keep=1).logits[0, -1]
    return GreedyRun(out, seen, first)


# A small Llama the demo builds when no model is given: GQA, head dim 64, bfloat16.
DEMO_MODEL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
}


def load_model(path_or_id: str | Path, dtype: str = "auto") -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` in eval mode: a local checkpoint directory, or a
    hub id where there is network. `dtype` "auto" keeps the checkpoint's own."""
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(path_or_id), dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    model.eval()  # type: ignore[no-untyped-call]
    return model
