"""A tiny Llama-style reference decoder in numpy whose attention state lives in page-pool pages.

It documents the contract every engine adapter keeps with kvc: the engine owns
compute, kvc owns the KV pages. The engine reads a route's K/V from the pool,
computes the new positions, and appends their K/V to the route; it keeps no
attention state of its own between calls. Because attention only ever sees the
K/V as stored (rounded to the pool dtype), a route whose pages were restored
from a blob resumes exactly like one whose pages were computed here.

Every position is computed by the same row-by-row code path, whether it arrives
in a long prefill or as a single decode step, and every matrix product is an
explicit elementwise multiply followed by a sequential reduction (no BLAS), so
K, V and logits of a position are bit-identical however the tokens were batched.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import blake3
import numpy as np
import numpy.typing as npt

from catalog import DTYPES, AttentionLayout, Fingerprint
from catalog.identity import DType

F32 = npt.NDArray[np.float32]

ARCHITECTURE = "kvc-reference-llama"
EXECUTION_VARIANT = "numpy-fp32-rowwise"
# RoPE rows are computed in fixed blocks so a position's cos/sin never depend on
# how far the table had grown when it was first needed.
_ROPE_BLOCK = 1024


class KVPool(Protocol):
    """The part of `restore.pool.PagePool` an engine uses."""

    @property
    def layout(self) -> AttentionLayout: ...

    def length(self, route: int, /) -> int: ...

    def append(self, route: int, k: npt.NDArray[Any], v: npt.NDArray[Any], /) -> object: ...

    def read(
        self, route: int, start: int = 0, end: int | None = None, /
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]: ...


@dataclass(frozen=True, slots=True)
class ReferenceConfig:
    """Hyperparameters of the reference decoder; part of its fingerprint."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    kv_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReferenceConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size < 256:
            raise ValueError(f"ReferenceConfig.vocab_size must be >= 256, got {self.vocab_size}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise ValueError("rope_theta and rms_eps must be positive")
        if self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(DTYPES)}, got {self.kv_dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


def _matvec(x: F32, w: F32) -> F32:
    """x @ w with a fixed summation order: row i of w is added in turn, for every shape."""
    out: F32 = np.add.reduce(x[:, None] * w, axis=0)
    return out


def _rms_norm(x: F32, weight: F32, eps: float) -> F32:
    scale = np.float32(1.0) / np.sqrt(np.add.reduce(x * x) / np.float32(x.size) + np.float32(eps))
    out: F32 = x * scale * weight
    return out


def _silu(x: F32) -> F32:
    # exp(-|x|) never overflows, so large activations cannot raise a warning.
    e = np.exp(-np.abs(x))
    sigmoid = np.where(x >= 0, np.float32(1.0) / (1 + e), e / (1 + e))
    out: F32 = x * sigmoid
    return out


def _to_bfloat16_bits(x: F32) -> npt.NDArray[np.uint16]:
    """Round fp32 to bfloat16 (nearest, ties to even) and return the raw 16-bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7FC0)
    out: npt.NDArray[np.uint16] = np.where(np.isnan(x), quiet_nan, rounded)
    return out


def _from_bfloat16_bits(bits: npt.NDArray[Any]) -> F32:
    out: F32 = (bits.astype(np.uint32) << 16).view(np.float32)
    return out


class ReferenceModel:
    """A deterministic Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    It keeps no per-route state, so one model may serve many routes and threads.
    """

    def __init__(self, config: ReferenceConfig, seed: int) -> None:
        if not isinstance(config, ReferenceConfig):
            raise TypeError(f"config must be a ReferenceConfig, got {type(config).__name__}")
        self._config = config
        self._layout = AttentionLayout(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            cast(DType, config.kv_dtype),  # ReferenceConfig checked it is one of DTYPES
        )
        self._weights = self._init_weights(np.random.default_rng(seed))
        for array in self._weights.values():
            # The fingerprint vouches for these bytes, so nothing may change them later.
            array.setflags(write=False)
        digest = blake3.blake3()
        for name, array in self._weights.items():
            digest.update(f"{name}:{array.shape}\n".encode())
            digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
        self._fingerprint = Fingerprint.create(
            weights=digest.hexdigest(),
            architecture=ARCHITECTURE,
            config=dataclasses.asdict(config),
            attention_layout=self._layout,
            execution_variant=EXECUTION_VARIANT,
        )
        half = config.head_dim // 2
        self._swap = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
        self._inv_freq = 1.0 / config.rope_theta ** (
            np.arange(half, dtype=np.float64) * 2.0 / config.head_dim
        )
        # [positions, 2 (cos, sin), head_dim]; replaced whole, never grown in place, so
        # threads sharing the model always see a consistent table.
        self._rope = np.empty((0, 2, config.head_dim), dtype=np.float32)

    @classmethod
    def small(cls, seed: int = 0, kv_dtype: str = "float16") -> ReferenceModel:
        """The tiny default: 4 layers, hidden 64, 4 query heads sharing 2 kv heads."""
        return cls(ReferenceConfig(kv_dtype=kv_dtype), seed)

    @property
    def config(self) -> ReferenceConfig:
        return self._config

    @property
    def vocab_size(self) -> int:
        return self._config.vocab_size

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def fingerprint(self) -> Fingerprint:
        return self._fingerprint

    def _init_weights(self, rng: np.random.Generator) -> dict[str, F32]:
        c = self._config
        d = c.head_dim
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * d

        def dense(fan_in: int, *shape: int) -> F32:
            # 1/sqrt(fan_in) keeps every projection's output near unit scale.
            w: F32 = (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)
            return w

        # Insertion order is the hashing order of the fingerprint: never reorder.
        weights: dict[str, F32] = {"embed": dense(1, c.vocab_size, c.hidden)}
        weights["attn_norm"] = np.ones((c.num_layers, c.hidden), dtype=np.float32)
        weights["wqkv"] = dense(c.hidden, c.num_layers, c.hidden, qkv_out)
        weights["wo"] = dense(c.num_heads * d, c.num_layers, c.num_heads * d, c.hidden)
        weights["ffn_norm"] = np.ones((c.num_layers, c.hidden), dtype=np.float32)
        weights["w_gate_up"] = dense(c.hidden, c.num_layers, c.hidden, 2 * c.ffn)
        weights["w_down"] = dense(c.ffn, c.num_layers, c.ffn, c.hidden)
        weights["final_norm"] = np.ones(c.hidden, dtype=np.float32)
        weights["lm_head"] = dense(c.hidden, c.hidden, c.vocab_size)
        return weights

    # -- public API ---------------------------------------------------------------

    def prefill(self, pool: KVPool, route: int, tokens: Sequence[int]) -> F32:
        """Feed `tokens` after the route's current length; returns the last position's logits.

        Nothing is appended to the route unless every position was computed.
        """
        ids = self._check_tokens(tokens)
        self._check_pool(pool)
        start = pool.length(route)
        n = len(ids)
        k_cache, v_cache = self._history(pool, route, start, start + n)
        c = self._config
        store_dtype = self._layout.numpy_dtype
        shape = (c.num_layers, n, c.num_kv_heads, c.head_dim)
        k_new = np.empty(shape, dtype=store_dtype)
        v_new = np.empty(shape, dtype=store_dtype)
        rope = self._rope_table(start + n)
        logits = np.empty(c.vocab_size, dtype=np.float32)
        for i, token in enumerate(ids):
            pos = start + i
            logits = self._forward(
                token, pos, rope[pos], k_cache, v_cache, k_new[:, i], v_new[:, i]
            )
        pool.append(route, k_new, v_new)
        return logits

    def decode(self, pool: KVPool, route: int, token: int) -> F32:
        """Feed one token at the route's next position; returns its logits."""
        return self.prefill(pool, route, [token])

    def generate(self, pool: KVPool, route: int, tokens: Sequence[int], n: int) -> list[int]:
        """Prefill `tokens`, then pick `n` tokens greedily (argmax).

        Each picked token but the last is fed back; the last one is the pending
        token of the continuation, so the route ends `len(tokens) + n - 1`
        positions longer (`len(tokens)` when n is 0).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        logits = self.prefill(pool, route, tokens)
        out: list[int] = []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            if i + 1 < n:
                logits = self.decode(pool, route, out[-1])
        return out

    def trace(
        self, pool: KVPool, route: int, tokens: Sequence[int], n: int
    ) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
        """Prefill `tokens`, then `n` greedy steps, each picked token fed back.

        Returns the picked tokens and every step's logits (n + 1 arrays): what an
        exactness check compares between a straight and a resumed run.
        """
        logits = [self.prefill(pool, route, tokens)]
        picked: list[int] = []
        for _ in range(n):
            picked.append(int(np.argmax(logits[-1])))
            logits.append(self.decode(pool, route, picked[-1]))
        return picked, logits

    # -- validation ---------------------------------------------------------------

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence | np.ndarray):
            raise ValueError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        if len(tokens) == 0:
            raise ValueError("tokens must not be empty")
        ids: list[int] = []
        for i, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int | np.integer):
                raise ValueError(f"token {i} is not an int: {token!r}")
            if not 0 <= token < self._config.vocab_size:
                raise ValueError(
                    f"token {i} = {int(token)} is out of range [0, {self._config.vocab_size})"
                )
            ids.append(int(token))
        return ids

    def _check_pool(self, pool: KVPool) -> None:
        if pool.layout != self._layout:
            raise ValueError(
                f"pool KV layout {pool.layout} does not match the model's layout {self._layout}"
            )

    # -- compute ------------------------------------------------------------------

    def _store(self, x: F32) -> npt.NDArray[Any]:
        """Round K or V to the pool dtype, exactly as the pool will hold it."""
        dtype = self._config.kv_dtype
        if dtype == "float16":
            return x.astype(np.float16)
        if dtype == "bfloat16":
            return _to_bfloat16_bits(x)
        return x.astype(np.float32)

    def _load(self, stored: npt.NDArray[Any]) -> F32:
        if self._config.kv_dtype == "bfloat16":
            return _from_bfloat16_bits(stored)
        return stored.astype(np.float32)

    def _history(self, pool: KVPool, route: int, start: int, end: int) -> tuple[F32, F32]:
        """fp32 K and V caches `[layers, kv_heads, end, head_dim]` holding the route's positions."""
        c = self._config
        k_cache = np.empty((c.num_layers, c.num_kv_heads, end, c.head_dim), dtype=np.float32)
        v_cache = np.empty_like(k_cache)
        if start:
            k, v = pool.read(route, 0, start)
            expected = (c.num_layers, start, c.num_kv_heads, c.head_dim)
            if k.shape != expected or v.shape != expected:
                raise ValueError(f"pool returned K/V shaped {k.shape}, expected {expected}")
            k_cache[:, :, :start] = self._load(k).transpose(0, 2, 1, 3)
            v_cache[:, :, :start] = self._load(v).transpose(0, 2, 1, 3)
        return k_cache, v_cache

    def _rope_table(self, positions: int) -> F32:
        """The RoPE table covering at least `positions`: `x * cos + x[:, swap] * sin` rotates."""
        table = self._rope
        have = table.shape[0]
        if positions <= have:
            return table
        blocks = [table]
        for lo in range(have, positions, _ROPE_BLOCK):
            angles = np.arange(lo, lo + _ROPE_BLOCK, dtype=np.float64)[:, None] * self._inv_freq
            # Rotate-half convention: (a, b) -> (a cos - b sin, b cos + a sin).
            cos = np.concatenate([np.cos(angles), np.cos(angles)], axis=1)
            sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1)
            blocks.append(np.stack([cos, sin], axis=1).astype(np.float32))
        table = np.concatenate(blocks)
        self._rope = table
        return table

    def _forward(
        self,
        token: int,
        pos: int,
        rope: F32,
        k_cache: F32,
        v_cache: F32,
        k_out: npt.NDArray[Any],
        v_out: npt.NDArray[Any],
    ) -> F32:
        """Compute one position; writes its stored K/V to `k_out`/`v_out` and the caches."""
        c = self._config
        w = self._weights
        d = c.head_dim
        group = c.num_heads // c.num_kv_heads
        q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
        scale = np.float32(1.0 / math.sqrt(d))
        x = w["embed"][token].copy()
        for layer in range(c.num_layers):
            h = _rms_norm(x, w["attn_norm"][layer], c.rms_eps)
            qkv = _matvec(h, w["wqkv"][layer])
            qk = qkv[: q_size + kv_size].reshape(c.num_heads + c.num_kv_heads, d)
            qk = qk * rope[0] + qk[:, self._swap] * rope[1]
            q, k = qk[: c.num_heads] * scale, qk[c.num_heads :]
            v = qkv[q_size + kv_size :].reshape(c.num_kv_heads, d)
            k_out[layer] = self._store(k)
            v_out[layer] = self._store(v)
            # Attention sees K/V as stored, so restored pages behave like computed ones.
            k_cache[layer, :, pos] = self._load(k_out[layer])
            v_cache[layer, :, pos] = self._load(v_out[layer])
            keys = k_cache[layer, :, : pos + 1]  # [kv_heads, T, d]
            values = v_cache[layer, :, : pos + 1]
            # Query head j attends with kv head j // group (grouped-query attention).
            scores = (q.reshape(c.num_kv_heads, group, 1, d) * keys[:, None]).sum(axis=-1)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)  # [kv_heads, group, T]
            attn = (probs[..., None] * values[:, None]).sum(axis=2).reshape(q_size)
            x = x + _matvec(attn, w["wo"][layer])
            h = _rms_norm(x, w["ffn_norm"][layer], c.rms_eps)
            gate_up = _matvec(h, w["w_gate_up"][layer])
            x = x + _matvec(_silu(gate_up[: c.ffn]) * gate_up[c.ffn :], w["w_down"][layer])
        return _matvec(_rms_norm(x, w["final_norm"], c.rms_eps), w["lm_head"])
