"""HFAdapter: kvc for one loaded transformers model, restoring and checkpointing its DynamicCache."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from transformers import DynamicCache, PreTrainedModel

from catalog import AttentionLayout
from catalog.base import CatalogAPI
from catalog.models import Shard
from chunkstore import ChunkStore
from chunkstore.codecs import DEFAULT_CODEC
from restore.checkpoint import Checkpointer, CheckpointResult
from restore.engines.hf.cache import CacheBuilder, CacheSnapshot, HostBuffers
from restore.engines.hf.identity import check_cache, model_fingerprint, token_ids
from restore.errors import InputError
from restore.restore import Restorer, RestoreResult
from restore.session import Session
from restore.write_behind import DEFAULT_WRITE_BEHIND_BYTES

__all__ = ["HFAdapter"]

log = logging.getLogger(__name__)

# Idle restore buffers kept for the next restore (a restored cache's memory comes back once
# transformers has replaced its tensors): 256 MiB holds 16k tokens of a 0.5B model's bf16 KV.
DEFAULT_RESTORE_BUFFER_BYTES = 256 << 20


class HFAdapter:
    """kvc for one loaded transformers model: `restore` a verified DynamicCache, `checkpoint` one.

    `stores[0]` receives every new blob synchronously; the first object store
    after it (S3) gets a write-behind copy, catalogued after its receipt. All
    `stores` are read on restore. A worker that owns a slab of the model passes
    `shard` (layers and kv heads of the fingerprint's layout): it publishes and
    restores only those layers, and its cache holds only those kv heads.
    A restored cache's tensors are views of one host buffer; once transformers has
    replaced them (its first forward) the buffer is kept for the next restore, up to
    `restore_buffer_bytes` of idle buffers (memory written before takes a copy about
    twice as fast as memory the kernel maps anew; 0 keeps none; `restore_buffers` holds them).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        catalog: CatalogAPI,
        stores: Sequence[ChunkStore],
        namespace: str = "default",
        chunk_size: int = 256,
        *,
        weights_id: str | None = None,
        shard: Shard | None = None,
        codec: str = DEFAULT_CODEC,
        max_parallel: int = Restorer.DEFAULT_PARALLEL,
        byte_budget: int = 256 << 20,
        actor: str | None = None,
        write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
        restore_buffer_bytes: int = DEFAULT_RESTORE_BUFFER_BYTES,
    ) -> None:
        if not stores:
            raise InputError("HFAdapter needs at least one store to write to")
        self.model = model
        t0 = time.perf_counter()
        self.fingerprint = model_fingerprint(model, weights_id=weights_id)
        self.fingerprint_seconds = time.perf_counter() - t0
        log.info(
            "fingerprint %s of %s in %.2f s",
            self.fingerprint.hex[:12],
            type(model).__name__,
            self.fingerprint_seconds,
        )
        full = self.fingerprint.layout
        self.shard = shard or Shard.full(full)
        self.shard.check_within(full)
        self.layout = AttentionLayout(
            self.shard.layer_hi - self.shard.layer_lo,
            self.shard.head_hi - self.shard.head_lo,
            full.head_dim,
            full.dtype,
        )
        self.restore_buffers = HostBuffers(restore_buffer_bytes)
        self._caches = CacheBuilder(model, self.layout, self.shard, self.restore_buffers)
        self.session = Session(
            catalog,
            stores,
            namespace,
            chunk_size,
            shard=shard,
            codec=codec,
            actor=actor,
            write_behind_bytes=write_behind_bytes,
            max_parallel=max_parallel,
            byte_budget=byte_budget,
        )
        self.checkpointer: Checkpointer = self.session.checkpointer
        self.restorer: Restorer = self.session.restorer
        self.last_restore: RestoreResult | None = None

    def restore(
        self, input_ids: object, *, max_tokens: int | None = None
    ) -> tuple[DynamicCache, int]:
        """A DynamicCache holding the longest verified stored prefix of `input_ids`, and its length.

        At most `len(input_ids) - 1` positions are restored, so the model always
        computes the last prompt token's logits. On a miss the cache is empty
        and the length 0. Pass the cache (as `cache_kwarg(model)` names it)
        with the whole `input_ids` to `model.generate`; call `model(...)` with
        `input_ids[:, n:]`. `last_restore` keeps the report.
        """
        tok = token_ids(input_ids)
        dest = self._caches.destination()
        result = self.restorer.restore_into(
            dest, tok, self.fingerprint, self.shard, max_tokens=max_tokens
        )
        self.last_restore = result
        if dest.cache is None:
            return self.new_cache(), 0
        return dest.cache, result.restored_tokens

    def new_cache(self) -> DynamicCache:
        """An empty DynamicCache for this model (what `restore` returns on a miss)."""
        return DynamicCache(config=self.model.config)

    def checkpoint(
        self, token_ids: object, cache: object, name: str | None = None
    ) -> CheckpointResult:
        """Store the `cache.get_seq_length()` positions the cache holds; `token_ids` names them.

        `token_ids` must cover those positions; when it has one more (the output
        of `generate`, whose last token was never fed), that one is the ref's
        pending token. With `name`, the ref `name` points at the new head.
        Returns when every new chunk is durable and catalogued.
        """
        snapshot, tok, pending = self._snapshot(token_ids, cache)
        return self.checkpointer.checkpoint_snapshot(snapshot, tok, self.fingerprint, name, pending)

    def submit(
        self,
        token_ids: object,
        cache: object,
        name: str | None = None,
        *,
        speculative: bool = True,
    ) -> Future[CheckpointResult] | None:
        """`checkpoint` in the background; the cache may keep decoding meanwhile.

        Bounded like `Checkpointer.submit`: when the queue or staging budget is
        full, speculative work is dropped (None, counted in
        `checkpointer.dropped`) and explicit work raises `CheckpointBusyError`.
        """
        snapshot, tok, pending = self._snapshot(token_ids, cache)
        return self.checkpointer.submit_snapshot(
            snapshot, tok, self.fingerprint, name, pending, speculative=speculative
        )

    def _snapshot(
        self, ids: object, cache: object
    ) -> tuple[CacheSnapshot, np.ndarray[Any, Any], int | None]:
        layers = check_cache(cache)
        tok = token_ids(ids, "token_ids")
        n = layers[self.shard.layer_lo].get_seq_length() if len(layers) > self.shard.layer_lo else 0
        if n == 0:
            raise InputError("the cache holds no positions: nothing to checkpoint")
        if len(tok) < n:
            raise InputError(
                f"the cache holds {n} positions but token_ids has only {len(tok)}: "
                "pass the ids of every position the cache holds"
            )
        pending = int(tok[n]) if len(tok) > n else None
        return CacheSnapshot(layers, self.layout, self.shard, n), tok[:n], pending

    def close(self) -> None:
        """Finish queued checkpoints and write-behind uploads, then stop the workers."""
        self.session.close()
        self.restore_buffers.clear()

    def __enter__(self) -> HFAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
