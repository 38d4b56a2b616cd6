"""A chunk store that delegates to another: the base of the tests' fault-injecting stores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from chunkstore import ChunkStore, Receipt, Tier
from chunkstore.base import BlobStat


class Delegating(ChunkStore):
    """Every call goes to `inner`; subclasses override the calls they interfere with."""

    def __init__(self, inner: ChunkStore) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def tier(self) -> Tier:
        return self.inner.tier

    def put(self, key: str, data: Any) -> Receipt:
        return self.inner.put(key, data)

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def stat(self, key: str) -> BlobStat:
        return self.inner.stat(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self) -> Iterator[str]:
        return self.inner.keys()

    def put_document(self, name: str, data: bytes) -> bool:
        return self.inner.put_document(name, data)

    def get_document(self, name: str) -> bytes:
        return self.inner.get_document(name)

    def documents(self, prefix: str = "") -> Iterator[str]:
        return self.inner.documents(prefix)
