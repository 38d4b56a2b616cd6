"""Payload codecs: bit-exact round trips, plane selection, and refusal of corrupt payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.codecs import (
    CODECS,
    DEFAULT_CODEC,
    BytePlaneCodec,
    Codec,
    RawCodec,
    ZstdCodec,
    get_codec,
)
from chunkstore.errors import ChunkFormatError

DTYPES = [np.dtype("<f2"), np.dtype("<u2"), np.dtype("<f4")]  # float16, bfloat16 bits, float32
PLANES = BytePlaneCodec()
TABLE_ENTRY = struct.Struct("<BQ")


def _bits(arr: np.ndarray) -> np.ndarray:
    """The array's bit patterns, so comparisons see -0, NaN payloads and subnormals exactly."""
    return arr.view({2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


def _round_trip(codec: Codec, arr: np.ndarray) -> np.ndarray:
    payload = memoryview(bytes(codec.encode(arr)))
    return codec.decode(payload, arr.dtype, arr.size)


def _special_values(dtype: np.dtype) -> np.ndarray:
    if dtype == np.dtype("<u2"):  # bfloat16 bit patterns
        patterns = [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
        patterns += [0x7F80, 0xFF80, 0x7FC0, 0x7F81]  # +-Inf, NaN, signalling NaN
        return np.array(patterns, dtype=dtype)
    info = np.finfo(dtype)
    values = [0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny]
    values += [info.max, -info.max, info.eps, 1.0, -1.0, np.inf, -np.inf, np.nan]
    arr = np.array(values, dtype=dtype)
    # A NaN with an unusual payload must come back with the same bits.
    arr.view(_bits(arr).dtype)[-1] |= 1
    return arr


def test_registry_names_and_default() -> None:
    assert set(CODECS) == {"raw", "zstd", "zstd-planes"}
    assert all(CODECS[name].name == name for name in CODECS)
    assert DEFAULT_CODEC in CODECS
    assert get_codec("zstd") is CODECS["zstd"]


def test_unknown_codec_is_a_format_error() -> None:
    with pytest.raises(ChunkFormatError, match="unknown codec 'lz4'"):
        get_codec("lz4")


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_round_trip_bit_exact(name: str, dtype: np.dtype) -> None:
    arr = np.tile(_special_values(dtype), 50)
    out = _round_trip(CODECS[name], arr)
    assert out.dtype == dtype
    np.testing.assert_array_equal(_bits(out), _bits(arr))


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(deadline=None, max_examples=60)
@given(
    dtype=st.sampled_from(DTYPES),
    data=st.binary(min_size=0, max_size=2048),
    repeat=st.integers(1, 4),
)
def test_any_bytes_round_trip_bit_exact(
    name: str, dtype: np.dtype, data: bytes, repeat: int
) -> None:
    data = (data * repeat)[: len(data) * repeat // dtype.itemsize * dtype.itemsize]
    arr = np.frombuffer(data, dtype=dtype)
    out = _round_trip(CODECS[name], arr)
    assert out.tobytes() == arr.tobytes()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decoded_arrays_are_read_only(name: str) -> None:
    arr = np.arange(1000, dtype=np.float16)
    out = _round_trip(CODECS[name], arr)
    assert not out.flags.writeable


def test_raw_decode_is_a_view_of_the_payload() -> None:
    arr = np.arange(64, dtype=np.float32)
    stored = bytes(RawCodec().encode(arr))
    out = RawCodec().decode(memoryview(stored), arr.dtype, arr.size)
    assert np.shares_memory(out, np.frombuffer(stored, dtype=np.uint8))


def test_zstd_saves_space_on_redundant_data() -> None:
    arr = np.zeros(100_000, dtype=np.float16)
    assert len(ZstdCodec().encode(arr)) < arr.nbytes // 100


def _plane_flags(payload: bytes, itemsize: int) -> list[int]:
    assert payload[0] == itemsize
    return [TABLE_ENTRY.unpack_from(payload, 1 + j * TABLE_ENTRY.size)[0] for j in range(itemsize)]


def test_planes_store_incompressible_planes_raw() -> None:
    rng = np.random.default_rng(1)
    low = rng.integers(0, 256, size=50_000, dtype=np.uint16)  # noise: incompressible
    arr = (low | (0x3C << 8)).astype(np.uint16)  # constant high byte: very compressible
    payload = bytes(PLANES.encode(arr))
    assert _plane_flags(payload, 2) == [0, 1]  # byte 0 raw, byte 1 compressed
    assert len(payload) < arr.nbytes * 0.55
    np.testing.assert_array_equal(PLANES.decode(memoryview(payload), arr.dtype, arr.size), arr)


def test_planes_store_all_planes_raw_when_nothing_compresses() -> None:
    arr = np.random.default_rng(2).integers(0, 2**32, size=20_000, dtype=np.uint32)
    payload = bytes(PLANES.encode(arr))
    assert _plane_flags(payload, 4) == [0, 0, 0, 0]
    assert len(payload) == arr.nbytes + 1 + 4 * TABLE_ENTRY.size


def test_planes_beat_plain_zstd_on_kv_like_fp16() -> None:
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.05, 4.0, size=(4, 1, 8, 1)).astype(np.float32)
    kv = (rng.standard_normal((4, 64, 8, 64), dtype=np.float32) * scale).astype(np.float16)
    planes, plain = len(PLANES.encode(kv)), len(ZstdCodec().encode(kv))
    assert planes < plain < kv.nbytes


def _kv_like_planes() -> tuple[np.ndarray, bytes]:
    rng = np.random.default_rng(3)
    arr = (rng.standard_normal(20_000) * 0.5).astype(np.float16)
    payload = bytes(PLANES.encode(arr))
    assert _plane_flags(payload, 2) == [0, 1]
    return arr, payload


def _set_entry(payload: bytes, j: int, flag: int, length: int) -> bytes:
    out = bytearray(payload)
    TABLE_ENTRY.pack_into(out, 1 + j * TABLE_ENTRY.size, flag, length)
    return bytes(out)


def test_planes_refuse_a_damaged_table() -> None:
    arr, payload = _kv_like_planes()
    _, compressed_len = TABLE_ENTRY.unpack_from(payload, 1 + TABLE_ENTRY.size)
    cases = {
        "plane count": bytes([4]) + payload[1:],
        "unknown flag": _set_entry(payload, 0, 7, arr.size),
        "raw plane length": _set_entry(payload, 0, 0, arr.size - 1),
        "lengths beyond payload": _set_entry(payload, 1, 1, compressed_len + 1),
        "lengths short of payload": payload + b"\0",
        "truncated table": payload[:5],
        "huge claimed length": _set_entry(payload, 1, 1, 2**63),
    }
    for what, bad in cases.items():
        with pytest.raises(ChunkFormatError):
            PLANES.decode(memoryview(bad), arr.dtype, arr.size)
            pytest.fail(what)


def test_planes_refuse_a_corrupt_compressed_plane() -> None:
    arr, payload = _kv_like_planes()
    start = 1 + 2 * TABLE_ENTRY.size + arr.size  # the compressed plane follows the raw one
    frame = bytearray(payload[start:])
    # Bad magic, a wrong declared content size, and a truncated frame body.
    bad_magic = payload[:start] + b"\0" + bytes(frame[1:])
    with pytest.raises(ChunkFormatError, match="magic"):
        PLANES.decode(memoryview(bad_magic), arr.dtype, arr.size)
    with pytest.raises(ChunkFormatError):
        PLANES.decode(memoryview(payload), arr.dtype, arr.size + 1)
    cut = _set_entry(payload, 1, 1, len(frame) - 10)[: len(payload) - 10]
    with pytest.raises(ChunkFormatError):
        PLANES.decode(memoryview(cut), arr.dtype, arr.size)


@settings(deadline=None, max_examples=200)
@given(position=st.integers(0, 10**6), xor=st.integers(1, 255))
def test_planes_flipped_byte_never_leaks_another_error(position: int, xor: int) -> None:
    """A flip gives a format error or different bytes; catching the latter is the record's job."""
    arr, payload = _kv_like_planes()
    damaged = bytearray(payload)
    damaged[position % len(damaged)] ^= xor
    try:
        out = PLANES.decode(memoryview(bytes(damaged)), arr.dtype, arr.size)
    except ChunkFormatError:
        return
    assert out.shape == arr.shape


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(deadline=None, max_examples=100)
@given(data=st.binary(max_size=300), count=st.integers(0, 10**12))
def test_garbage_payload_gives_only_format_errors(name: str, data: bytes, count: int) -> None:
    try:
        out = CODECS[name].decode(memoryview(data), np.dtype("<f2"), count)
    except ChunkFormatError:
        return
    assert out.nbytes == count * 2


def test_zstd_refuses_implausible_sizes_before_allocating() -> None:
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(1000))
    # 10**12 bytes from a 20-byte frame is past zstd's maximum ratio: refused, not attempted.
    with pytest.raises(ChunkFormatError, match="cannot decode"):
        ZstdCodec().decode(memoryview(frame), np.dtype("u1"), 10**12)
    with pytest.raises(ChunkFormatError, match="declares 1000 bytes"):
        ZstdCodec().decode(memoryview(frame), np.dtype("u1"), 1001)


def test_zstd_refuses_trailing_data_and_frames_without_content_size() -> None:
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(1000))
    with pytest.raises(ChunkFormatError):
        ZstdCodec().decode(memoryview(frame + b"x"), np.dtype("u1"), 1000)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1000))
    with pytest.raises(ChunkFormatError, match="declares"):
        ZstdCodec().decode(memoryview(unsized), np.dtype("u1"), 1000)


def test_check_sizes() -> None:
    RawCodec().check_sizes(100, 100)
    with pytest.raises(ChunkFormatError):
        RawCodec().check_sizes(100, 99)
    ZstdCodec().check_sizes(32768 * 10, 10)
    with pytest.raises(ChunkFormatError):
        ZstdCodec().check_sizes(32768 * 10 + 1, 10)
