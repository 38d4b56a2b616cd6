"""The blob record: round trips, exact headers, zero-copy reads, and refusal of any damaged or forged bytes."""

from __future__ import annotations

import json
import mmap
import struct
from functools import cache
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.codecs import CODECS, ZstdCodec
from chunkstore.errors import ChunkFormatError, ChunkIntegrityError, InvalidKeyError
from chunkstore.record import (
    MAGIC,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGNMENT,
    ChunkHeader,
    EncodedChunk,
    RawRecord,
    blake3_hex,
    decode_chunk,
    encode_chunk,
    read_header,
)
from tests.records import canonical, forge

FP = "ab" * 32
PREFIX = bytes(range(32))
PARENT = bytes(range(32, 64))
BAD = (ChunkFormatError, ChunkIntegrityError)
DTYPE_NAMES = ["float16", "bfloat16", "float32"]
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}


def make_kv(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """KV-like values in the storage dtype (bfloat16 as the top half of float32 bits)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape, dtype=np.float32) * 2.0
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(STORAGE[dtype])


def encode(kv: np.ndarray, **overrides: Any) -> EncodedChunk:
    args: dict[str, Any] = {
        "fingerprint": FP,
        "namespace": "tenant-a",
        "prefix_hash": PREFIX,
        "parent_hash": PARENT,
        "token_start": 256,
        "kv": kv,
    }
    if "tokens" not in overrides:
        args["tokens"] = list(range(1000, 1000 + kv.shape[2]))
    args.update(overrides)
    return encode_chunk(**args)


@cache
def small_record(codec: str) -> EncodedChunk:
    return encode(make_kv("float16", (2, 2, 3, 2, 8)), codec=codec)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def header_dict(record: EncodedChunk) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(record.header.to_json())
    return loaded


# -- round trips -----------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_round_trip_every_codec_and_dtype(codec: str, dtype: str) -> None:
    kv = make_kv(dtype, (3, 2, 5, 2, 16))
    rec = encode(kv, codec=codec, dtype=dtype)
    for out in (decode_chunk(rec.data, expected_key=rec.key), decode_chunk(rec.data)):
        assert same_bits(out.kv, kv)
        assert out.header == rec.header
        assert out.header.dtype == dtype
        assert not out.kv.flags.writeable


def test_header_fields_preserved_exactly() -> None:
    kv = make_kv("bfloat16", (2, 2, 4, 1, 8))
    rec = encode(
        kv, layers=(10, 12), kv_heads=(3, 4), tokens=[0, 7, 2**32 - 1, 5], namespace="ns/é✓"
    )
    header = decode_chunk(rec.data, expected_key=rec.key).header
    assert header.fingerprint == FP
    assert header.namespace == "ns/é✓"
    assert header.prefix_hash == PREFIX and header.parent_hash == PARENT
    assert header.token_start == 256 and header.token_end == 260
    assert header.tokens == (0, 7, 2**32 - 1, 5)
    assert header.layers == (10, 12) and header.kv_heads == (3, 4)
    assert header.dtype == "bfloat16" and header.shape == (2, 2, 4, 1, 8)
    assert header.codec == "raw"
    assert header.payload_blake3 == blake3.blake3(kv.tobytes()).hexdigest()
    assert header.payload_size == kv.nbytes


def test_default_shard_is_the_whole_array() -> None:
    header = encode(make_kv("float16", (3, 2, 2, 5, 4))).header
    assert header.layers == (0, 3) and header.kv_heads == (0, 5)


def test_key_is_blake3_of_the_record_and_encoding_is_deterministic() -> None:
    kv = make_kv("float32", (2, 2, 3, 2, 4))
    first, second = encode(kv, codec="zstd-planes"), encode(kv.copy(), codec="zstd-planes")
    assert first.key == blake3.blake3(first.data).hexdigest()
    assert first.data == second.data


def test_non_contiguous_and_big_endian_inputs_are_stored_little_endian() -> None:
    kv = make_kv("float32", (2, 2, 3, 2, 4))
    reference = encode(kv)
    assert encode(kv.astype(">f4")).data == reference.data
    transposed = np.ascontiguousarray(kv.transpose(0, 1, 2, 4, 3)).transpose(0, 1, 2, 4, 3)
    assert not transposed.flags.c_contiguous
    assert encode(transposed).data == reference.data


def test_tokens_may_be_a_numpy_array() -> None:
    kv = make_kv("float16", (1, 2, 3, 1, 4))
    rec = encode(kv, tokens=np.array([5, 6, 7], dtype=np.uint32))
    assert rec.header.tokens == (5, 6, 7)
    assert encode(kv, tokens=[5, 6, 7]).key == rec.key


# -- zero copy and header reads --------------------------------------------


def test_raw_decode_is_a_zero_copy_view_of_the_record() -> None:
    rec = encode(make_kv("float16", (2, 2, 3, 2, 8)))
    out = decode_chunk(rec.data, expected_key=rec.key)
    assert np.shares_memory(out.kv, np.frombuffer(rec.data, dtype=np.uint8))


def test_raw_decode_from_mmap_is_aligned_and_in_place(tmp_path: Path) -> None:
    rec = encode(make_kv("float32", (2, 2, 3, 2, 8)))
    path = tmp_path / "blob"
    path.write_bytes(rec.data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        out = decode_chunk(mm, expected_key=rec.key)
        assert out.kv.ctypes.data % PAYLOAD_ALIGNMENT == 0
        assert not out.kv.flags.writeable
        assert same_bits(out.kv, make_kv("float32", (2, 2, 3, 2, 8)))
        del out  # release the buffer export so the mmap can close


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_read_header_from_whole_record_or_its_first_bytes(codec: str) -> None:
    rec = small_record(codec)
    assert read_header(rec.data) == rec.header
    header_end = 44 + len(rec.header.to_json())
    assert read_header(memoryview(rec.data)[:header_end]) == rec.header
    with pytest.raises(ChunkFormatError, match="truncated"):
        read_header(rec.data[: header_end - 1])


def test_header_json_is_canonical() -> None:
    header = small_record("raw").header
    text = header.to_json()
    assert ChunkHeader.from_json(text) == header
    assert json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode() == text
    spaced = json.dumps(json.loads(text), sort_keys=True).encode()
    with pytest.raises(ChunkFormatError, match="canonical"):
        ChunkHeader.from_json(spaced)


# -- refusals on encode ----------------------------------------------------


def test_wrong_expected_key_is_an_integrity_error() -> None:
    rec = small_record("raw")
    with pytest.raises(ChunkIntegrityError, match="expected key"):
        decode_chunk(rec.data, expected_key=small_record("zstd").key)
    with pytest.raises(InvalidKeyError):
        decode_chunk(rec.data, expected_key="../etc/passwd")


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_known_header_is_taken_only_for_bytes_that_hash_to_its_key(codec: str) -> None:
    """A record read again under its key may skip its header's parse: same header, same KV.
    Anything that does not hash to the key is refused first, and a known header is refused
    without a key or when it cannot be the record's."""
    kv = make_kv("float16", (3, 2, 5, 2, 16))
    rec = encode(kv, codec=codec)
    got = decode_chunk(rec.data, expected_key=rec.key, known_header=rec.header)
    assert got.header is rec.header and same_bits(got.kv, kv)
    flipped = bytearray(rec.data)
    flipped[len(flipped) // 2] ^= 1
    for damaged in (bytes(flipped), rec.data[:-1], rec.data + b"\0"):
        with pytest.raises(ChunkIntegrityError, match="expected key"):
            decode_chunk(damaged, expected_key=rec.key, known_header=rec.header)
    with pytest.raises(ValueError, match="expected_key"):
        decode_chunk(rec.data, known_header=rec.header)
    big = encode(make_kv("float16", (3, 2, 50, 2, 16)), codec="raw")
    with pytest.raises(ValueError, match="not this record's"):
        decode_chunk(rec.data, expected_key=rec.key, known_header=big.header)


@pytest.mark.parametrize("threads", [1, blake3.blake3.AUTO])
def test_hashing_on_one_thread_or_all_verifies_alike(threads: int) -> None:
    """A restore that verifies chunks side by side hashes each on one thread: same digests,
    same refusals, for records above and below the size where hashing goes parallel."""
    for shape in ((2, 2, 4, 2, 8), (4, 2, 256, 8, 128)):  # 1 KiB and 4 MiB of float16
        rec = encode(make_kv("float16", shape))
        assert blake3_hex(rec.data, threads=threads) == rec.key
        got = decode_chunk(rec.data, expected_key=rec.key, hash_threads=threads)
        assert same_bits(got.kv, make_kv("float16", shape))
        flipped = bytearray(rec.data)
        flipped[-1] ^= 1
        with pytest.raises(ChunkIntegrityError):
            decode_chunk(bytes(flipped), expected_key=rec.key, hash_threads=threads)


NONFINITE: dict[str, list[np.generic]] = {
    "float16": [np.float16(np.nan), np.float16(np.inf), np.float16(-np.inf)],
    "float32": [np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf)],
    # +Inf, -Inf, quiet NaN, signalling NaN, negative NaN
    "bfloat16": [np.uint16(p) for p in (0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF)],
}


@pytest.mark.parametrize(
    ("dtype", "value"), [(d, v) for d, values in NONFINITE.items() for v in values], ids=repr
)
def test_nan_and_inf_are_refused(dtype: str, value: np.generic) -> None:
    kv = make_kv(dtype, (2, 2, 300, 2, 128))  # > one check block
    kv[1, 1, 299, 1, 127] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode(kv, dtype=dtype)


def test_extreme_finite_values_are_accepted() -> None:
    bf16 = np.array([0x7F7F, 0xFF7F, 0x0001, 0x8000], dtype=np.uint16).reshape(1, 2, 1, 1, 2)
    fp16 = np.array([65504, -65504, 6e-8, -0.0], dtype=np.float16).reshape(1, 2, 1, 1, 2)
    for kv in (bf16, fp16):
        rec = encode(kv, tokens=[1])
        assert same_bits(decode_chunk(rec.data).kv, kv)


KV = make_kv("float16", (2, 2, 3, 2, 4))

BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"tokens": [1, 2]}, r"shape\[2\] = 3 does not match len\(tokens\) = 2"),
    ({"tokens": []}, "tokens"),
    ({"tokens": [1, 2, 2**32]}, "tokens must be uint32"),
    ({"tokens": [1, 2, -1]}, "tokens must be uint32"),
    ({"tokens": [1, 2, 3.0]}, "tokens must be an integer"),
    ({"tokens": "abc"}, "tokens must be a sequence"),
    ({"prefix_hash": b"\0" * 31}, "prefix_hash must be 32 bytes"),
    ({"parent_hash": PARENT.hex()}, "parent_hash must be 32 bytes, got str"),
    ({"fingerprint": "AB" * 32}, "fingerprint"),
    ({"fingerprint": "ab" * 31}, "fingerprint"),
    ({"namespace": ""}, "namespace"),
    ({"namespace": "\ud800"}, "namespace"),
    ({"token_start": -1}, "token_start"),
    ({"token_start": True}, "token_start"),
    ({"token_start": 2**63}, "64-bit"),
    ({"layers": (0, 3)}, r"shape\[0\] = 2 does not match layers"),
    ({"layers": (2, 2)}, "layers must be a range"),
    ({"kv_heads": (5, 6, 7)}, "kv_heads must be a pair"),
    ({"kv_heads": (1, 2)}, r"shape\[3\] = 2 does not match kv_heads"),
    ({"codec": "lz4"}, "codec must be one of"),
    ({"dtype": "bfloat16"}, "dtype 'bfloat16' does not match"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"kv": KV.astype(np.float64)}, "kv dtype"),
    ({"kv": KV.astype(np.int16)}, "kv dtype"),
    ({"kv": KV[0]}, "5 dimensions"),
    ({"kv": np.concatenate([KV, KV], axis=1)}, r"shape\[1\] must be 2"),
    ({"kv": KV[:, :, :, :, :0]}, "positive dimensions"),
    ({"kv": KV.tolist()}, "kv must be a numpy array"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_ARGUMENTS, ids=lambda v: repr(v)[:40])
def test_bad_arguments_are_refused_with_a_clear_message(
    overrides: dict[str, Any], message: str
) -> None:
    args = {"tokens": [1, 2, 3], **overrides}
    kv = args.pop("kv", KV)
    with pytest.raises(ValueError, match=message):
        encode(kv, **args)


def test_oversized_header_is_refused() -> None:
    tokens = list(range(2**32 - 200_000, 2**32 - 1))
    kv = np.zeros((1, 2, len(tokens), 1, 1), dtype=np.float16)
    with pytest.raises(ValueError, match=r"header is \d+ bytes, over the"):
        encode(kv, tokens=tokens)
    assert len(json.dumps(tokens)) > MAX_HEADER_BYTES


# -- damaged records ---------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_single_byte_flip_is_detected(codec: str) -> None:
    rec = small_record(codec)
    for position in range(len(rec.data)):
        for xor in (0x01, 0x80):
            damaged = bytearray(rec.data)
            damaged[position] ^= xor
            with pytest.raises(ChunkIntegrityError):
                decode_chunk(bytes(damaged), expected_key=rec.key)
            with pytest.raises(BAD):
                decode_chunk(bytes(damaged))


@pytest.mark.parametrize("codec", sorted(CODECS))
@settings(deadline=None, max_examples=150)
@given(position=st.integers(0, 10**6), xor=st.integers(1, 255))
def test_any_byte_flip_is_detected(codec: str, position: int, xor: int) -> None:
    rec = small_record(codec)
    damaged = bytearray(rec.data)
    damaged[position % len(damaged)] ^= xor
    with pytest.raises(ChunkIntegrityError):
        decode_chunk(bytes(damaged), expected_key=rec.key)
    with pytest.raises(BAD):
        decode_chunk(bytes(damaged))


def test_a_flip_zstd_decodes_identically_is_still_detected() -> None:
    """Some frame bits (here the window size) do not change the output; stored_blake3 catches them."""
    kv = np.zeros(
        (1, 2, 512, 4, 128), dtype=np.float16
    )  # 1 MiB: too big for a single-segment frame
    rec = encode(kv, codec="zstd", tokens=list(range(512)))
    offset = len(rec.data) - rec.header.payload_size
    frame_descriptor = rec.data[offset + 4]
    assert frame_descriptor & 0x20 == 0  # a window descriptor byte follows
    damaged = bytearray(rec.data)
    damaged[offset + 5] ^= 0x01  # window mantissa: a slightly larger window
    payload = memoryview(bytes(damaged))[offset:]
    assert ZstdCodec().decode(payload, np.dtype("<f2"), kv.size).tobytes() == kv.tobytes()
    with pytest.raises(ChunkIntegrityError, match="stored_blake3"):
        decode_chunk(bytes(damaged))


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_truncation_and_extension_is_detected(codec: str) -> None:
    rec = small_record(codec)
    for length in range(len(rec.data)):
        with pytest.raises(BAD):
            decode_chunk(rec.data[:length])
        with pytest.raises(ChunkIntegrityError):
            decode_chunk(rec.data[:length], expected_key=rec.key)
    with pytest.raises(ChunkFormatError, match="header says"):
        decode_chunk(rec.data + b"\0")


@settings(deadline=None, max_examples=300)
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_give_only_format_errors(data: bytes) -> None:
    for candidate in (data, MAGIC + data, MAGIC + b"\x01\x00\x00\x00" + data):
        with pytest.raises(BAD):
            decode_chunk(candidate)
        with pytest.raises(BAD):
            read_header(candidate)


def test_unsupported_version_and_flags() -> None:
    rec = small_record("raw")
    with pytest.raises(ChunkFormatError, match="version 2"):
        decode_chunk(forge(rec.header.to_json(), version=2))
    flagged = bytearray(rec.data)
    flagged[6] = 1
    with pytest.raises(ChunkFormatError, match="flags"):
        decode_chunk(bytes(flagged))


def test_header_length_beyond_the_record_or_the_cap_is_refused() -> None:
    rec = small_record("raw")
    for claimed in (len(rec.data), MAX_HEADER_BYTES + 1, 2**32 - 1, 0):
        forged = bytearray(rec.data)
        struct.pack_into("<I", forged, 8, claimed)
        with pytest.raises(ChunkFormatError):
            read_header(bytes(forged))


def test_forged_header_with_valid_digest_but_wrong_payload_hash() -> None:
    rec = small_record("zstd")
    fields = header_dict(rec)
    fields["payload_blake3"] = "0" * 64
    payload = rec.data[len(rec.data) - rec.header.payload_size :]
    assert read_header(forge(fields, payload)).payload_blake3 == "0" * 64
    with pytest.raises(ChunkIntegrityError, match="payload_blake3"):
        decode_chunk(forge(fields, payload))


def _forged_headers() -> list[tuple[str, bytes | object]]:
    base = header_dict(small_record("zstd"))

    def variant(**changes: Any) -> dict[str, Any]:
        return {**base, **changes}

    missing = dict(base)
    del missing["tokens"]
    cases: list[tuple[str, bytes | object]] = [
        ("huge shape, zstd", variant(shape=[2, 2, 3, 2, 2**40])),
        ("huge shape, raw", variant(codec="raw", shape=[2, 2, 3, 2, 2**27])),
        ("payload too small for shape", variant(shape=[2, 2, 3, 2, 2**22])),
        ("huge payload_size", variant(payload_size=2**62)),
        ("negative payload_size", variant(payload_size=-1)),
        ("string int", variant(token_start="256")),
        ("bool int", variant(payload_size=True)),
        ("float int", variant(token_start=256.0)),
        ("float in list", variant(shape=[2, 2, 3, 2, 8.0])),
        ("nested list", variant(tokens=[[1], [2], [3]])),
        ("bool in list", variant(tokens=[1, True, 3])),
        ("object for list", variant(layers={"lo": 0, "hi": 2})),
        ("short range", variant(kv_heads=[0])),
        ("hash not hex", variant(prefix_hash="zz" * 32)),
        ("hash wrong length", variant(parent_hash="00" * 31)),
        ("unknown dtype", variant(dtype="int8")),
        ("unknown codec", variant(codec="lz4")),
        ("shape rank", variant(shape=[2, 2, 3, 2])),
        ("zero dim", variant(shape=[2, 2, 3, 2, 0])),
        ("tokens vs shape", variant(tokens=[1, 2])),
        ("missing field", missing),
        ("extra field", variant(extra=1)),
        ("null", None),
        ("list", [1, 2, 3]),
        ("string", "header"),
        ("number", 12),
        ("invalid utf-8", b'{"namespace":"\xff\xfe"}'),
        ("not json", b"{not json"),
        ("deep nesting", b"[" * 200_000 + b"]" * 200_000),
        ("huge integer", b'{"token_start":' + b"9" * 10_000 + b"}"),
        ("nan literal", b'{"token_start":NaN}'),
        ("lone surrogate", json.dumps(variant(namespace="\ud800")).encode("ascii")),
        ("empty header", b""),
    ]
    return cases


@pytest.mark.parametrize(("what", "header"), _forged_headers(), ids=lambda v: str(v)[:30])
def test_forged_headers_give_only_format_errors(what: str, header: bytes | object) -> None:
    payload = small_record("zstd").data[-small_record("zstd").header.payload_size :]
    record = forge(header, payload)
    with pytest.raises(BAD):
        read_header(record)
    with pytest.raises(BAD):
        decode_chunk(record)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(deadline=None, max_examples=300)
@given(
    codec=st.sampled_from(sorted(CODECS)),
    field=st.sampled_from(sorted(header_dict(small_record("raw")))),
    value=JSON_VALUES | st.integers(-(2**70), 2**70) | st.lists(st.integers(-1, 2**40), max_size=6),
)
def test_header_with_any_field_replaced_gives_only_format_errors(
    codec: str, field: str, value: object
) -> None:
    rec = small_record(codec)
    fields = header_dict(rec)
    fields[field] = value
    body = canonical(fields)
    payload = rec.data[len(rec.data) - rec.header.payload_size :]
    try:
        out = decode_chunk(forge(body, payload))
    except BAD:
        return
    # The rare replacement that is still a valid, matching header must decode faithfully.
    assert out.header == ChunkHeader.from_json(body)
    assert same_bits(out.kv, decode_chunk(rec.data).kv)


@pytest.mark.parametrize("codec", ["zstd", "zstd-planes"])
def test_forged_zstd_payloads_are_refused_before_allocating(codec: str) -> None:
    rec = small_record(codec)
    fields = header_dict(rec)
    # 64 GiB claimed from a few hundred bytes: beyond zstd's maximum expansion, or
    # beyond the payload cap; either way refused up front.
    fields["shape"] = [2, 2, 3, 2, 2**32]
    with pytest.raises(ChunkFormatError):
        decode_chunk(forge(fields, rec.data[-rec.header.payload_size :]))


# -- properties --------------------------------------------------------------


@st.composite
def chunk_args(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    n_layers, n_tokens, n_heads, head_dim = (draw(st.integers(1, n)) for n in (3, 6, 3, 9))
    bits = draw(st.binary(min_size=1024, max_size=1024))
    raw = np.frombuffer(bits * 8, dtype=STORAGE[dtype]).copy()
    # Keep values finite: flip the exponent's top bit where the exponent is all ones.
    uint: Any = raw.view(np.uint32 if dtype == "float32" else np.uint16)
    exponent = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000}[dtype]
    uint[(uint & exponent) == exponent] ^= 0x40000000 if dtype == "float32" else 0x4000
    count = n_layers * 2 * n_tokens * n_heads * head_dim
    kv = np.resize(raw, count).reshape(n_layers, 2, n_tokens, n_heads, head_dim)
    layer_lo = draw(st.integers(0, 100))
    head_lo = draw(st.integers(0, 16))
    return {
        "fingerprint": draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
        "namespace": draw(st.text(min_size=1, max_size=20)),
        "prefix_hash": draw(st.binary(min_size=32, max_size=32)),
        "parent_hash": draw(st.binary(min_size=32, max_size=32)),
        "token_start": draw(st.integers(0, 2**40)),
        "tokens": draw(st.lists(st.integers(0, 2**32 - 1), min_size=n_tokens, max_size=n_tokens)),
        "kv": kv,
        "dtype": dtype,
        "layers": (layer_lo, layer_lo + n_layers),
        "kv_heads": (head_lo, head_lo + n_heads),
        "codec": draw(st.sampled_from(sorted(CODECS))),
    }


@settings(deadline=None, max_examples=150)
@given(args=chunk_args())
def test_random_chunks_round_trip(args: dict[str, Any]) -> None:
    rec = encode_chunk(**args)
    assert rec.key == blake3.blake3(rec.data).hexdigest()
    for out in (decode_chunk(rec.data, expected_key=rec.key), decode_chunk(rec.data)):
        assert same_bits(out.kv, args["kv"])
        header = out.header
        assert (header.fingerprint, header.namespace) == (args["fingerprint"], args["namespace"])
        assert (header.prefix_hash, header.parent_hash) == (
            args["prefix_hash"],
            args["parent_hash"],
        )
        assert header.token_start == args["token_start"]
        assert list(header.tokens) == args["tokens"]
        assert (header.layers, header.kv_heads) == (args["layers"], args["kv_heads"])
        assert (header.dtype, header.codec) == (args["dtype"], args["codec"])
    assert read_header(rec.data) == rec.header


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layers", [None, (2, 4)])
def test_a_record_built_in_place_is_byte_identical_to_encode_chunk(
    dtype: str, layers: tuple[int, int] | None
) -> None:
    """The checkpoint builds raw records in place (RawRecord); they must be the exact bytes
    encode_chunk writes, so keys, format and every reader stay the same."""
    kv = make_kv(dtype, (2, 2, 5, 3, 8), seed=4)
    extra: dict[str, Any] = {} if layers is None else {"layers": layers}
    want = encode(kv, **extra)
    rec = RawRecord(
        fingerprint=FP,
        namespace="tenant-a",
        prefix_hash=PREFIX,
        parent_hash=PARENT,
        token_start=256,
        tokens=list(range(1000, 1005)),
        shape=kv.shape,
        dtype=dtype,
        **extra,
    )
    buf = bytearray(b"\xff" * rec.size)  # stale bytes from a reused buffer must not leak
    rec.payload(buf)[...] = kv
    key, view, header = rec.finish(buf)
    assert bytes(view) == bytes(want.data)
    assert key == want.key
    assert header == want.header
