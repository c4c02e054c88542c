"""The front door's table of in-flight requests, indexed by internal rid and by client.

Clients choose their own rids, unique only on their connection, so the internal rid the rest of
the server sees is `"<client identity hex>:<client rid>"`: two clients may both send rid "1".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.request_metrics import RequestClock


def internal_rid(identity: bytes, client_rid: str) -> str:
    """The server-wide rid of a client's request (the hex identity holds no ':', so it splits back)."""
    return f"{identity.hex()}:{client_rid}"


@dataclass
class RequestEntry:
    """One in-flight request: who asked, under which rid, and its output state."""

    rid: str
    identity: bytes
    client_rid: str
    output: RequestOutput
    clock: RequestClock = field(default_factory=lambda: RequestClock(time.monotonic()))


class RequestTable:
    """In-flight requests. An entry leaves when its final chunk (or error) has been produced."""

    def __init__(self) -> None:
        self._by_rid: dict[str, RequestEntry] = {}
        self._by_client: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def add(self, entry: RequestEntry) -> None:
        """Register `entry`; ValueError if its client already has that rid in flight."""
        if entry.rid in self._by_rid:
            raise ValueError(f"rid {entry.client_rid!r} is already in flight on this connection")
        self._by_rid[entry.rid] = entry
        self._by_client.setdefault(entry.identity, set()).add(entry.rid)

    def get(self, rid: str) -> RequestEntry | None:
        return self._by_rid.get(rid)

    def pop(self, rid: str) -> RequestEntry | None:
        """Remove and return the entry (None if it already left)."""
        entry = self._by_rid.pop(rid, None)
        if entry is not None:
            rids = self._by_client[entry.identity]
            rids.discard(rid)
            if not rids:
                del self._by_client[entry.identity]
        return entry

    def pop_client(self, identity: bytes) -> list[RequestEntry]:
        """Remove and return every request of one client (it disconnected)."""
        return [e for rid in sorted(self._by_client.get(identity, ())) if (e := self.pop(rid)) is not None]

    def entries(self) -> list[RequestEntry]:
        return list(self._by_rid.values())
