"""Rebuild: recreate a lost catalog from the stores alone (ARCHITECTURE 9, docs/operations.md).

A store describes itself: every blob's header names its fingerprint (by
hex), namespace, prefix and parent hash, token ids and shard, and the
fingerprint's descriptor is a verified document in the same store
(`fingerprints/<hex>`, restore/descriptors.py). `rebuild` reads every store
given, merges what they hold (one chunk per (fingerprint, prefix, shard), one
replica per store holding a good copy, in that store's tier) and records it:

1. descriptors: the target catalog's, the stores' (verified; a bad document
   is reported and never trusted), and any the caller passes (for blobs
   written before stores held descriptors);
2. blobs: every copy in every store is read and verified (`scan_stores`);
3. chunks: namespace by namespace, parents first, in batches; only what is
   missing is added. A chunk the catalog (or an earlier copy) already has
   with another blob key is a conflict: reported, never overwritten;
4. refs, pins and quarantines: from the stores' journal (maintenance/rebuild_journal.py),
   adding only what the catalog lacks; blobs GC purged after they were stored are
   left out before step 3.

With `dry_run` steps 1-3 read and verify everything and report what would be
added; nothing is written (the catalog may even be absent: `catalog=None`).

Skipped, never an error: corrupt or unreadable copies (another store's good
copy still counts), chunks of an unknown fingerprint, chunks that do not fit
their namespace or fingerprint, and orphans (a chunk whose parent prefix is
neither in the stores nor catalogued; its whole subtree goes with it).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from catalog import Fingerprint, chain_hash, chain_root
from catalog.catalog import Catalog
from catalog.errors import CatalogError, IdentityError, NotFoundError, PublishError
from catalog.identity import AttentionLayout
from catalog.models import ChunkRecord, Shard
from chunkstore import ChunkStore
from maintenance.journal import read_journal
from maintenance.progress import Progress
from maintenance.rebuild_journal import JournalOutcome, apply_journal, purged_since_stored
from maintenance.rebuild_scan import StoredBlob, scan_stores
from restore.descriptors import load_descriptors

log = logging.getLogger(__name__)

BATCH = 256  # chunk records per catalog transaction

NOT_RECOVERED = (
    "demands, access statistics and the event history (refs, pins and quarantines come from "
    "the stores' journal; a change whose journal write failed is missing until resynced)"
)

_Ident = tuple[str, bytes, int, int, int, int]  # (fingerprint hex, prefix hash, shard bounds)


@dataclass(frozen=True)
class RebuildConflict:
    """A blob for a (fingerprint, prefix, shard) the catalog (or an earlier copy) holds with another key."""

    fingerprint: str
    prefix_hash: bytes
    shard: tuple[int, int, int, int]  # layer_lo, layer_hi, head_lo, head_hi
    kept: str
    rejected: str
    stores: tuple[str, ...]  # where the rejected blob is

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "prefix_hash": self.prefix_hash.hex(),
            "shard": list(self.shard),
            "kept": self.kept,
            "rejected": self.rejected,
            "stores": list(self.stores),
        }


@dataclass
class RebuildReport:
    """What a rebuild found and did (with `dry_run`: would do). `complete`: nothing to report."""

    stores: list[str]
    dry_run: bool = False
    blobs: int = 0  # distinct blob keys over all stores
    copies: dict[str, int] = field(default_factory=dict)  # store name -> blobs listed there
    descriptors: int = 0  # verified fingerprint descriptors found in the stores
    rejected_descriptors: dict[str, str] = field(default_factory=dict)  # "store doc" -> why
    fingerprints_added: list[str] = field(default_factory=list)
    namespaces: dict[str, int] = field(default_factory=dict)  # name -> chunk size used
    namespaces_added: list[str] = field(default_factory=list)
    recorded: int = 0  # chunks new to the catalog
    already_present: int = 0
    replicas_added: int = 0
    conflicts: list[RebuildConflict] = field(default_factory=list)
    corrupt: dict[str, dict[str, str]] = field(default_factory=dict)  # key -> {store: why}
    lost: list[str] = field(default_factory=list)  # keys with no good copy in any store
    unlisted: dict[str, str] = field(default_factory=dict)  # store -> why it could not be listed
    unknown_fingerprints: dict[str, int] = field(default_factory=dict)  # hex -> chunks skipped
    orphans: list[str] = field(default_factory=list)  # blob keys
    invalid: dict[str, str] = field(default_factory=dict)  # blob key -> why
    journal: JournalOutcome = field(default_factory=JournalOutcome)
    not_recovered: str = NOT_RECOVERED

    @property
    def skipped(self) -> int:
        """Blobs that were not (would not be) catalogued for a problem of their own."""
        return (
            len(self.lost)
            + sum(self.unknown_fingerprints.values())
            + len(self.orphans)
            + len(self.invalid)
        )

    @property
    def complete(self) -> bool:
        return not (
            self.skipped
            or self.corrupt
            or self.conflicts
            or self.rejected_descriptors
            or self.unlisted
            or self.journal.untrusted
            or self.journal.disagreements
            or self.journal.unresolved
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stores": list(self.stores),
            "dry_run": self.dry_run,
            "blobs": self.blobs,
            "copies": dict(self.copies),
            "descriptors": self.descriptors,
            "rejected_descriptors": dict(self.rejected_descriptors),
            "fingerprints_added": list(self.fingerprints_added),
            "namespaces": dict(self.namespaces),
            "namespaces_added": list(self.namespaces_added),
            "recorded": self.recorded,
            "already_present": self.already_present,
            "replicas_added": self.replicas_added,
            "conflicts": [c.to_dict() for c in self.conflicts],
            "skipped": self.skipped,
            "corrupt": {k: dict(v) for k, v in self.corrupt.items()},
            "lost": list(self.lost),
            "unlisted": dict(self.unlisted),
            "unknown_fingerprints": dict(self.unknown_fingerprints),
            "orphans": list(self.orphans),
            "invalid": dict(self.invalid),
            "complete": self.complete,
            "journal": self.journal.to_dict(),
            "not_recovered": self.not_recovered,
        }


@dataclass(frozen=True)
class _Blob:
    stored: StoredBlob
    fingerprint: Fingerprint

    @property
    def key(self) -> str:
        return self.stored.key

    @property
    def first_stored(self) -> Any:
        return min(r.stored_at for r in self.stored.receipts)


class _View:
    """The read-only questions a rebuild asks the target catalog; no catalog reads as empty."""

    def __init__(self, catalog: Catalog | None) -> None:
        self.catalog = catalog
        self._replicas: dict[tuple[str, str], set[str]] = {}

    def fingerprint(self, hex_: str) -> Fingerprint | None:
        return None if self.catalog is None else self.catalog.get_fingerprint(hex_)

    def chunk_size(self, ns: str) -> int | None:
        return None if self.catalog is None else self.catalog.namespace_chunk_size(ns)

    def prefix_end(self, ns: str, prefix: bytes) -> int | None:
        if self.catalog is None:
            return None
        try:
            return self.catalog.get_prefix(ns, prefix).token_end
        except NotFoundError:
            return None

    def kept_keys(self, ns: str, fp: str, prefixes: list[bytes], shard: Shard) -> dict[bytes, str]:
        if self.catalog is None:
            return {}
        return self.catalog.known_blob_keys(ns, fp, prefixes, shard)

    def has_replica(self, ns: str, location: str, key: str) -> bool:
        if self.catalog is None:
            return False
        if (ns, location) not in self._replicas:
            self._replicas[ns, location] = set(self.catalog.replicas_at(location, namespace=ns))
        return key in self._replicas[ns, location]


def rebuild(
    catalog: Catalog | None,
    stores: ChunkStore | Sequence[ChunkStore],
    *,
    fingerprints: Mapping[str, Fingerprint] | None = None,
    verify: bool = True,
    chunk_size: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    actor: str | None = "rebuild",
) -> RebuildReport:
    """Record into `catalog` what `stores` hold and it lacks (idempotent); return what happened.

    `fingerprints` maps hex to `Fingerprint` for blobs whose store holds no
    descriptor (written before descriptors were stored) and that the catalog
    does not know. With `verify`, every copy is read whole and checked
    against its key; without, only headers are parsed. A new namespace's chunk
    size is inferred from a chunk that has a child (its length is the chunk
    size); when no chunk has one, `chunk_size` is used, else the longest root
    chunk. With `dry_run` nothing is written and `catalog` may be None (an
    empty catalog). `progress(stage, done, total)` is called per copy read
    ("rebuild read") and per batch recorded ("rebuild record").
    """
    store_list = [stores] if isinstance(stores, ChunkStore) else list(stores)
    names = [s.name for s in store_list]
    if not store_list:
        raise ValueError("rebuild needs at least one store")
    if len(set(names)) != len(names):
        raise ValueError(
            f"a store is given twice: {sorted(n for n in names if names.count(n) > 1)[0]}"
        )
    if catalog is None and not dry_run:
        raise ValueError("only a dry run may go without a catalog")
    report = RebuildReport(stores=names, dry_run=dry_run)
    view = _View(catalog)

    # Step 1: descriptors. All are verified against their hex, so their sources agree.
    given: dict[str, Fingerprint] = {}
    for hex_, given_fp in (fingerprints or {}).items():
        if given_fp.hex != hex_:
            raise IdentityError(f"fingerprint given for {hex_} hashes to {given_fp.hex}")
        given[hex_] = given_fp
    loaded = load_descriptors(store_list)
    report.descriptors = len(loaded.found)
    report.rejected_descriptors = dict(sorted(loaded.rejected.items()))
    resolved: dict[str, Fingerprint | None] = {}
    new_fps: set[str] = set()

    def resolve(hex_: str) -> Fingerprint | None:
        if hex_ not in resolved:
            fp = view.fingerprint(hex_)
            if fp is None:
                fp = loaded.found.get(hex_) or given.get(hex_)
                if fp is not None:
                    new_fps.add(hex_)
            resolved[hex_] = fp
        return resolved[hex_]

    # Step 2: every copy in every store, read and verified, merged by key.
    def layout_of(hex_: str) -> AttentionLayout | None:
        fp = (
            resolved.get(hex_)
            or view.fingerprint(hex_)
            or loaded.found.get(hex_)
            or given.get(hex_)
        )
        return None if fp is None else fp.layout

    scan = scan_stores(store_list, verify=verify, layout_of=layout_of, progress=progress)
    report.copies = scan.copies
    report.unlisted = scan.unlisted
    report.corrupt = dict(sorted(scan.damaged.items()))
    report.lost = scan.lost
    report.blobs = len(scan.blobs) + len(report.lost)
    # What GC purged after the copies were written stays purged (the journal says so).
    journal = read_journal(store_list, progress=progress)
    report.journal.records = journal.records
    report.journal.untrusted = list(journal.skipped)
    purged = purged_since_stored(journal, {k: b.receipts for k, b in scan.blobs.items()})
    report.journal.purged = sorted(purged)
    unknown: Counter[str] = Counter()
    by_ns: dict[str, list[_Blob]] = {}
    for key in sorted(scan.blobs.keys() - purged):
        stored = scan.blobs[key]
        fp = resolve(stored.header.fingerprint)
        if fp is None:
            unknown[stored.header.fingerprint] += 1
        else:
            by_ns.setdefault(stored.header.namespace, []).append(_Blob(stored, fp))
    report.unknown_fingerprints = dict(sorted(unknown.items()))

    # Step 3: chunks, namespace by namespace, parents first; conflicts are never written.
    total = sum(len(g) for g in by_ns.values())
    done = 0
    used_fps: set[str] = set()
    added_prefixes: set[tuple[str, bytes]] = set()
    for ns in sorted(by_ns):
        group = by_ns[ns]
        try:
            chain_root(ns)
        except IdentityError as exc:
            for b in group:
                report.invalid[b.key] = str(exc)
            continue
        cs = view.chunk_size(ns)
        if cs is None:
            cs = _infer_chunk_size(group, chunk_size)
            report.namespaces_added.append(ns)
            if catalog is not None and not dry_run:
                cs = catalog.ensure_namespace(ns, cs)
        report.namespaces[ns] = cs
        records = _classify(view, ns, _linked_records(view, ns, cs, group, report), report)
        used_fps.update(r.fingerprint.hex for r in records)
        added_prefixes.update((ns, r.prefix_hash) for r in records)
        for i in range(0, len(records), BATCH):
            batch = records[i : i + BATCH]
            if catalog is not None and not dry_run:
                _record(catalog, batch, actor, report)
            done += len(batch)
            if progress is not None:
                progress("rebuild record", done, total)
    report.fingerprints_added = sorted(new_fps & used_fps)
    report.orphans.sort()

    # Step 4: refs, pins and quarantines from the journal, once their prefixes are recorded.
    apply_journal(
        catalog,
        journal,
        report.journal,
        known_prefixes=added_prefixes,
        known_fingerprint=lambda hex_: resolve(hex_) is not None,
        dry_run=dry_run,
        actor=actor,
    )
    return report


def _infer_chunk_size(group: list[_Blob], explicit: int | None) -> int:
    # A chunk with a child is full, so its length is the namespace's chunk size.
    parents = {b.stored.header.parent_hash for b in group if b.stored.header.token_start > 0}
    full = [len(b.stored.header.tokens) for b in group if b.stored.header.prefix_hash in parents]
    if full:
        return max(full)
    if explicit is not None:
        return explicit
    return max(len(b.stored.header.tokens) for b in group)


def _shard(b: _Blob) -> Shard:
    h = b.stored.header
    return Shard(h.layers[0], h.layers[1], h.kv_heads[0], h.kv_heads[1])


def _problem(b: _Blob, ns: str, cs: int) -> str | None:
    """Why this chunk cannot be catalogued as it is (what the catalog would refuse), or None."""
    h = b.stored.header
    if h.token_start % cs or len(h.tokens) > cs:
        return f"chunk at token {h.token_start} with {len(h.tokens)} tokens does not fit chunk size {cs}"
    if chain_hash(h.parent_hash, h.tokens) != h.prefix_hash:
        return "prefix hash does not commit to its parent and tokens"
    if h.token_start == 0 and h.parent_hash != chain_root(ns):
        return "a chunk at token 0 does not extend the namespace's chain root"
    layout = b.fingerprint.layout
    try:
        _shard(b).check_within(layout)
    except CatalogError as exc:
        return str(exc)
    if h.dtype != layout.dtype or h.shape[4] != layout.head_dim:
        return f"dtype/head_dim {h.dtype}/{h.shape[4]} do not match fingerprint {b.fingerprint.hex[:12]}"
    return None


def _linked_records(
    view: _View, ns: str, cs: int, group: list[_Blob], report: RebuildReport
) -> list[ChunkRecord]:
    """Records whose parent is the root, an earlier record or a catalogued prefix; parents first.

    Among blobs for one chunk, the one stored first comes first (the catalog keeps the first).
    """
    ends: dict[bytes, int] = {}  # prefix hash -> token end, of prefixes that will exist
    records: list[ChunkRecord] = []
    for b in sorted(group, key=lambda b: (b.stored.header.token_start, b.first_stored, b.key)):
        h = b.stored.header
        why = _problem(b, ns, cs)
        if why is not None:
            report.invalid[b.key] = why
            continue
        if h.token_start > 0:
            if h.parent_hash not in ends:
                end = view.prefix_end(ns, h.parent_hash)
                ends[h.parent_hash] = -1 if end is None else end
            if ends[h.parent_hash] != h.token_start:  # missing parent (or one ending elsewhere)
                report.orphans.append(b.key)
                continue
        ends[h.prefix_hash] = h.token_end
        receipts = sorted(b.stored.receipts, key=lambda r: r.location)
        records.append(
            ChunkRecord(
                namespace=ns,
                fingerprint=b.fingerprint,
                prefix_hash=h.prefix_hash,
                parent_hash=h.parent_hash,
                token_start=h.token_start,
                tokens=h.tokens,
                shard=_shard(b),
                blob_key=b.key,
                codec=h.codec,
                stored_bytes=receipts[0].size,
                kv_bytes=h.raw_size,
                receipts=receipts,
            )
        )
    return records


def _ident(r: ChunkRecord) -> _Ident:
    s = r.shard
    return (r.fingerprint.hex, r.prefix_hash, s.layer_lo, s.layer_hi, s.head_lo, s.head_hi)


def _conflict(r: ChunkRecord, kept: str) -> RebuildConflict:
    s = r.shard
    return RebuildConflict(
        fingerprint=r.fingerprint.hex,
        prefix_hash=r.prefix_hash,
        shard=(s.layer_lo, s.layer_hi, s.head_lo, s.head_hi),
        kept=kept,
        rejected=r.blob_key,
        stores=tuple(rc.location for rc in r.receipts),
    )


def _classify(
    view: _View, ns: str, records: list[ChunkRecord], report: RebuildReport
) -> list[ChunkRecord]:
    """Drop (and report) conflicts; count what a dry run would add. Returns what to record.

    A record conflicts when the catalog, or an earlier record of this rebuild,
    has its (fingerprint, prefix, shard) with another blob key.
    """
    kept: dict[_Ident, str] = {}
    groups: dict[tuple[str, Shard], list[bytes]] = {}
    for r in records:
        groups.setdefault((r.fingerprint.hex, r.shard), []).append(r.prefix_hash)
    for (fp, shard), prefixes in groups.items():
        found = view.kept_keys(ns, fp, sorted(set(prefixes)), shard)
        for prefix, key in found.items():
            kept[(fp, prefix, shard.layer_lo, shard.layer_hi, shard.head_lo, shard.head_hi)] = key
    catalogued = set(kept)
    out: list[ChunkRecord] = []
    for r in records:
        ident = _ident(r)
        first = kept.setdefault(ident, r.blob_key)
        if first != r.blob_key:
            report.conflicts.append(_conflict(r, first))
            continue
        if ident in catalogued and all(
            view.has_replica(ns, rc.location, r.blob_key) for rc in r.receipts
        ):
            report.already_present += 1  # nothing to add (and nothing to refuse: quarantine)
            continue
        out.append(r)
        if report.dry_run:
            if ident in catalogued:
                report.already_present += 1
                report.replicas_added += sum(
                    not view.has_replica(ns, rc.location, r.blob_key) for rc in r.receipts
                )
            else:
                report.recorded += 1
                report.replicas_added += len(r.receipts)
    return out


def _add_replicas(catalog: Catalog, r: ChunkRecord, actor: str | None) -> int | None:
    """Add `r`'s replicas to its catalogued chunk; None when the chunk is not catalogued."""
    try:
        return sum(
            catalog.record_replica(r.blob_key, rc, namespace=r.namespace, actor=actor)
            for rc in r.receipts
        )
    except NotFoundError:
        return None


def _record(
    catalog: Catalog, batch: list[ChunkRecord], actor: str | None, report: RebuildReport
) -> None:
    try:
        results = [(batch, catalog.record_chunks(batch, actor=actor))]
    except PublishError:
        # Something the checks above cannot see (a quarantined prefix, a concurrent
        # change): record one by one so one refusal does not lose the batch.
        results = []
        for r in batch:
            try:
                results.append(([r], catalog.record_chunks([r], actor=actor)))
            except PublishError as exc:
                added = _add_replicas(catalog, r, actor)
                if added is None:
                    report.invalid[r.blob_key] = f"refused by the catalog: {exc}"
                else:  # catalogued already (under quarantine, say): only its new copies
                    report.already_present += 1
                    report.replicas_added += added
    for records, res in results:
        report.recorded += res.recorded
        report.already_present += res.already_present
        report.replicas_added += res.replicas_added
        by_key = {r.blob_key: r for r in records}
        for c in res.conflicts:  # a concurrent publish got there between our read and write
            report.conflicts.append(_conflict(by_key[c.rejected_key], c.kept_key))
