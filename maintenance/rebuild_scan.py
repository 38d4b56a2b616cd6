"""Rebuild, step 2: read every blob of every store given, verify it, merge the copies by key.

One blob key held by several stores is one chunk with one replica per store
that holds a good copy (each receipt in that store's tier). A copy that fails
verification or cannot be read gives no replica; it is listed in `damaged`
(key -> {store: why}), and a key with no good copy anywhere is `lost`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from catalog.identity import AttentionLayout
from catalog.models import ReplicaReceipt
from chunkstore import ChunkStore
from chunkstore.base import Tier
from chunkstore.errors import ChunkStoreError
from chunkstore.record import ChunkHeader, read_header
from maintenance.bounds import verify_within_layout
from maintenance.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class StoredBlob:
    """One blob key as found over all stores: its header and a receipt per good copy."""

    key: str
    header: ChunkHeader
    receipts: list[ReplicaReceipt] = field(default_factory=list)


@dataclass
class Scan:
    """What reading the stores found."""

    blobs: dict[str, StoredBlob] = field(default_factory=dict)  # key -> blob with a good copy
    copies: dict[str, int] = field(default_factory=dict)  # store name -> blobs listed there
    damaged: dict[str, dict[str, str]] = field(default_factory=dict)  # key -> {store: why}
    unlisted: dict[str, str] = field(default_factory=dict)  # store name -> why it was not listed

    @property
    def lost(self) -> list[str]:
        """Keys found only as damaged copies: nothing of them can be catalogued."""
        return sorted(k for k in self.damaged if k not in self.blobs)


def scan_stores(
    stores: Sequence[ChunkStore],
    *,
    verify: bool,
    layout_of: Callable[[str], AttentionLayout | None],
    progress: Progress | None = None,
) -> Scan:
    """List and read every blob of `stores`; `progress("rebuild read", done, total)` per copy.

    With `verify` each copy is read whole and checked against its key, within its
    fingerprint's layout (`layout_of(hex)`, see `verify_within_layout`); without, only its
    header is parsed (the header's own digest is still checked).
    """
    scan = Scan()
    listed: list[tuple[ChunkStore, list[str]]] = []
    for store in stores:
        try:
            keys = list(store.keys())
        except ChunkStoreError as exc:
            log.warning("rebuild: cannot list %s: %s", store.name, exc)
            scan.unlisted[store.name] = str(exc)
            keys = []
        scan.copies[store.name] = len(keys)
        listed.append((store, keys))
    total = sum(len(keys) for _, keys in listed)
    done = 0
    for store, keys in listed:
        tier = store.tier
        for key in keys:
            _read(store, key, verify, layout_of, tier, scan)
            done += 1
            if progress is not None:
                progress("rebuild read", done, total)
    return scan


def _read(
    store: ChunkStore,
    key: str,
    verify: bool,
    layout_of: Callable[[str], AttentionLayout | None],
    tier: Tier,
    scan: Scan,
) -> None:
    try:
        stat = store.stat(key)
        data = store.get(key)
        header = verify_within_layout(data, key, layout_of) if verify else read_header(data)
    except ValueError as exc:  # ChunkFormatError, ChunkIntegrityError
        log.warning("rebuild: blob %s in %s is corrupt: %s", key, store.name, exc)
        scan.damaged.setdefault(key, {})[store.name] = f"corrupt: {exc}"
        return
    except ChunkStoreError as exc:  # vanished or unreadable since listing
        log.warning("rebuild: blob %s in %s is unreadable: %s", key, store.name, exc)
        scan.damaged.setdefault(key, {})[store.name] = f"unreadable: {exc}"
        return
    receipt = ReplicaReceipt(
        location=store.name,
        tier=tier,
        size=stat.size,
        checksum=f"blake3:{key}",
        stored_at=stat.mtime,
    )
    blob = scan.blobs.get(key)
    if blob is None:
        scan.blobs[key] = StoredBlob(key, header, [receipt])
    else:
        blob.receipts.append(receipt)
