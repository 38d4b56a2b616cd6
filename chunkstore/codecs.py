"""Payload codecs of the blob record: raw, zstd, and zstd over byte planes, with a registry by name."""

from __future__ import annotations

import abc
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import zstandard

from chunkstore.errors import ChunkFormatError

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "BytePlaneCodec",
    "Codec",
    "RawCodec",
    "ZstdCodec",
    "get_codec",
]

# A zstd block decodes to at most 128 KiB and the smallest block (an RLE block)
# takes 4 bytes, so no valid frame expands by more than 32768x. Claims beyond
# that are rejected before anything is allocated.
ZSTD_MAX_RATIO = 32768

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class Codec(abc.ABC):
    """Turns the raw little-endian bytes of an array into stored bytes and back.

    Codecs are immutable and hold no per-call state, so one instance may be
    used from many threads at once.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The codec's name as recorded in blob headers."""

    @abc.abstractmethod
    def encode(self, raw: np.ndarray) -> bytes | memoryview:
        """Encode a C-contiguous little-endian array; the result may be a view of `raw`."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, dtype: np.dtype, count: int) -> np.ndarray:
        """Decode `payload` into a read-only 1-D array of `count` elements of `dtype`.

        Raises `ChunkFormatError` for anything that does not decode to exactly
        that many bytes; never allocates more than `max_raw_size(len(payload))`.
        """

    @abc.abstractmethod
    def max_raw_size(self, stored_size: int) -> int:
        """The largest raw size a payload of `stored_size` bytes can honestly decode to."""

    @abc.abstractmethod
    def max_stored_size(self, raw_size: int) -> int:
        """The largest payload an encoder can honestly produce from `raw_size` bytes."""

    def check_sizes(self, raw_size: int, stored_size: int) -> None:
        """Raise `ChunkFormatError` if `stored_size` bytes cannot decode to `raw_size` bytes."""
        if raw_size > self.max_raw_size(stored_size) or stored_size > self.max_stored_size(
            raw_size
        ):
            raise ChunkFormatError(
                f"codec {self.name!r}: a {stored_size}-byte payload cannot decode to {raw_size} bytes"
            )


def _byte_view(raw: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a 1-D uint8 view (no copy)."""
    if not raw.flags.c_contiguous:
        raise ValueError("codec input must be C-contiguous")
    return raw.reshape(-1).view(np.uint8)


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class RawCodec(Codec):
    """The array bytes as they are: decoding is a zero-copy view of the stored bytes."""

    @property
    def name(self) -> str:
        return "raw"

    def encode(self, raw: np.ndarray) -> bytes | memoryview:
        return _byte_view(raw).data

    def decode(self, payload: memoryview, dtype: np.dtype, count: int) -> np.ndarray:
        if len(payload) != count * dtype.itemsize:
            raise ChunkFormatError(
                f"raw payload is {len(payload)} bytes, expected {count * dtype.itemsize}"
            )
        return _readonly(np.frombuffer(payload, dtype=dtype, count=count))

    def max_raw_size(self, stored_size: int) -> int:
        return stored_size

    def max_stored_size(self, raw_size: int) -> int:
        return raw_size

    def check_sizes(self, raw_size: int, stored_size: int) -> None:
        if raw_size != stored_size:
            raise ChunkFormatError(
                f"codec 'raw': payload is {stored_size} bytes, expected exactly {raw_size}"
            )


@dataclass(frozen=True)
class ZstdCodec(Codec):
    """One zstd frame over the whole payload, with its content size declared.

    Compressor and decompressor contexts are made per call: zstandard contexts
    are not thread-safe, and making one costs ~3 us against ~10 ms to compress
    a 256-token chunk (measured), so caching them per thread buys nothing.
    """

    level: int = 1

    @property
    def name(self) -> str:
        return "zstd"

    def compress(self, data: bytes | memoryview) -> bytes:
        return zstandard.ZstdCompressor(
            level=self.level, write_content_size=True, write_checksum=False
        ).compress(data)

    def decompress(self, frame: memoryview, size: int) -> bytes:
        """Decompress one frame that must decode to exactly `size` bytes."""
        if bytes(frame[:4]) != _ZSTD_MAGIC:
            raise ChunkFormatError("zstd frame: bad magic")
        if size > self.max_raw_size(len(frame)):
            raise ChunkFormatError(f"zstd frame: {len(frame)} bytes cannot decode to {size} bytes")
        try:
            params = zstandard.get_frame_parameters(frame)
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"zstd frame: bad header: {exc}") from None
        # The declared content size decides the allocation (the library ignores
        # max_output_size when a frame declares one), so it must match first.
        if params.content_size != size:
            raise ChunkFormatError(
                f"zstd frame declares {params.content_size} bytes, expected {size}"
            )
        if params.dict_id != 0:
            raise ChunkFormatError("zstd frame needs a dictionary")
        try:
            out = zstandard.ZstdDecompressor().decompress(
                frame, max_output_size=size, allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise ChunkFormatError(f"zstd frame: {exc}") from None
        if len(out) != size:
            raise ChunkFormatError(f"zstd frame decoded to {len(out)} bytes, expected {size}")
        return out

    def encode(self, raw: np.ndarray) -> bytes | memoryview:
        return self.compress(_byte_view(raw).data)

    def decode(self, payload: memoryview, dtype: np.dtype, count: int) -> np.ndarray:
        out = self.decompress(payload, count * dtype.itemsize)
        return _readonly(np.frombuffer(out, dtype=dtype, count=count))

    def max_raw_size(self, stored_size: int) -> int:
        return stored_size * ZSTD_MAX_RATIO

    def max_stored_size(self, raw_size: int) -> int:
        # Above ZSTD_COMPRESSBOUND (n + n/256 + 64 at most), with slack.
        return raw_size + raw_size // 128 + 128


_PLANE_COUNT = struct.Struct("<B")
_PLANE_ENTRY = struct.Struct("<BQ")
_PLANE_RAW = 0
_PLANE_COMPRESSED = 1
_UINTS: Mapping[int, type[np.unsignedinteger]] = MappingProxyType(
    {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
)


@dataclass(frozen=True)
class BytePlaneCodec(Codec):
    """Split elements into byte planes (byte 0 of every element, then byte 1, ...) and
    compress each plane with `inner`, keeping the compressed form only where it saves
    at least `min_saving` of the plane.

    Why: in fp16/bf16 KV the byte holding sign and exponent is highly repetitive
    while the mantissa bytes are close to noise; compressing them apart gets about
    twice the saving of zstd over the interleaved bytes, and noise planes cost
    nothing to decode because they are stored raw.

    Payload: u8 plane count (= item size), per plane u8 flag (0 raw, 1 compressed)
    and u64 stored length, all little-endian, then the planes in order.
    """

    inner: ZstdCodec = ZstdCodec(level=1)
    min_saving: float = 0.03

    @property
    def name(self) -> str:
        return f"{self.inner.name}-planes"

    def encode(self, raw: np.ndarray) -> bytes | memoryview:
        itemsize = raw.dtype.itemsize
        words = _byte_view(raw).view(_UINTS[itemsize])
        table: list[bytes | memoryview] = [_PLANE_COUNT.pack(itemsize)]
        planes: list[bytes | memoryview] = []
        for j in range(itemsize):
            plane = np.empty(words.size, dtype=np.uint8)
            # Shift-and-truncate is vectorised; a strided byte gather is ~2x slower.
            np.right_shift(words, 8 * j, out=plane, casting="unsafe")
            packed = self.inner.compress(plane.data)
            if len(packed) <= plane.size * (1.0 - self.min_saving):
                table.append(_PLANE_ENTRY.pack(_PLANE_COMPRESSED, len(packed)))
                planes.append(packed)
            else:
                table.append(_PLANE_ENTRY.pack(_PLANE_RAW, plane.size))
                planes.append(plane.data)
        return b"".join(table + planes)

    def _table(self, payload: memoryview, itemsize: int, count: int) -> list[tuple[int, int, int]]:
        """Parse and bound-check the plane table: (flag, offset, length) per plane."""
        header_size = _PLANE_COUNT.size + itemsize * _PLANE_ENTRY.size
        if len(payload) < header_size:
            raise ChunkFormatError("byte-plane payload: truncated plane table")
        (n_planes,) = _PLANE_COUNT.unpack_from(payload, 0)
        if n_planes != itemsize:
            raise ChunkFormatError(f"byte-plane payload has {n_planes} planes, expected {itemsize}")
        entries = []
        offset = header_size
        for j in range(itemsize):
            flag, length = _PLANE_ENTRY.unpack_from(
                payload, _PLANE_COUNT.size + j * _PLANE_ENTRY.size
            )
            if flag == _PLANE_RAW:
                if length != count:
                    raise ChunkFormatError(
                        f"byte-plane payload: raw plane {j} is {length} bytes, expected {count}"
                    )
            elif flag == _PLANE_COMPRESSED:
                if count > self.inner.max_raw_size(length):
                    raise ChunkFormatError(
                        f"byte-plane payload: plane {j} of {length} bytes cannot hold {count}"
                    )
            else:
                raise ChunkFormatError(f"byte-plane payload: plane {j} has unknown flag {flag}")
            entries.append((flag, offset, length))
            offset += length
        if offset != len(payload):
            raise ChunkFormatError(
                f"byte-plane payload: planes end at {offset}, payload is {len(payload)} bytes"
            )
        return entries

    def decode(self, payload: memoryview, dtype: np.dtype, count: int) -> np.ndarray:
        itemsize = dtype.itemsize
        if itemsize not in _UINTS:
            raise ChunkFormatError(f"byte-plane codec cannot hold {itemsize}-byte elements")
        # Every claim is checked before the output is allocated.
        entries = self._table(payload, itemsize, count)
        words = np.empty(count, dtype=_UINTS[itemsize])
        shifted = np.empty(count, dtype=words.dtype)
        for j, (flag, offset, length) in enumerate(entries):
            stored = payload[offset : offset + length]
            data = self.inner.decompress(stored, count) if flag == _PLANE_COMPRESSED else stored
            plane = np.frombuffer(data, dtype=np.uint8, count=count)
            # Widen, shift, OR: vectorised, and ~30% faster than strided byte stores.
            if j == 0:
                np.copyto(words, plane, casting="unsafe")
            else:
                np.left_shift(plane, 8 * j, out=shifted, dtype=words.dtype)
                np.bitwise_or(words, shifted, out=words)
        return _readonly(words.view(dtype))

    def max_raw_size(self, stored_size: int) -> int:
        # Every plane is at least one compressed frame of the stored bytes.
        return stored_size * ZSTD_MAX_RATIO * 8

    def max_stored_size(self, raw_size: int) -> int:
        # The table, then at worst every plane at the inner codec's bound.
        planes = 8  # the most an element can have (uint64)
        table = _PLANE_COUNT.size + planes * _PLANE_ENTRY.size
        return table + self.inner.max_stored_size(raw_size) + planes * 128


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; raise `ChunkFormatError` if there is none."""
    codec = CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ChunkFormatError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    return codec


CODECS: Mapping[str, Codec] = MappingProxyType(
    {codec.name: codec for codec in (RawCodec(), ZstdCodec(level=1), BytePlaneCodec())}
)

# Restoring from a local disk, raw is fastest end to end: one blake3 over the
# record and no decode pass at all (a zero-copy view). On 14.7 MB of KV-like
# fp16, zstd-planes saves ~12% and zstd ~6% of the bytes, but both restore
# 5-6x slower (decode ~0.6 GB/s here), so compression pays only below about
# 0.1 GB/s of store bandwidth. Numbers and command: docs/performance.md
# (`python bench/bench_chunkstore.py`).
DEFAULT_CODEC = "raw"
