"""The header of a blob record: the fields a chunk says about itself, their canonical JSON, and their checks.

The record layout around it is in `chunkstore.record`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkstore.base import is_hex_digest
from chunkstore.codecs import CODECS, RawCodec
from chunkstore.errors import ChunkFormatError

__all__ = ["DTYPES", "MAX_PAYLOAD_BYTES", "ChunkHeader", "check_header"]

# Far above any real chunk shard (a 405B model's whole-model fp32 chunk of 256
# tokens is ~270 MB); bounds what a forged header can make a decoder allocate.
MAX_PAYLOAD_BYTES = 1 << 32

# Storage dtypes. bfloat16 travels as its raw uint16 bit patterns, since numpy
# has no bfloat16; all are little-endian on disk whatever the host.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
}

_FIELDS = frozenset(
    {
        "fingerprint",
        "namespace",
        "prefix_hash",
        "parent_hash",
        "token_start",
        "tokens",
        "layers",
        "kv_heads",
        "dtype",
        "shape",
        "codec",
        "payload_blake3",
        "stored_blake3",
        "payload_size",
    }
)
_MAX_INDEX = 2**31 - 1  # layer and head indices
_MAX_POSITION = 2**63 - 1  # token positions fit a signed 64-bit column


def _canonical_json(obj: object) -> bytes:
    text = json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")


@dataclass(frozen=True)
class ChunkHeader:
    """What a blob record says about itself: identity, shard, layout and payload digests.

    `shape` is `[layers in shard, 2 (K then V), tokens, kv heads in shard,
    head_dim]`. `payload_blake3` is the blake3 of the decoded raw payload (C
    order, little-endian); `stored_blake3` that of the payload bytes as stored
    (equal to it for the raw codec); `payload_size` the stored length.
    """

    fingerprint: str
    namespace: str
    prefix_hash: bytes
    parent_hash: bytes
    token_start: int
    tokens: tuple[int, ...]
    layers: tuple[int, int]
    kv_heads: tuple[int, int]
    dtype: str
    shape: tuple[int, ...]
    codec: str
    payload_blake3: str
    stored_blake3: str
    payload_size: int

    @property
    def token_end(self) -> int:
        """One past the last token position the chunk covers."""
        return self.token_start + len(self.tokens)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the decoded KV (uint16 for bfloat16)."""
        return DTYPES[self.dtype]

    @property
    def raw_size(self) -> int:
        """Size in bytes of the decoded KV."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_json(self) -> bytes:
        """The canonical JSON encoding stored in the record."""
        return _canonical_json(
            {
                "fingerprint": self.fingerprint,
                "namespace": self.namespace,
                "prefix_hash": self.prefix_hash.hex(),
                "parent_hash": self.parent_hash.hex(),
                "token_start": self.token_start,
                "tokens": list(self.tokens),
                "layers": list(self.layers),
                "kv_heads": list(self.kv_heads),
                "dtype": self.dtype,
                "shape": list(self.shape),
                "codec": self.codec,
                "payload_blake3": self.payload_blake3,
                "stored_blake3": self.stored_blake3,
                "payload_size": self.payload_size,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> ChunkHeader:
        """Parse and validate a header; raise `ChunkFormatError` unless it is canonical and valid."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, absurd nesting
            raise ChunkFormatError(f"header is not valid UTF-8 JSON: {exc}") from None
        header = _header_from_json(obj)
        # One header, one byte string: keeps blob keys unique per content and
        # rules out smuggling (duplicate keys, non-canonical numbers).
        if header.to_json() != data:
            raise ChunkFormatError("header is not in canonical JSON form")
        return header


def check_header(h: ChunkHeader, error: type[ValueError]) -> None:
    """Check field values and their consistency; `error` is the exception class to raise."""
    if not is_hex_digest(h.fingerprint):
        raise error("fingerprint must be 64 lowercase hex characters")
    if not h.namespace:
        raise error("namespace must be a non-empty string")
    try:
        h.namespace.encode("utf-8")
    except UnicodeEncodeError:
        raise error("namespace must be encodable as UTF-8") from None
    for name, value in (("prefix_hash", h.prefix_hash), ("parent_hash", h.parent_hash)):
        if len(value) != 32:
            raise error(f"{name} must be 32 bytes, got {len(value)}")
    if h.token_start < 0:
        raise error(f"token_start must be >= 0, got {h.token_start}")
    if not h.tokens:
        raise error("tokens must hold at least one token id")
    if min(h.tokens) < 0 or max(h.tokens) > 0xFFFFFFFF:
        raise error("tokens must be uint32 token ids (0 <= id < 2**32)")
    if h.token_start + len(h.tokens) > _MAX_POSITION:
        raise error("token_start + len(tokens) must fit a signed 64-bit integer")
    for name, (lo, hi) in (("layers", h.layers), ("kv_heads", h.kv_heads)):
        if not 0 <= lo < hi <= _MAX_INDEX:
            raise error(f"{name} must be a range [lo, hi) with 0 <= lo < hi, got [{lo}, {hi})")
    if h.dtype not in DTYPES:
        raise error(f"dtype must be one of {sorted(DTYPES)}, got {h.dtype!r}")
    if len(h.shape) != 5 or min(h.shape) < 1:
        raise error(f"shape must be 5 positive dimensions [L, 2, T, H, D], got {list(h.shape)}")
    n_layers, kv, n_tokens, n_heads, _ = h.shape
    if n_layers != h.layers[1] - h.layers[0]:
        raise error(f"shape[0] = {n_layers} does not match layers {list(h.layers)}")
    if kv != 2:
        raise error(f"shape[1] must be 2 (K and V), got {kv}")
    if n_tokens != len(h.tokens):
        raise error(f"shape[2] = {n_tokens} does not match len(tokens) = {len(h.tokens)}")
    if n_heads != h.kv_heads[1] - h.kv_heads[0]:
        raise error(f"shape[3] = {n_heads} does not match kv_heads {list(h.kv_heads)}")
    if h.raw_size > MAX_PAYLOAD_BYTES:
        raise error(f"payload of {h.raw_size} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
    if h.codec not in CODECS:
        raise error(f"codec must be one of {sorted(CODECS)}, got {h.codec!r}")
    for name, digest in (("payload_blake3", h.payload_blake3), ("stored_blake3", h.stored_blake3)):
        if not is_hex_digest(digest):
            raise error(f"{name} must be 64 lowercase hex characters")
    if h.payload_size < 0:
        raise error(f"payload_size must be >= 0, got {h.payload_size}")
    try:
        CODECS[h.codec].check_sizes(h.raw_size, h.payload_size)
    except ChunkFormatError as exc:
        raise error(str(exc)) from None
    if isinstance(CODECS[h.codec], RawCodec) and h.stored_blake3 != h.payload_blake3:
        raise error("stored_blake3 must equal payload_blake3 for the raw codec")


def _json_field(obj: dict[str, Any], name: str, kind: type) -> Any:
    value = obj[name]
    # bool is an int subclass; it is never a valid header number.
    if type(value) is not kind:
        raise ChunkFormatError(f"header field {name!r} must be {kind.__name__}")
    return value


def _json_ints(obj: dict[str, Any], name: str, length: int | None = None) -> tuple[int, ...]:
    value = _json_field(obj, name, list)
    if length is not None and len(value) != length:
        raise ChunkFormatError(f"header field {name!r} must have {length} items")
    if not set(map(type, value)) <= {int}:  # exactly int (no bool), checked in C: 256 ids a chunk
        raise ChunkFormatError(f"header field {name!r} must hold integers only")
    return tuple(value)


def _json_hash(obj: dict[str, Any], name: str) -> bytes:
    value = _json_field(obj, name, str)
    if not is_hex_digest(value):
        raise ChunkFormatError(f"header field {name!r} must be 64 lowercase hex characters")
    return bytes.fromhex(value)


def _header_from_json(obj: object) -> ChunkHeader:
    if not isinstance(obj, dict):
        raise ChunkFormatError("header must be a JSON object")
    if obj.keys() != _FIELDS:
        missing = sorted(_FIELDS - obj.keys())
        extra = sorted(obj.keys() - _FIELDS)
        raise ChunkFormatError(f"header fields: missing {missing}, unexpected {extra}")
    layers = _json_ints(obj, "layers", 2)
    kv_heads = _json_ints(obj, "kv_heads", 2)
    header = ChunkHeader(
        fingerprint=_json_field(obj, "fingerprint", str),
        namespace=_json_field(obj, "namespace", str),
        prefix_hash=_json_hash(obj, "prefix_hash"),
        parent_hash=_json_hash(obj, "parent_hash"),
        token_start=_json_field(obj, "token_start", int),
        tokens=_json_ints(obj, "tokens"),
        layers=(layers[0], layers[1]),
        kv_heads=(kv_heads[0], kv_heads[1]),
        dtype=_json_field(obj, "dtype", str),
        shape=_json_ints(obj, "shape"),
        codec=_json_field(obj, "codec", str),
        payload_blake3=_json_field(obj, "payload_blake3", str),
        stored_blake3=_json_field(obj, "stored_blake3", str),
        payload_size=_json_field(obj, "payload_size", int),
    )
    check_header(header, ChunkFormatError)
    return header
