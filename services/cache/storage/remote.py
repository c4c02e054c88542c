"""What the network stores (Redis, Mooncake Store) share: a `StoreLink` that fails fast while the
store is away, reachability in `stats()`, and existence queries and writes built on one batched round trip each."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from himamba.services.cache.storage.base import Buffer, StorageBackend, StorageStats, ValueKind, check_batch
from himamba.services.cache.storage.reconnect import StoreLink

__all__ = ["RemoteBackend"]


class RemoteBackend(StorageBackend):
    """A backend whose store lives in another process; subclasses set `link` and `_closed` and
    answer `_exist_many` in one round trip."""

    link: StoreLink
    _closed: bool

    @abstractmethod
    def _exist_many(self, keys: Sequence[bytes], kind: ValueKind) -> list[bool]:
        """Per key, whether a value of `kind` is stored (all False when the store is away)."""

    @abstractmethod
    def _set_many(self, keys: Sequence[bytes], blobs: Sequence[Buffer], kind: ValueKind, token_count: int) -> list[bool]:
        """Store values of `kind` in one round trip; per key, whether it is stored now."""

    def exists(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        found = self._exist_many(keys, ValueKind.KV)
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return self._exist_many(keys, ValueKind.STATE)

    def set_pages(self, keys: Sequence[bytes], blobs: Sequence[Buffer], token_count: int = 0) -> list[bool]:
        self._check_open()
        check_batch(keys, blobs, "blobs")
        return self._set_many(keys, blobs, ValueKind.KV, token_count)

    def set_state(self, key: bytes, blob: Buffer) -> bool:
        self._check_open()
        check_batch([key], [blob], "blob")
        return self._set_many([key], [blob], ValueKind.STATE, 0)[0]

    def stats(self) -> StorageStats:
        return self.counters.snapshot(reachable=self.link.reachable())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"storage backend {self.link.what} is closed")
