"""The catalog seam: what the restore side, the daemon, the service, the CLI and GC ask of a catalog.

Two implementations: `catalog.Catalog` (SQL: SQLite or PostgreSQL) and
`catalog.remote.RemoteCatalog` (the same calls over a `kvc serve` service). One
behaviour suite (`tests/catalog/test_catalog_behaviour.py`) holds both to this page.

Every method may raise `CatalogUnavailableError` (nothing landed; retry) and,
for a write, `OutcomeUnknownError` (it may have landed). The errors each
method raises besides are listed on it; all are classes of `catalog.errors`.
`actor` names who made a change in the event history (`kvc log`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from catalog.identity import Fingerprint
from catalog.models import (
    ChunkRecord,
    EventInfo,
    InvalidationDirective,
    Match,
    PinInfo,
    PrefixInfo,
    PublishResult,
    RefInfo,
    ReplicaReceipt,
    ReplicaState,
    Shard,
)

DEFAULT_CHUNK_SIZE = 256
# A namespace's chunk size is fixed at creation within these bounds. Below 4 tokens a
# chunk costs more catalog rows and hashing than the KV it names (a prompt of 1M tokens
# is already 262144 chunks of 4); above 65536 one blob would be gigabytes.
MIN_CHUNK_SIZE = 4
MAX_CHUNK_SIZE = 65536


@runtime_checkable
class CatalogAPI(Protocol):
    """The facts kvc keeps: namespaces, fingerprints, chunks, replicas, refs, pins, history."""

    def close(self) -> None:
        """Release connections and flush access statistics; the object is unusable after."""

    # -- namespaces and fingerprints -------------------------------------------

    def ensure_namespace(self, name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
        """Create the namespace if absent; return its chunk size (the stored one if it existed).

        `IdentityError`: bad name or chunk size.
        """
        ...

    def namespace_chunk_size(self, name: str) -> int | None:
        """The namespace's chunk size, or None if it does not exist. `IdentityError`: bad name."""
        ...

    def register_fingerprint(self, fp: Fingerprint, *, namespace: str | None = None) -> None:
        """Store the fingerprint's full descriptor (idempotent), as used by `namespace`."""
        ...

    def get_fingerprint(
        self, fp: Fingerprint | str, *, namespace: str | None = None
    ) -> Fingerprint | None:
        """The stored descriptor for a fingerprint (or its hex), None if unknown; with
        `namespace`, None unless that namespace registered it or published under it.

        `IdentityError`: not a fingerprint hex.
        """
        ...

    # -- publish and lookup ------------------------------------------------------

    def record_chunks(
        self, records: Sequence[ChunkRecord], *, actor: str | None = None
    ) -> PublishResult:
        """Publish `ChunkRecord`s in one transaction per namespace (idempotent, parents first).

        `PublishError` (inconsistent record; `MissingParentError`: parent not
        catalogued), `NotFoundError` (namespace), `PurgeInProgressError` (GC is
        deleting a blob the publish reuses). Nothing is recorded on any error.
        """
        ...

    def known_blob_keys(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        prefix_hashes: Sequence[bytes],
        shard: Shard,
    ) -> dict[bytes, str]:
        """Which of these prefixes already have a ready chunk (prefix hash -> blob key)."""
        ...

    def lookup(
        self,
        namespace: str,
        fingerprint: Fingerprint | str,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        shard: Shard | None = None,
        max_tokens: int | None = None,
    ) -> Match:
        """The longest restorable prefix of `tokens` (leaving one pending token) and its replicas.

        An unknown namespace or fingerprint is a miss, not an error.
        `IdentityError`: empty or out-of-range tokens; `CatalogInputError`: bad max_tokens.
        """
        ...

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Counts and bytes of a namespace (or of all): chunks, prefixes, refs, replicas by state."""
        ...

    # -- replicas -----------------------------------------------------------------

    def record_replica(
        self,
        blob_key: str,
        receipt: ReplicaReceipt,
        *,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> bool:
        """Add a replica of a catalogued blob with its receipt; True if it is new.

        `NotFoundError`: no catalogued chunk has this key; `PurgeInProgressError`.
        """
        ...

    def mark_replica(
        self,
        blob_key: str,
        location: str,
        state: ReplicaState,
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> bool:
        """Set a replica's state (`corrupt`, `missing`, `durable`, ...) with an event saying why.

        True if the replica existed. `CatalogInputError`: unknown state.
        """
        ...

    def touch_verified(
        self, location: str, blob_keys: Sequence[str], *, namespace: str | None = None
    ) -> int:
        """Record that these replicas' bytes were just read back and verified; how many."""
        ...

    def replicas_at(self, location: str, *, namespace: str | None = None) -> list[str]:
        """Blob keys with a replica at `location` (a store name, or `worker:<id>`)."""
        ...

    def remove_replicas(
        self,
        location: str,
        blob_keys: Sequence[str],
        *,
        reason: str,
        namespace: str | None = None,
        actor: str | None = None,
    ) -> int:
        """Forget replicas at `location` (pages a daemon no longer holds); how many."""
        ...

    # -- refs and pins (GC roots) ----------------------------------------------

    def create_ref(
        self,
        namespace: str,
        name: str,
        fingerprint: Fingerprint | str,
        head_hash: bytes,
        *,
        pending_token: int | None = None,
        forked_from: str | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        """Name a continuation. `RefConflictError`: the name exists; `NotFoundError`:
        no such prefix or fingerprint; `CatalogInputError`: bad name."""
        ...

    def get_ref(self, namespace: str, name: str) -> RefInfo:
        """`NotFoundError`: no such ref."""
        ...

    def list_refs(self, namespace: str) -> list[RefInfo]:
        """Every ref of the namespace, by name (empty for an unknown namespace)."""
        ...

    def update_ref(
        self,
        namespace: str,
        name: str,
        *,
        expected_head: bytes,
        new_head: bytes,
        pending_token: int | None = None,
        actor: str | None = None,
    ) -> RefInfo:
        """Compare-and-swap the ref's head. `RefConflictError`: the head was not
        `expected_head`; `NotFoundError`: no such ref or new head."""
        ...

    def fork_ref(
        self, namespace: str, source: str, name: str, *, actor: str | None = None
    ) -> RefInfo:
        """A new ref at `source`'s head. `NotFoundError`, `RefConflictError` as above."""
        ...

    def delete_ref(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        """`NotFoundError`: no such ref."""
        ...

    def pin(
        self,
        namespace: str,
        name: str,
        prefix_hash: bytes,
        *,
        ttl_s: float | None = None,
        reason: str | None = None,
        actor: str | None = None,
    ) -> PinInfo:
        """Keep a prefix from GC (until now + ttl_s if given); re-pinning a name moves it.

        `NotFoundError`: no such prefix; `CatalogInputError`: bad name, ttl or reason.
        """
        ...

    def unpin(self, namespace: str, name: str, *, actor: str | None = None) -> None:
        """`NotFoundError`: no such pin."""
        ...

    def list_pins(self, namespace: str, *, include_expired: bool = True) -> list[PinInfo]:
        """The namespace's pins, by name."""
        ...

    def declare_demand(
        self,
        worker: str,
        namespace: str,
        prefix_hash: bytes,
        *,
        priority: float = 1.0,
        ttl_s: float = 3600,
    ) -> None:
        """A worker expects to need this prefix until now + ttl_s: a GC root while live,
        and a weight in eviction. `NotFoundError`: no such namespace."""
        ...

    def demand(self, namespace: str, prefix_hashes: Sequence[bytes]) -> dict[bytes, float]:
        """The live demand (summed priority over workers) of each of these prefixes that has any."""
        ...

    # -- lineage, quarantine, history --------------------------------------------

    def get_prefix(self, namespace: str, prefix_hash: bytes) -> PrefixInfo:
        """`NotFoundError`: no such prefix in the namespace."""
        ...

    def lineage(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """The prefix and its ancestors, root first. `NotFoundError`."""
        ...

    def descendants(self, namespace: str, prefix_hash: bytes) -> list[PrefixInfo]:
        """The prefix and everything that extends it. `NotFoundError`."""
        ...

    def prefixes_with_tokens(
        self, namespace: str, tokens: Sequence[int] | np.ndarray[Any, Any], *, limit: int = 64
    ) -> list[PrefixInfo]:
        """The nodes whose own tokens are exactly `tokens`, whatever their parent, shallowest
        first, at most `limit` (64 at most); none for an unknown namespace."""
        ...

    def quarantine(
        self, namespace: str, prefix_hash: bytes, reason: str, *, actor: str | None = None
    ) -> list[InvalidationDirective]:
        """Make the prefix and its descendants unrestorable at once; one directive per replica.

        `NotFoundError`; `CatalogInputError`: empty reason.
        """
        ...

    def events(
        self,
        *,
        namespace: str | None = None,
        kind: str | None = None,
        since_seq: int = 0,
        limit: int = 1000,
    ) -> list[EventInfo]:
        """History after `since_seq`, oldest first (at most `limit`)."""
        ...
