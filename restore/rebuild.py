"""Rebuild: recreate a lost catalog's chunk facts from the blob headers in a store (ARCHITECTURE 9).

Every record's header names its fingerprint (by hex), namespace, prefix and
parent hash, token ids and shard, which is all a catalog row needs except the
fingerprint's *descriptor*: that is taken from the target catalog when it
already knows the hex, or from the `fingerprints` the caller passes. Chunks
of a fingerprint known to neither are skipped and their hex is reported.

What cannot be rebuilt: refs (named continuations), pins, demands, access
statistics, quarantine marks and the event history live only in the catalog.
Replicas in other stores are not rediscovered either: run rebuild once per
store (it is idempotent, and a second store only adds replica rows).

Skipped, never an error: corrupt or unreadable blobs, chunks of an unknown
fingerprint, chunks that do not fit their namespace or fingerprint, and
orphans (a chunk whose parent prefix is neither in the store nor catalogued;
its whole subtree goes with it).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from catalog import Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.errors import CatalogError, IdentityError, NotFoundError, PublishError
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from chunkstore import ChunkStore
from chunkstore.base import Tier
from chunkstore.errors import ChunkStoreError
from chunkstore.record import ChunkHeader, decode_chunk, read_header
from restore.progress import Progress

log = logging.getLogger(__name__)

BATCH = 256  # chunk records per catalog transaction

REFS_NOTE = (
    "refs (named continuations), pins, demands and events live only in the catalog "
    "and cannot be rebuilt from blobs; a ref comes back when its conversation is checkpointed again"
)


@dataclass
class RebuildReport:
    """What a rebuild found and did. `complete` is true when no blob was skipped."""

    store: str
    blobs: int = 0
    recorded: int = 0
    already_present: int = 0
    replicas_added: int = 0
    conflicts: int = 0
    namespaces: dict[str, int] = field(default_factory=dict)  # name -> chunk size used
    corrupt: list[str] = field(default_factory=list)  # blob keys
    unknown_fingerprints: dict[str, int] = field(default_factory=dict)  # hex -> chunks skipped
    orphans: list[str] = field(default_factory=list)  # blob keys
    invalid: dict[str, str] = field(default_factory=dict)  # blob key -> why
    refs_note: str = REFS_NOTE

    @property
    def skipped(self) -> int:
        return (
            len(self.corrupt)
            + sum(self.unknown_fingerprints.values())
            + len(self.orphans)
            + len(self.invalid)
        )

    @property
    def complete(self) -> bool:
        return self.skipped == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "blobs": self.blobs,
            "recorded": self.recorded,
            "already_present": self.already_present,
            "replicas_added": self.replicas_added,
            "conflicts": self.conflicts,
            "namespaces": dict(self.namespaces),
            "skipped": self.skipped,
            "corrupt": list(self.corrupt),
            "unknown_fingerprints": dict(self.unknown_fingerprints),
            "orphans": list(self.orphans),
            "invalid": dict(self.invalid),
            "complete": self.complete,
            "refs": self.refs_note,
        }


@dataclass(frozen=True)
class _Blob:
    key: str
    header: ChunkHeader
    fingerprint: Fingerprint
    receipt: ReplicaReceipt


def rebuild(
    catalog: Catalog,
    store: ChunkStore,
    *,
    fingerprints: Mapping[str, Fingerprint] | None = None,
    verify: bool = True,
    chunk_size: int | None = None,
    progress: Progress | None = None,
    actor: str | None = "rebuild",
) -> RebuildReport:
    """Record every chunk found in `store` into `catalog` (idempotent); return what happened.

    `fingerprints` maps hex to `Fingerprint` for those the catalog does not
    know yet. With `verify`, each blob is read whole and checked against its
    key (`decode_chunk`); without, only its header is parsed (its own digest
    still checked). A new namespace's chunk size is inferred from a chunk
    that has a child in the store (its length is the chunk size); when no
    chunk has one, `chunk_size` is used, else the longest root chunk.
    `progress("rebuild", done, total)` is called after each blob.
    """
    report = RebuildReport(store=store.name)
    given: dict[str, Fingerprint] = {}
    for hex_, given_fp in (fingerprints or {}).items():
        if given_fp.hex != hex_:
            raise IdentityError(f"fingerprint given for {hex_} hashes to {given_fp.hex}")
        given[hex_] = given_fp
    resolved: dict[str, Fingerprint | None] = {}
    unknown: Counter[str] = Counter()

    def resolve(hex_: str) -> Fingerprint | None:
        if hex_ not in resolved:
            resolved[hex_] = catalog.get_fingerprint(hex_) or given.get(hex_)
        return resolved[hex_]

    keys = list(store.keys())
    report.blobs = len(keys)
    tier = store.tier
    blobs: list[_Blob] = []
    for done, key in enumerate(keys, 1):
        blob = _read(store, key, verify, tier, report)
        if blob is not None:
            header, receipt = blob
            fp = resolve(header.fingerprint)
            if fp is None:
                unknown[header.fingerprint] += 1
            else:
                blobs.append(_Blob(key, header, fp, receipt))
        if progress is not None:
            progress("rebuild", done, len(keys))
    report.unknown_fingerprints = dict(sorted(unknown.items()))

    by_ns: dict[str, list[_Blob]] = {}
    for b in blobs:
        by_ns.setdefault(b.header.namespace, []).append(b)
    for ns in sorted(by_ns):
        group = by_ns[ns]
        try:
            chain_root(ns)
        except IdentityError as exc:
            for b in group:
                report.invalid[b.key] = str(exc)
            continue
        existing = catalog.namespace_chunk_size(ns)
        cs = existing or catalog.ensure_namespace(ns, _infer_chunk_size(group, chunk_size))
        report.namespaces[ns] = cs
        records = _linked_records(catalog, ns, cs, group, report)
        for i in range(0, len(records), BATCH):
            _record(catalog, records[i : i + BATCH], actor, report)
    report.orphans.sort()
    return report


def _read(
    store: ChunkStore, key: str, verify: bool, tier: Tier, report: RebuildReport
) -> tuple[ChunkHeader, ReplicaReceipt] | None:
    try:
        stat = store.stat(key)
        data = store.get(key)
        header = decode_chunk(data, expected_key=key).header if verify else read_header(data)
    except ValueError as exc:  # ChunkFormatError, ChunkIntegrityError
        log.warning("rebuild: blob %s is corrupt: %s", key, exc)
        report.corrupt.append(key)
        return None
    except ChunkStoreError as exc:  # vanished or unreadable since listing
        log.warning("rebuild: blob %s is unreadable: %s", key, exc)
        report.invalid[key] = f"unreadable: {exc}"
        return None
    receipt = ReplicaReceipt(
        location=store.name,
        tier=tier,
        size=stat.size,
        checksum=f"blake3:{key}",
        stored_at=stat.mtime,
    )
    return header, receipt


def _infer_chunk_size(group: list[_Blob], explicit: int | None) -> int:
    # A chunk with a child is full, so its length is the namespace's chunk size.
    parents = {b.header.parent_hash for b in group if b.header.token_start > 0}
    full = [len(b.header.tokens) for b in group if b.header.prefix_hash in parents]
    if full:
        return max(full)
    if explicit is not None:
        return explicit
    return max(len(b.header.tokens) for b in group)


def _problem(b: _Blob, ns: str, cs: int) -> str | None:
    """Why this chunk cannot be catalogued as it is (what the catalog would refuse), or None."""
    h = b.header
    if h.token_start % cs or len(h.tokens) > cs:
        return f"chunk at token {h.token_start} with {len(h.tokens)} tokens does not fit chunk size {cs}"
    if chain_hash(h.parent_hash, h.tokens) != h.prefix_hash:
        return "prefix hash does not commit to its parent and tokens"
    if h.token_start == 0 and h.parent_hash != chain_root(ns):
        return "a chunk at token 0 does not extend the namespace's chain root"
    layout = b.fingerprint.layout
    try:
        Shard(h.layers[0], h.layers[1], h.kv_heads[0], h.kv_heads[1]).check_within(layout)
    except CatalogError as exc:
        return str(exc)
    if h.dtype != layout.dtype or h.shape[4] != layout.head_dim:
        return f"dtype/head_dim {h.dtype}/{h.shape[4]} do not match fingerprint {b.fingerprint.hex[:12]}"
    return None


def _linked_records(
    catalog: Catalog, ns: str, cs: int, group: list[_Blob], report: RebuildReport
) -> list[ChunkRecord]:
    """Records whose parent is the root, an earlier record or a catalogued prefix; parents first."""
    ends: dict[bytes, int] = {}  # prefix hash -> token end, of prefixes that will exist
    records: list[ChunkRecord] = []
    for b in sorted(group, key=lambda b: (b.header.token_start, b.key)):
        h = b.header
        why = _problem(b, ns, cs)
        if why is not None:
            report.invalid[b.key] = why
            continue
        if h.token_start > 0:
            end = ends.get(h.parent_hash)
            if end is None:
                try:
                    end = catalog.get_prefix(ns, h.parent_hash).token_end
                except NotFoundError:
                    end = -1
                ends[h.parent_hash] = end
            if end != h.token_start:  # missing parent (or one that ends elsewhere): orphan
                report.orphans.append(b.key)
                continue
        ends[h.prefix_hash] = h.token_end
        records.append(
            ChunkRecord(
                namespace=ns,
                fingerprint=b.fingerprint,
                prefix_hash=h.prefix_hash,
                parent_hash=h.parent_hash,
                token_start=h.token_start,
                tokens=h.tokens,
                shard=Shard(h.layers[0], h.layers[1], h.kv_heads[0], h.kv_heads[1]),
                blob_key=b.key,
                codec=h.codec,
                stored_bytes=b.receipt.size,
                kv_bytes=h.raw_size,
                receipts=[b.receipt],
            )
        )
    return records


def _record(
    catalog: Catalog, batch: list[ChunkRecord], actor: str | None, report: RebuildReport
) -> None:
    try:
        results = [catalog.record_chunks(batch, actor=actor)]
    except PublishError:
        # Something the checks above cannot see (a quarantined prefix, a concurrent
        # change): record one by one so one refusal does not lose the batch.
        results = []
        for r in batch:
            try:
                results.append(catalog.record_chunks([r], actor=actor))
            except PublishError as exc:
                report.invalid[r.blob_key] = f"refused by the catalog: {exc}"
    for res in results:
        report.recorded += res.recorded
        report.already_present += res.already_present
        report.replicas_added += res.replicas_added
        report.conflicts += len(res.conflicts)
