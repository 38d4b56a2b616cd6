"""Every model family docs/engines.md lists as supported checkpoints and restores through transformers'
`generate`, token-exact against the same run without kvc; sliding-window caches are stored only while
they hold every position; families whose layers keep no per-position KV are refused by name.

Each family is built from its own transformers config class with the attention settings of a
published checkpoint (sliding window, layer types, grouped-query heads, head dim, biases, norms,
soft-capping), shrunk in width and depth only; random weights, `save_pretrained`, then
`from_pretrained` twice: one model checkpoints, a second one restores.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from restore.engines.hf import cache_kwarg, save_random_model
from restore.errors import UnsupportedModelError
from tests.restore.engines.hf_worker import cache_digests, generate, load, prefill

# `env` is test_hf's fixture (a SQLite catalog and a local store per test).
from tests.restore.engines.test_hf import Env, adapter, env, prompt, same_kv  # noqa: F401

SMALL: dict[str, Any] = {
    "vocab_size": 256,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
}

# name -> (model_type, its config class, the published checkpoint whose attention settings these
# are, the settings). Heads keep the published grouping ratio and layers the published pattern.
FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": (
        "llama",
        "LlamaConfig",
        "meta-llama/Llama-3.2-1B",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "qwen2": (
        "qwen2",
        "Qwen2Config",
        "Qwen/Qwen2.5-0.5B",
        {
            "hidden_size": 56,
            "num_hidden_layers": 2,
            "num_attention_heads": 7,
            "num_key_value_heads": 1,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "max_window_layers": 2,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "qwen3": (
        "qwen3",
        "Qwen3Config",
        "Qwen/Qwen3-0.6B",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # published: head_dim * heads = 2x hidden_size
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 2,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "mistral": (
        "mistral",
        "MistralConfig",
        "mistralai/Mistral-7B-v0.1",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "sliding_window": 4096,
        },
    ),
    "phi3": (
        "phi3",
        "Phi3Config",
        "microsoft/Phi-3-mini-4k-instruct",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "sliding_window": 2047,
            "original_max_position_embeddings": 4096,
        },
    ),
    "phi3.5": (
        "phi3",
        "Phi3Config",
        "microsoft/Phi-3.5-mini-instruct",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "sliding_window": 262143,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            # LongRoPE; the factor lists cut to head_dim / 2 entries, in the published ranges.
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.06, 1.08],
                "long_factor": [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62],
            },
        },
    ),
    "olmo": (
        "olmo",
        "OlmoConfig",
        "allenai/OLMo-1B-hf",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "clip_qkv": None,
            "tie_word_embeddings": True,
        },
    ),
    "olmo2": (
        "olmo2",
        "Olmo2Config",
        "allenai/OLMo-2-1124-7B",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
    ),
    "gpt_neox": (
        "gpt_neox",
        "GPTNeoXConfig",
        "EleutherAI/pythia-70m",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "use_parallel_residual": True,
            "rotary_pct": 0.25,
        },
    ),
    "gemma": (
        "gemma",
        "GemmaConfig",
        "google/gemma-2b",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,  # multi-query attention
            "head_dim": 32,
        },
    ),
    "gemma2": (
        "gemma2",
        "Gemma2Config",
        "google/gemma-2-2b",
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,  # sliding and full attention alternate
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,  # published: equal to head_dim
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "gemma3_text",
        "Gemma3TextConfig",
        "google/gemma-3-1b-pt",
        {
            "hidden_size": 64,
            "num_hidden_layers": 6,  # five sliding layers, then one full
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 512,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}

GENERATED = 8


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: str(build(root / family, family)) for family in FAMILIES}


def build(directory: Path, family: str, **changes: Any) -> Path:
    """A random-weight checkpoint of `family` (its published settings, then `changes`)."""
    model_type, _, _, settings = FAMILIES[family]
    return save_random_model(directory, model_type, seed=3, **(SMALL | settings | changes))


def layer_kinds(cache: DynamicCache) -> list[str]:
    return [type(layer).__name__ for layer in cache.layers]


def generate_into(model: PreTrainedModel, ids: list[int], cache: DynamicCache) -> list[int]:
    """transformers' greedy `generate` from `ids`, filling `cache`; the whole output sequence."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            **{cache_kwarg(model): cache},
            max_new_tokens=GENERATED,
            do_sample=False,
        )
    return [int(t) for t in out[0]]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_checkpoints_and_restores_through_generate_token_exact(
    family: str,
    family_dirs: dict[str, str],
    env: Env,  # noqa: F811
) -> None:
    config_class = FAMILIES[family][1]
    writer = load(family_dirs[family], "float32")
    assert type(writer.config).__name__ == config_class
    # No kvc: generate fills a cache; that cache (a copy) continues a longer prompt.
    cache = DynamicCache(config=writer.config)
    seen = generate_into(writer, prompt(40), cache)
    reference = copy.deepcopy(cache)
    held = len(seen) - 1  # generate never feeds its last token
    assert cache.get_seq_length() == held
    longer = [*seen, *prompt(10, seed=5)]
    with adapter(writer, env) as kv:
        result = kv.checkpoint(seen, cache, name=family)
    assert result.tokens == held
    assert env.catalog.get_ref("default", family).pending_token == seen[-1]
    # kvc: another from_pretrained of the checkpoint restores and continues the longer prompt.
    reader = load(family_dirs[family], "float32")
    with adapter(reader, env) as kv:
        restored, n = kv.restore(longer)
    assert n == held
    assert layer_kinds(restored) == layer_kinds(reference)
    if getattr(reader.config, "sliding_window", None):  # Qwen2.5 sets one but does not use it
        assert "DynamicSlidingWindowLayer" in layer_kinds(restored)
    for got, want in zip(restored.layers, reference.layers, strict=True):
        assert got.get_seq_length() == want.get_seq_length() == held
        assert got.get_mask_sizes(1) == want.get_mask_sizes(1)
    assert same_kv(restored, reference)  # K and V of every layer, bit for bit
    assert generate(reader, longer, restored, GENERATED) == generate(
        reader, longer, reference, GENERATED
    )  # the tokens and every step's logits, bit for bit


@pytest.mark.parametrize(
    ("family", "window"), [("mistral", 16), ("phi3", 16), ("gemma2", 16), ("gemma3_text", 16)]
)
def test_a_sliding_window_cache_that_dropped_positions_is_refused_and_nothing_stored(
    tmp_path: Path,
    env: Env,  # noqa: F811
    family: str,
    window: int,
) -> None:
    model = load(str(build(tmp_path / family, family, sliding_window=window)), "float32")
    p = prompt(40)
    with adapter(model, env) as kv:
        # Within the window every position is held: stored.
        assert kv.checkpoint(p, prefill(model, p[: window - 1])).tokens == window - 1
        with pytest.raises(
            UnsupportedModelError,
            match=rf"DynamicSlidingWindowLayer \(sliding_window {window}\) that has dropped "
            rf"{40 - window + 1} of its 40 positions",
        ):
            kv.checkpoint(p, prefill(model, p))
        assert kv.restore(p)[1] == window - 1  # only the stored prefix, within the window
    assert env.catalog.stats("default")["chunks"] == 1  # window - 1 = 15 tokens: one tail chunk


def test_a_sliding_cache_recording_its_past_restores_to_what_the_window_keeps(
    tmp_path: Path,
    env: Env,  # noqa: F811
) -> None:
    """A sliding layer that records its past (assisted decoding) holds every position, longer
    than its window: kvc stores them all, and a restore of more than the window leaves the
    layer exactly as transformers' own update would: the last `sliding_window - 1` positions
    and the count of all of them."""
    window = 16
    model = load(str(build(tmp_path / "m", "mistral", sliding_window=window)), "float32")
    p = prompt(40)
    recording = DynamicCache(config=model.config)
    for layer in recording.layers:
        assert isinstance(layer, DynamicSlidingWindowLayer)
        layer.activate_past_recording()
    with torch.no_grad():
        model(torch.tensor([p[:30]]), **{cache_kwarg(model): recording}, use_cache=True)
    reference = prefill(model, p[:30])  # the same prefill, window kept as usual
    with adapter(model, env) as kv:
        assert kv.checkpoint(p, recording).tokens == 30
        restored, n = kv.restore(p)
    assert n == 30
    for layer in restored.layers:
        assert isinstance(layer, DynamicSlidingWindowLayer)
        assert layer.cumulative_length == 30 and layer.keys.shape[-2] == window - 1  # type: ignore[union-attr]
    assert cache_digests(restored) == cache_digests(reference)
    assert generate(model, p, restored, GENERATED) == generate(model, p, reference, GENERATED)


# LFM2 (LiquidAI/LFM2-350M's first six layers) mixes short convolutions with attention;
# Qwen3-Next mixes gated linear attention with full attention: both keep a recurrent state.
REFUSED = [
    (
        "lfm2",
        {
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        },
        r"Lfm2ForCausalLM \(model_type lfm2\) has layers that do not keep per-position KV "
        r"\(0: 'conv' \(LinearAttentionLayer\), 1: 'conv' \(LinearAttentionLayer\), 3: 'conv'",
    ),
    (
        "qwen3_next",
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        r"Qwen3NextForCausalLM \(model_type qwen3_next\) has layers that do not keep "
        r"per-position KV \(0: 'linear_attention' \(LinearAttentionLayer\)",
    ),
]


@pytest.mark.parametrize(("family", "settings", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_family_whose_layers_keep_a_recurrent_state_is_refused_by_name(
    tmp_path: Path,
    env: Env,  # noqa: F811
    family: str,
    settings: dict[str, Any],
    message: str,
) -> None:
    model = load(str(save_random_model(tmp_path / family, family, **SMALL, **settings)), "float32")
    with pytest.raises(UnsupportedModelError, match=message):
        adapter(model, env)
    assert env.catalog.stats("default")["chunks"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_a_sliding_window_family_restores_onto_the_gpu_token_exact(
    tmp_path: Path,
    env: Env,  # noqa: F811
    family: str,
) -> None:
    """Sliding-window layers (every layer: Phi-3; alternating with full ones: Gemma 2) restored
    into CUDA tensors: the window's count and device set as the model's own cache has them."""
    model = load(str(build(tmp_path / family, family)), "bfloat16").to("cuda")
    p = prompt(50)
    computed = prefill(model, p[:40])
    with adapter(model, env) as kv:
        kv.checkpoint(p, computed)
        restored, n = kv.restore(p)
    assert n == 40
    assert layer_kinds(restored) == layer_kinds(computed)
    for got, want in zip(restored.layers, computed.layers, strict=True):
        assert got.keys is not None and got.keys.device.type == "cuda"
        assert got.get_mask_sizes(1) == want.get_mask_sizes(1)
    assert same_kv(restored, computed)
    assert generate(model, p, restored, GENERATED) == generate(model, p, computed, GENERATED)
