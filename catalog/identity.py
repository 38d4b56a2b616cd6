"""Identity spec v1: fingerprints of a model and its execution, and prefix chain hashes."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, cast, get_args

import blake3
import numpy as np

from catalog.errors import IdentityError

FORMAT_VERSION = 1
# A descriptor names a model and the config fields that change its K/V: a few KiB at most.
# The cap keeps one tenant from storing megabytes per registration in a shared catalog.
MAX_DESCRIPTOR_BYTES = 64 << 10
ROOT_DOMAIN = b"kvc/prefix/v1/root"
CHAIN_DOMAIN = b"kvc/prefix/v1"
HASH_SIZE = 32
MAX_TOKEN_ID = 2**32 - 1

DType = Literal["float16", "bfloat16", "float32"]
DTYPES: tuple[str, ...] = get_args(DType)
_HEX64 = re.compile(r"[0-9a-f]{64}")


def canonical_json(value: object) -> bytes:
    """The spec's canonical encoding: sorted keys, no insignificant space, UTF-8, no NaN."""
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise IdentityError(f"fingerprint descriptor is not canonical JSON: {exc}") from exc
    return text.encode("utf-8")


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Shape of the attention state one token occupies: K and V per layer and kv head.

    `bfloat16` values travel as their raw 16-bit patterns (numpy has no bfloat16).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise IdentityError(f"AttentionLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise IdentityError(
                f"AttentionLayout.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype that holds this layout's values (uint16 for bfloat16)."""
        return np.dtype(
            {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}[self.dtype]
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer and kv head for one token position."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.numpy_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AttentionLayout:
        expected = {"num_layers", "num_kv_heads", "head_dim", "dtype"}
        if not isinstance(d, Mapping) or set(d) != expected:
            raise IdentityError(f"attention_layout must have exactly the fields {sorted(expected)}")
        return cls(d["num_layers"], d["num_kv_heads"], d["head_dim"], d["dtype"])


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The compatibility identity of a model and its execution (spec v1).

    `hex` is the blake3 of the canonical JSON of `descriptor`; two builds that
    may produce different numbers must differ in some descriptor field.
    """

    hex: str
    # The hex commits to the descriptor, so equality and hashing use the hex alone.
    descriptor: Mapping[str, Any] = field(compare=False, hash=False, repr=False)

    @classmethod
    def create(
        cls,
        *,
        weights: str,
        architecture: str,
        config: Mapping[str, Any],
        attention_layout: AttentionLayout,
        execution_variant: str = "default",
    ) -> Fingerprint:
        """Fingerprint a model: `weights` is a content hash or immutable revision id (required)."""
        if not isinstance(weights, str) or not weights.strip():
            raise IdentityError(
                "weights is required: a content hash of the weights or an immutable revision id"
            )
        if not isinstance(architecture, str) or not architecture.strip():
            raise IdentityError("architecture must be a non-empty string")
        if not isinstance(execution_variant, str) or not execution_variant.strip():
            raise IdentityError("execution_variant must be a non-empty string")
        if not isinstance(config, Mapping):
            raise IdentityError(f"config must be a mapping, got {type(config).__name__}")
        if not isinstance(attention_layout, AttentionLayout):
            raise IdentityError("attention_layout must be an AttentionLayout")
        descriptor = {
            "format": FORMAT_VERSION,
            "weights": weights,
            "architecture": architecture,
            "config": dict(config),
            "attention_layout": attention_layout.to_dict(),
            "execution_variant": execution_variant,
        }
        return cls.from_descriptor(descriptor)

    @classmethod
    def from_descriptor(cls, descriptor: Mapping[str, Any]) -> Fingerprint:
        """Rebuild a fingerprint from a stored descriptor (validated, then re-hashed)."""
        expected = {
            "format",
            "weights",
            "architecture",
            "config",
            "attention_layout",
            "execution_variant",
        }
        if not isinstance(descriptor, Mapping) or set(descriptor) != expected:
            raise IdentityError(
                f"a fingerprint descriptor has exactly the fields {sorted(expected)}"
            )
        if descriptor["format"] != FORMAT_VERSION:
            raise IdentityError(f"unsupported fingerprint format {descriptor['format']!r}")
        AttentionLayout.from_dict(descriptor["attention_layout"])
        # Round-trip through JSON so the stored descriptor is exactly what was hashed.
        encoded = canonical_json(descriptor)
        if len(encoded) > MAX_DESCRIPTOR_BYTES:
            raise IdentityError(
                f"a fingerprint descriptor is at most {MAX_DESCRIPTOR_BYTES} bytes of canonical "
                f"JSON, this one is {len(encoded)}: keep only the config fields that change K/V"
            )
        frozen = cast(dict[str, Any], json.loads(encoded))
        return cls(hex=blake3.blake3(encoded).hexdigest(), descriptor=frozen)

    @property
    def layout(self) -> AttentionLayout:
        return AttentionLayout.from_dict(self.descriptor["attention_layout"])

    @property
    def canonical(self) -> bytes:
        """The exact bytes whose blake3 is `hex`."""
        return canonical_json(self.descriptor)

    def __str__(self) -> str:
        return self.hex


def is_hex64(value: object) -> TypeGuard[str]:
    """Whether `value` is 64 lowercase hex characters (a fingerprint, blob key or sha256 hex)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def fingerprint_hex(value: Fingerprint | str) -> str:
    """The hex of a `Fingerprint`, or a validated 64-character lowercase hex string."""
    if isinstance(value, Fingerprint):
        return value.hex
    if isinstance(value, str) and _HEX64.fullmatch(value):
        return value
    raise IdentityError(
        f"malformed fingerprint {value!r:.80}: expected 64 lowercase hex characters"
    )


def chain_root(namespace: str) -> bytes:
    """The root of a namespace's prefix chains; namespaces salt every hash beneath them."""
    if not isinstance(namespace, str) or not namespace:
        raise IdentityError(f"namespace must be a non-empty string, got {namespace!r}")
    return blake3.blake3(ROOT_DOMAIN + namespace.encode("utf-8")).digest()


def token_array(
    tokens: Sequence[int] | np.ndarray[Any, Any],
) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Validate token ids and return them as a little-endian uint32 array (no copy when already one)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4") and tokens.ndim == 1:
        if tokens.size == 0:
            raise IdentityError("tokens must not be empty")
        return tokens
    if isinstance(tokens, str | bytes | bytearray):
        raise IdentityError("tokens must be a sequence of integer token ids, not a string or bytes")
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise IdentityError(f"tokens must be a sequence of integer token ids: {exc}") from exc
    if arr.ndim != 1:
        raise IdentityError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise IdentityError("tokens must not be empty")
    if arr.dtype == object:
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in arr):
            raise IdentityError("tokens must be integers")
        for t in arr:
            if t < 0 or t > MAX_TOKEN_ID:
                raise IdentityError(f"token id {t} is out of range [0, {MAX_TOKEN_ID}]")
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise IdentityError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize > 4 or arr.dtype.kind == "i":
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = lo if lo < 0 else hi
            raise IdentityError(f"token id {bad} is out of range [0, {MAX_TOKEN_ID}]")
    return arr.astype("<u4", copy=False)


def _token_bytes(tokens: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
    return token_array(tokens).tobytes()


def check_prefix_hash(prefix_hash: Any) -> bytes:
    """`prefix_hash` if it is a 32-byte chain hash, else `IdentityError`."""
    if not isinstance(prefix_hash, bytes) or len(prefix_hash) != 32:
        raise IdentityError(f"prefix hash must be 32 bytes, got {prefix_hash!r:.80}")
    return prefix_hash


def chain_hash(parent: bytes, tokens: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
    """The prefix hash of a chunk: commits to its parent's hash and its own token ids."""
    if not isinstance(parent, bytes) or len(parent) != HASH_SIZE:
        raise IdentityError(f"parent must be a {HASH_SIZE}-byte hash")
    body = _token_bytes(tokens)
    count = (len(body) // 4).to_bytes(4, "little")
    return blake3.blake3(CHAIN_DOMAIN + parent + count + body).digest()


def prefix_hashes(
    namespace: str,
    tokens: Sequence[int] | np.ndarray[Any, Any],
    chunk_size: int,
    *,
    max_chunks: int | None = None,
) -> list[bytes]:
    """One prefix hash per chunk of `tokens` (the last chunk may be partial).

    `max_chunks` stops after that many chunks (a lookup needs no more).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise IdentityError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    body = memoryview(token_array(tokens).tobytes())
    n = len(body) // 4
    parent = chain_root(namespace)
    out: list[bytes] = []
    step = 4 * chunk_size
    full_count = (chunk_size).to_bytes(4, "little")
    for start in range(0, 4 * n, step):
        if max_chunks is not None and len(out) >= max_chunks:
            break
        piece = body[start : start + step]
        count = full_count if len(piece) == step else (len(piece) // 4).to_bytes(4, "little")
        h = blake3.blake3(CHAIN_DOMAIN)
        h.update(parent)
        h.update(count)
        h.update(piece)
        parent = h.digest()
        out.append(parent)
    return out
