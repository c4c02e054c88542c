"""What this server believes its store holds: a bounded set of page keys.

The belief only saves work (a backup skips pages the store acknowledged before); it is never
trusted for reads, which always ask the store. So it may forget: the oldest keys go once it holds
`max_keys` (a forgotten key costs one redundant write, which the store skips or overwrites with the
same bytes), and all of it goes when the store comes back from an outage (a restarted store may
have lost everything, and believing otherwise would stop this server from writing those prefixes
again)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["KnownKeys"]


class KnownKeys:
    """A set of keys that keeps the `max_keys` most recently added."""

    def __init__(self, max_keys: int = 1 << 20) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def update(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.add(k)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Forget `keys` (the store turned out not to hold them)."""
        for k in keys:
            self._keys.pop(k, None)

    def clear(self) -> None:
        self._keys.clear()
