"""Fingerprint descriptors kept in the stores themselves, so a store describes its own blobs.

A blob's header names its fingerprint only by hex. The descriptor (what the
hex is the blake3 of) is stored next to the blobs as the document
`fingerprints/<hex>` whose bytes are `Fingerprint.canonical`, the canonical
JSON the hex is computed over. The checkpointer writes it into a store before
the first blob that names it (docs/format.md). Reading verifies it like a
blob: `blake3(bytes) == hex` and the bytes parse as a valid descriptor that
hashes to the same hex; a document that fails is reported, never trusted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3

from catalog import Fingerprint
from catalog.errors import IdentityError
from catalog.identity import is_hex64
from chunkstore import ChunkStore
from chunkstore.errors import ChunkStoreError

log = logging.getLogger(__name__)

DESCRIPTOR_PREFIX = "fingerprints/"


def descriptor_name(hex_: str) -> str:
    """The document name of a fingerprint's descriptor: `fingerprints/<hex>`."""
    return DESCRIPTOR_PREFIX + hex_


def store_descriptor(store: ChunkStore, fp: Fingerprint) -> bool:
    """Put `fp`'s descriptor into `store` unless it is there; True if this call wrote it.

    Raises what `put_document` raises (`StoreWriteError`, `StoreUnavailableError`).
    """
    return store.put_document(descriptor_name(fp.hex), fp.canonical)


def parse_descriptor(hex_: str, data: bytes) -> Fingerprint:
    """The fingerprint whose descriptor document under `hex_` holds `data`, verified.

    `IdentityError` when the name is not a hex digest, the bytes do not hash to
    it, or they are not a valid canonical descriptor.
    """
    if not is_hex64(hex_):
        raise IdentityError(f"descriptor name {hex_!r:.80} is not a 64-hex fingerprint")
    got = blake3.blake3(data).hexdigest()
    if got != hex_:
        raise IdentityError(f"descriptor bytes hash to {got}, not to their name {hex_}")
    try:
        fp = Fingerprint.from_descriptor(json.loads(data))
    except ValueError as exc:  # not UTF-8 / not JSON
        raise IdentityError(f"descriptor {hex_} is not JSON: {exc}") from exc
    if fp.hex != hex_:  # the bytes were not the canonical encoding
        raise IdentityError(f"descriptor {hex_} is not in canonical form (it hashes to {fp.hex})")
    return fp


def read_descriptor(store: ChunkStore, hex_: str) -> Fingerprint:
    """Read and verify one descriptor; `BlobNotFoundError` if absent, `IdentityError` if bad."""
    return parse_descriptor(hex_, store.get_document(descriptor_name(hex_)))


@dataclass
class Descriptors:
    """What `load_descriptors` found: verified fingerprints by hex, and the documents it refused."""

    found: dict[str, Fingerprint] = field(default_factory=dict)
    # "<store name> <document name>" -> why it was refused (bad bytes, unreadable)
    rejected: dict[str, str] = field(default_factory=dict)


def load_descriptors(stores: Iterable[ChunkStore]) -> Descriptors:
    """Every verified descriptor in `stores` (a hex good in any store is found).

    A document whose bytes do not verify, or that cannot be read, is logged and
    listed in `rejected`; it never contributes a fingerprint.
    """
    out = Descriptors()
    for store in stores:
        try:
            names = list(store.documents(DESCRIPTOR_PREFIX))
        except ChunkStoreError as exc:
            out.rejected[f"{store.name} {DESCRIPTOR_PREFIX}"] = f"cannot list: {exc}"
            log.warning("descriptors: cannot list %s in %s: %s", DESCRIPTOR_PREFIX, store.name, exc)
            continue
        for name in names:
            hex_ = name[len(DESCRIPTOR_PREFIX) :]
            where = f"{store.name} {name}"
            try:
                fp = parse_descriptor(hex_, store.get_document(name))
            except (IdentityError, ChunkStoreError) as exc:
                log.warning("descriptors: refusing %s: %s", where, exc)
                out.rejected[where] = str(exc)
                continue
            out.found.setdefault(fp.hex, fp)
    return out
