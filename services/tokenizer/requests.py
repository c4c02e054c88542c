"""The front door's table of in-flight requests, indexed by internal rid, by client request and by
client.

Clients choose their own rids, unique only on their connection, so the internal rid the rest of
the server sees is `"<client identity hex>:<client rid>"`: two clients may both send rid "1".
A request with n > 1 samples has one entry per sample (see `samples.py`); sample i > 0 is
`"<client identity hex>.<i>:<client rid>"`. The part before the first ':' is then not pure hex,
so a sample's rid never equals another client rid's, whatever characters the client rids hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from himamba.common.messages import AddRequest
from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.request_metrics import RequestClock


def internal_rid(identity: bytes, client_rid: str, index: int = 0) -> str:
    """The server-wide rid of sample `index` of a client's request."""
    if index == 0:
        return f"{identity.hex()}:{client_rid}"
    return f"{identity.hex()}.{index}:{client_rid}"


@dataclass
class RequestEntry:
    """One in-flight sample of a client request: who asked, under which rid, its output state."""

    rid: str
    identity: bytes
    client_rid: str
    output: RequestOutput
    clock: RequestClock = field(default_factory=lambda: RequestClock(time.monotonic()))
    index: int = 0
    # Sent to the scheduler, no output yet: sent again if the scheduler restarts meanwhile.
    sent: AddRequest | None = None


class RequestTable:
    """In-flight samples. An entry leaves when its final chunk (or error) has been produced."""

    def __init__(self) -> None:
        self._by_rid: dict[str, RequestEntry] = {}
        self._by_request: dict[tuple[bytes, str], set[str]] = {}
        self._by_client: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_rid)

    def request_count(self) -> int:
        """Client requests in flight (a request of n samples counts once)."""
        return len(self._by_request)

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def add(self, entry: RequestEntry) -> None:
        """Register `entry`; ValueError if that sample of that request is already in flight."""
        if entry.rid in self._by_rid:
            raise ValueError(f"rid {entry.client_rid!r} is already in flight on this connection")
        self._by_rid[entry.rid] = entry
        self._by_request.setdefault((entry.identity, entry.client_rid), set()).add(entry.rid)
        self._by_client.setdefault(entry.identity, set()).add(entry.rid)

    def get(self, rid: str) -> RequestEntry | None:
        return self._by_rid.get(rid)

    def in_flight(self, identity: bytes, client_rid: str) -> bool:
        """Whether any sample of the client's request `client_rid` is still in flight."""
        return (identity, client_rid) in self._by_request

    def samples(self, identity: bytes, client_rid: str) -> list[RequestEntry]:
        """The in-flight samples of one client request, by index."""
        rids = self._by_request.get((identity, client_rid), ())
        return sorted((self._by_rid[r] for r in rids), key=lambda e: e.index)

    def pop(self, rid: str) -> RequestEntry | None:
        """Remove and return the entry (None if it already left)."""
        entry = self._by_rid.pop(rid, None)
        if entry is not None:
            key = (entry.identity, entry.client_rid)
            self._by_request[key].discard(rid)
            if not self._by_request[key]:
                del self._by_request[key]
            self._by_client[entry.identity].discard(rid)
            if not self._by_client[entry.identity]:
                del self._by_client[entry.identity]
        return entry

    def pop_request(self, identity: bytes, client_rid: str) -> list[RequestEntry]:
        """Remove and return every in-flight sample of one client request, by index."""
        return [e for e in self.samples(identity, client_rid) if self.pop(e.rid) is not None]

    def pop_client(self, identity: bytes) -> list[RequestEntry]:
        """Remove and return every request of one client (it disconnected)."""
        return [e for rid in sorted(self._by_client.get(identity, ())) if (e := self.pop(rid)) is not None]

    def entries(self) -> list[RequestEntry]:
        return list(self._by_rid.values())
