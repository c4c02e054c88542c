"""Eviction orders: which evictable tree member goes first.

The radix tree keeps one queue per resource (device KV leaves, device states, host KV leaves, host
states). A queue holds exactly the members that are evictable right now; the tree adds and discards
members as their condition changes and reports uses with `touch`. The queue only decides the order.
In every policy, members marked expired (stamp EXPIRED, e.g. a state superseded by a deeper one)
go first, oldest expiry first.

Two policies:

* `lru`: least recently used first (a lazy min-heap over use stamps).
* `scan_resistant`: members without proven reuse ("probation": never hit, and not the continuation
  of a hit) go before members with it ("protected"), and probation is evicted in *random* order.
  Under a round-robin (looping) workload bigger than the cache, LRU always evicts exactly the entry
  that is needed next and caches nothing; random probation keeps a random subset of entries long
  enough to be hit, and once hit they are protected. Protected members are evicted in LRU order,
  and first whenever they hold more than `protected_share` of the queue's weight, so that a stale
  hot set cannot lock new entries out. Random choices come from a seeded generator: runs repeat.
"""

from __future__ import annotations

import heapq
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Literal

EvictionPolicy = Literal["lru", "scan_resistant"]
EVICTION_POLICIES: tuple[str, ...] = ("lru", "scan_resistant")

# A member added or touched with this stamp is expired (e.g. a state superseded by a deeper one):
# every policy evicts expired members first, oldest expiry first.
EXPIRED = 0


class EvictionQueue(ABC):
    """An ordered set of evictable members. `pop` removes and returns the next victim, or None.

    Stamps are positive use counters; EXPIRED (0) marks a member to go first."""

    @abstractmethod
    def add(self, member: Hashable, stamp: int, warm: bool, weight: int) -> None:
        """Insert a member (must not be present). stamp: its last use; warm: it has been hit."""

    @abstractmethod
    def discard(self, member: Hashable) -> None:
        """Remove a member if present."""

    @abstractmethod
    def touch(self, member: Hashable, stamp: int, warm: bool) -> None:
        """Record a use of a present member (or its expiry, with stamp EXPIRED)."""

    @abstractmethod
    def set_weight(self, member: Hashable, weight: int) -> None:
        """Change the weight (e.g. page count after a split) of a present member."""

    @abstractmethod
    def pop(self) -> Hashable | None:
        """Remove and return the next victim, or None when empty."""

    @abstractmethod
    def __contains__(self, member: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Hashable]: ...

    @abstractmethod
    def check(self) -> None:
        """Raise AssertionError if the internal structures disagree."""


class LRUQueue(EvictionQueue):
    """Least recently used first (expired members have the smallest stamp); ties go to the member
    added or touched first."""

    __slots__ = ("_stamp", "_heap", "_seq")

    def __init__(self) -> None:
        self._stamp: dict[Hashable, int] = {}
        # Lazy heap: an entry is live only while its stamp is the member's current stamp.
        self._heap: list[tuple[int, int, Hashable]] = []
        self._seq = 0

    def add(self, member: Hashable, stamp: int, warm: bool = False, weight: int = 1) -> None:
        self._stamp[member] = stamp
        self._push(member, stamp)

    def discard(self, member: Hashable) -> None:
        self._stamp.pop(member, None)

    def touch(self, member: Hashable, stamp: int, warm: bool = False) -> None:
        if self._stamp.get(member, stamp) != stamp:
            self._stamp[member] = stamp
            self._push(member, stamp)

    def set_weight(self, member: Hashable, weight: int) -> None:
        pass

    def pop(self) -> Hashable | None:
        heap = self._heap
        stamps = self._stamp
        while heap:
            stamp, _, member = heapq.heappop(heap)
            if stamps.get(member) == stamp:
                del stamps[member]
                return member
        return None

    def _push(self, member: Hashable, stamp: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (stamp, self._seq, member))
        # Stale entries are only dropped when popped; rebuild before they dominate the heap.
        if len(self._heap) > 2 * len(self._stamp) + 64:
            live = sorted((s, i, m) for i, (m, s) in enumerate(self._stamp.items()))
            self._heap = live
            self._seq = len(live)

    def __contains__(self, member: object) -> bool:
        return member in self._stamp

    def __len__(self) -> int:
        return len(self._stamp)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._stamp))

    def check(self) -> None:
        live = {m for s, _, m in self._heap if self._stamp.get(m) == s}
        if live != set(self._stamp):
            raise AssertionError("LRU queue: a member has no live heap entry")


class ScanResistantQueue(EvictionQueue):
    """Random-order probation for never-hit members, LRU for hit members (see the module docstring)."""

    __slots__ = ("_expired", "_cold", "_cold_pos", "_hot", "_weight", "_hot_weight", "_total_weight", "_rng", "_share")

    def __init__(self, seed: int = 0, protected_share: float = 0.9) -> None:
        if not 0.0 <= protected_share <= 1.0:
            raise ValueError(f"protected_share must be in [0, 1], got {protected_share}")
        self._expired: OrderedDict[Hashable, None] = OrderedDict()
        self._cold: list[Hashable] = []
        self._cold_pos: dict[Hashable, int] = {}
        self._hot = LRUQueue()
        self._weight: dict[Hashable, int] = {}
        self._hot_weight = 0
        self._total_weight = 0
        self._rng = random.Random(seed)
        self._share = protected_share

    def add(self, member: Hashable, stamp: int, warm: bool = False, weight: int = 1) -> None:
        self._weight[member] = weight
        self._total_weight += weight
        if stamp == EXPIRED:
            self._expired[member] = None
        elif warm:
            self._hot.add(member, stamp)
            self._hot_weight += weight
        else:
            self._cold_pos[member] = len(self._cold)
            self._cold.append(member)

    def discard(self, member: Hashable) -> None:
        weight = self._weight.pop(member, None)
        if weight is None:
            return
        self._total_weight -= weight
        if member in self._cold_pos:
            self._remove_cold(member)
        elif member in self._expired:
            del self._expired[member]
        else:
            self._hot.discard(member)
            self._hot_weight -= weight

    def touch(self, member: Hashable, stamp: int, warm: bool = False) -> None:
        if member not in self._weight:
            return
        if stamp == EXPIRED or member in self._expired:
            weight = self._weight[member]
            self.discard(member)
            self.add(member, stamp, warm, weight)
        elif member in self._cold_pos:
            if warm:
                self._remove_cold(member)
                self._hot.add(member, stamp)
                self._hot_weight += self._weight[member]
        else:
            self._hot.touch(member, stamp)

    def set_weight(self, member: Hashable, weight: int) -> None:
        old = self._weight[member]
        self._weight[member] = weight
        self._total_weight += weight - old
        if member in self._hot:  # neither a probation nor an expired member counts as protected
            self._hot_weight += weight - old

    def pop(self) -> Hashable | None:
        if self._expired:
            member = self._expired.popitem(last=False)[0]
        elif self._cold and self._hot_weight <= self._share * self._total_weight:
            member = self._cold[self._rng.randrange(len(self._cold))]
            self._remove_cold(member)
        else:
            member = self._hot.pop()
            if member is None:
                return None
            self._hot_weight -= self._weight[member]
        self._total_weight -= self._weight.pop(member)
        return member

    def _remove_cold(self, member: Hashable) -> None:
        # Swap with the last element so removal is O(1).
        pos = self._cold_pos.pop(member)
        last = self._cold.pop()
        if last is not member:
            self._cold[pos] = last
            self._cold_pos[last] = pos

    def __contains__(self, member: object) -> bool:
        return member in self._weight

    def __len__(self) -> int:
        return len(self._weight)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._weight))

    def check(self) -> None:
        self._hot.check()
        if any(self._cold[p] is not m for m, p in self._cold_pos.items()) or len(self._cold) != len(self._cold_pos):
            raise AssertionError("scan-resistant queue: probation list and positions disagree")
        hot = set(self._hot)
        cold = set(self._cold_pos)
        expired = set(self._expired)
        if hot & cold or hot & expired or cold & expired or hot | cold | expired != set(self._weight):
            raise AssertionError("scan-resistant queue: segments do not partition the members")
        if self._total_weight != sum(self._weight.values()):
            raise AssertionError("scan-resistant queue: total weight is stale")
        if self._hot_weight != sum(self._weight[m] for m in hot):
            raise AssertionError("scan-resistant queue: protected weight is stale")


def make_queue(policy: str, seed: int = 0) -> EvictionQueue:
    """The queue for an eviction policy name (`lru` or `scan_resistant`)."""
    if policy == "lru":
        return LRUQueue()
    if policy == "scan_resistant":
        return ScanResistantQueue(seed)
    raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
