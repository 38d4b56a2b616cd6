"""What a stored blob may make a reader decode: the layout its fingerprint allows, checked
from its header before its payload is hashed, decompressed or allocated."""

from __future__ import annotations

from collections.abc import Callable

from typing_extensions import Buffer

from catalog.identity import AttentionLayout
from chunkstore.errors import ChunkIntegrityError, ChunkLayoutError
from chunkstore.record import ChunkHeader, blake3_hex, decode_chunk, read_header

__all__ = ["verify_within_layout"]


def verify_within_layout(
    data: Buffer, key: str, layout_of: Callable[[str], AttentionLayout | None]
) -> ChunkHeader:
    """Verify a record read by a maintenance job (fsck, rebuild) and return its header.

    `layout_of(fingerprint hex)`: the layout of the fingerprint the header names, or None.
    With one, the header must declare a shard within it, that
    layout's head dim and dtype (`ChunkLayoutError` otherwise), and then the whole record
    is decoded and checked. Without one (a fingerprint nobody describes), only the bytes'
    digest and the header are checked: a payload whose size nothing bounds is not decoded.
    """
    header = read_header(data)
    layout = layout_of(header.fingerprint)
    if layout is None:
        if blake3_hex(data) != key:
            raise ChunkIntegrityError(f"record bytes do not hash to the expected key {key}")
        return header
    (l_lo, l_hi), (h_lo, h_hi) = header.layers, header.kv_heads
    if l_hi > layout.num_layers or h_hi > layout.num_kv_heads:
        raise ChunkLayoutError(
            f"record declares layers [{l_lo}, {l_hi}) and kv heads [{h_lo}, {h_hi}), beyond its "
            f"fingerprint's {layout.num_layers} layers and {layout.num_kv_heads} kv heads"
        )
    shape = (l_hi - l_lo, 2, len(header.tokens), h_hi - h_lo, layout.head_dim)
    return decode_chunk(
        data, expected_key=key, expected_shape=shape, expected_dtype=layout.dtype
    ).header
