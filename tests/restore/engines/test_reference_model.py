"""The reference decoder: deterministic, batch-invariant, and resumable from copied KV."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from catalog import AttentionLayout
from restore.engines import ReferenceConfig, ReferenceModel
from restore.errors import PoolExhaustedError
from restore.pool import PagePool


def _pool(model: ReferenceModel, num_pages: int = 64) -> PagePool:
    return PagePool(model.layout, page_size=16, num_pages=num_pages)


def _tokens(n: int, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.small(seed=0)


def test_same_seed_gives_same_fingerprint_and_logits() -> None:
    a, b = ReferenceModel.small(seed=3), ReferenceModel.small(seed=3)
    assert a.fingerprint == b.fingerprint
    assert a.layout == AttentionLayout(4, 2, 16, "float16")
    prompt = _tokens(12)
    pa, pb = _pool(a), _pool(b)
    assert np.array_equal(
        a.prefill(pa, pa.new_route(), prompt), b.prefill(pb, pb.new_route(), prompt)
    )

    other = ReferenceModel.small(seed=4)
    assert other.fingerprint != a.fingerprint
    po = _pool(other)
    assert not np.array_equal(
        other.prefill(po, po.new_route(), prompt), a.prefill(pa, pa.new_route(), prompt)
    )
    # The same weights executed with another KV dtype are a different build.
    assert ReferenceModel.small(seed=3, kv_dtype="float32").fingerprint != a.fingerprint
    assert a.fingerprint.descriptor["architecture"] == "kvc-reference-llama"


def _assert_same_route(pool_a: PagePool, route_a: int, pool_b: PagePool, route_b: int) -> None:
    ka, va = pool_a.read(route_a)
    kb, vb = pool_b.read(route_b)
    assert ka.dtype == kb.dtype == pool_a.layout.numpy_dtype
    # Compare bit patterns so that even a NaN or a signed zero would have to match.
    assert ka.tobytes() == kb.tobytes()
    assert va.tobytes() == vb.tobytes()


def test_prefill_is_bit_identical_to_one_token_at_a_time(model: ReferenceModel) -> None:
    prompt = _tokens(37)
    pool = _pool(model)
    batched, stepped = pool.new_route(), pool.new_route()
    batched_logits = model.prefill(pool, batched, prompt)
    for token in prompt:
        stepped_logits = model.decode(pool, stepped, token)
    assert pool.length(batched) == pool.length(stepped) == 37
    assert batched_logits.dtype == np.float32 and batched_logits.shape == (256,)
    assert np.array_equal(batched_logits, stepped_logits)
    _assert_same_route(pool, batched, pool, stepped)


def test_split_prefill_equals_one_prefill(model: ReferenceModel) -> None:
    prompt = _tokens(37)
    pool = _pool(model)
    whole, split = pool.new_route(), pool.new_route()
    whole_logits = model.prefill(pool, whole, prompt)
    model.prefill(pool, split, prompt[:20])
    split_logits = model.prefill(pool, split, prompt[20:])
    assert np.array_equal(whole_logits, split_logits)
    _assert_same_route(pool, whole, pool, split)


def test_generate_is_greedy_and_deterministic(model: ReferenceModel) -> None:
    prompt = _tokens(10)
    pool = _pool(model)
    route = pool.new_route()
    generated = model.generate(pool, route, prompt, 8)
    assert len(generated) == 8 and all(0 <= t < model.vocab_size for t in generated)
    # The last pick is the pending token: it has not been fed yet.
    assert pool.length(route) == len(prompt) + 7

    by_hand = pool.new_route()
    logits = model.prefill(pool, by_hand, prompt)
    expected = []
    for _ in range(8):
        expected.append(int(np.argmax(logits)))
        logits = model.decode(pool, by_hand, expected[-1])
    assert generated == expected
    fresh = _pool(model)
    assert ReferenceModel.small(seed=0).generate(fresh, fresh.new_route(), prompt, 8) == generated
    assert model.generate(pool, pool.new_route(), prompt, 0) == []


def test_decode_resumes_exactly_from_copied_kv(model: ReferenceModel) -> None:
    prompt, continuation = _tokens(29), _tokens(6, seed=8)
    source = _pool(model)
    route_a = source.new_route()
    model.prefill(source, route_a, prompt)

    # A restore is exactly this: another pool receives the stored K/V of positions [0, k).
    target = _pool(model)
    route_b = target.new_route()
    target.append(route_b, *source.read(route_a))
    for token in continuation:
        assert np.array_equal(
            model.decode(source, route_a, token), model.decode(target, route_b, token)
        )
    _assert_same_route(source, route_a, target, route_b)


def test_a_fork_decodes_like_its_parent(model: ReferenceModel) -> None:
    pool = _pool(model)
    parent = pool.new_route()
    model.prefill(pool, parent, _tokens(29))  # ends inside a page: the fork shares it
    child = pool.fork(parent)
    for token in _tokens(5, seed=9):
        assert np.array_equal(model.decode(pool, parent, token), model.decode(pool, child, token))
    _assert_same_route(pool, parent, pool, child)


def test_a_prefill_that_does_not_fit_appends_nothing(model: ReferenceModel) -> None:
    pool = _pool(model, num_pages=2)
    route = pool.new_route()
    model.prefill(pool, route, _tokens(10))
    with pytest.raises(PoolExhaustedError):
        model.prefill(pool, route, _tokens(40))
    assert pool.length(route) == 10


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_other_kv_dtypes_are_batch_invariant_and_close_to_float16(kv_dtype: str) -> None:
    model = ReferenceModel.small(seed=0, kv_dtype=kv_dtype)
    assert model.layout.dtype == kv_dtype
    prompt = _tokens(21)
    pool = _pool(model)
    batched, stepped = pool.new_route(), pool.new_route()
    batched_logits = model.prefill(pool, batched, prompt)
    for token in prompt:
        stepped_logits = model.decode(pool, stepped, token)
    assert np.array_equal(batched_logits, stepped_logits)
    _assert_same_route(pool, batched, pool, stepped)

    # Same weights, different KV rounding: the logits differ a little, never wildly.
    reference = ReferenceModel.small(seed=0)
    ref_pool = _pool(reference)
    ref_route = ref_pool.new_route()
    ref_logits = reference.prefill(ref_pool, ref_route, prompt)
    assert np.allclose(batched_logits, ref_logits, atol=0.1)
    k, _ = pool.read(batched)
    if kv_dtype == "bfloat16":
        # bfloat16 keeps fp32's exponent: widening the stored bits gives K to ~3 digits.
        ref_k, _ = ref_pool.read(ref_route)
        widened = (k.astype(np.uint32) << 16).view(np.float32)
        assert np.allclose(widened, ref_k.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_activations_stay_sane_over_hundreds_of_tokens(model: ReferenceModel) -> None:
    pool = _pool(model, num_pages=32)
    route = pool.new_route()
    logits = model.prefill(pool, route, _tokens(300))
    assert np.all(np.isfinite(logits)) and 0.1 < float(logits.std()) < 10.0
    k, v = pool.read(route)
    assert np.all(np.isfinite(k)) and float(np.abs(k).max()) < 100
    assert np.all(np.isfinite(v)) and float(np.abs(v).max()) < 100


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "must not be empty"),
        ([1, 256], r"token 1 = 256 is out of range \[0, 256\)"),
        ([-1], r"token 0 = -1 is out of range"),
        ([1, 2.0], "token 1 is not an int"),
        ("abc", "sequence of ints"),
    ],
)
def test_bad_tokens_are_rejected_and_leave_the_route_alone(
    model: ReferenceModel, tokens: Any, message: str
) -> None:
    pool = _pool(model)
    route = pool.new_route()
    with pytest.raises(ValueError, match=message):
        model.prefill(pool, route, tokens)
    assert pool.length(route) == 0
    with pytest.raises(ValueError, match="non-negative"):
        model.generate(pool, route, [1], -1)


def test_a_pool_of_another_layout_is_rejected(model: ReferenceModel) -> None:
    pool = PagePool(AttentionLayout(4, 2, 16, "float32"), page_size=16, num_pages=4)
    with pytest.raises(ValueError, match="does not match the model's layout"):
        model.decode(pool, pool.new_route(), 1)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 256"):
        ReferenceConfig(vocab_size=100)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ReferenceConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="kv_dtype"):
        ReferenceConfig(kv_dtype="int8")
    assert ReferenceConfig().head_dim == 16
