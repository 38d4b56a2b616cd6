"""The transformers engine adapter: fingerprint a model, checkpoint its DynamicCache, restore one, verified.

A user keeps their own objects: `restore` returns a `transformers.DynamicCache`
that `model(...)` and `model.generate(...)` continue from, and `checkpoint`
takes the `DynamicCache` the model filled. In between, KV crosses kvc's two
seams (`restore.destination`): a restore writes verified chunks straight into
one host buffer that becomes the cache's tensors (one copy from the blob; for
a GPU model the buffer is pinned and sent to the device asynchronously), and
a checkpoint reads the cache's tensors in place (a GPU cache is copied once to
pinned host memory).

Only caches kvc can represent exactly are accepted: every layer a full-
attention `DynamicLayer` or a `DynamicSlidingWindowLayer` that still holds
every position (fewer tokens than its window; a restore rebuilds the window as
transformers' own update leaves it), one sequence, K and V of one head dim, a
float32, float16 or bfloat16 model on one device. Anything else (a sliding
window that has dropped positions, linear-attention, convolution or hybrid
layers, quantized, static or offloaded caches, encoder-decoder models) is
refused by name with `UnsupportedModelError`.

This package holds every module of the core that imports torch and transformers:
`identity` (what is accepted, the fingerprint), `cache` (the two seams over
DynamicCache tensors), `adapter` (`HFAdapter`) and `models` (models for tests,
demos and benchmarks).
"""

from __future__ import annotations

# Before transformers: without torch the import fails here, not with transformers' warning.
import torch  # noqa: F401

from restore.engines.hf.adapter import HFAdapter
from restore.engines.hf.identity import (
    check_cache,
    check_supported,
    execution,
    model_fingerprint,
    model_layout,
    token_ids,
    weights_digest,
)
from restore.engines.hf.models import (
    DEMO_MODEL,
    GreedyRun,
    cache_kwarg,
    greedy,
    load_model,
    save_random_model,
)

__all__ = [
    "DEMO_MODEL",
    "GreedyRun",
    "HFAdapter",
    "cache_kwarg",
    "check_cache",
    "check_supported",
    "execution",
    "greedy",
    "load_model",
    "model_fingerprint",
    "model_layout",
    "save_random_model",
    "token_ids",
    "weights_digest",
]
