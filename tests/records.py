"""Blob records built by hand: any header, right or wrong, with a correct header digest, so
that what reads them gets past the digest to the check a test is after."""

from __future__ import annotations

import json
import struct

import blake3

from chunkstore.record import FORMAT_VERSION, MAGIC, PAYLOAD_ALIGNMENT


def canonical(obj: object) -> bytes:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8")


def forge(header: bytes | object, payload: bytes = b"", version: int = FORMAT_VERSION) -> bytes:
    """A record with a correct header digest around any header (canonical JSON unless
    given as bytes), so that validation is reached past the digest check."""
    body = header if isinstance(header, bytes) else canonical(header)
    fixed = struct.pack("<4sHHI", MAGIC, version, 0, len(body))
    end = len(fixed) + 32 + len(body)
    pad = bytes(-end % PAYLOAD_ALIGNMENT)
    return fixed + blake3.blake3(fixed + body).digest() + body + pad + payload
