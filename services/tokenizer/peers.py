"""Which of the other services are up, as far as the front door can tell, and their metrics.

Readiness signals: `Ready` (a service announces itself), `WorkerInfo` (the worker loaded its
model) and every `MetricsReport` (services report only once ready). Liveness: once a service
has sent a report, its reports must keep coming; one silent for `stale_after_s` counts as gone
(supervisord is restarting it, or it hangs), and its last report is no longer served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

PEERS = ("worker", "scheduler", "cache")


class Readiness(NamedTuple):
    """Whether every peer is ready, and which are not."""

    ready: bool
    not_ready: tuple[str, ...]


@dataclass
class _Peer:
    announced: bool = False
    last_report_at: float | None = None
    report_text: str = ""


class PeerTable:
    """Readiness and the latest metrics text of each peer service. Times are monotonic seconds."""

    def __init__(self, stale_after_s: float):
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self._stale_after_s = stale_after_s
        self._peers = {name: _Peer() for name in PEERS}

    def _peer(self, service: str) -> _Peer:
        peer = self._peers.get(service)
        if peer is None:
            raise ValueError(f"service must be one of {PEERS}, got {service!r}")
        return peer

    def announce(self, service: str) -> bool:
        """`service` said it is ready (Ready, or WorkerInfo from the worker); whether that is news."""
        peer = self._peer(service)
        news, peer.announced = not peer.announced, True
        return news

    def report(self, service: str, text: str, now: float) -> None:
        """A MetricsReport arrived: `service` is alive and ready; keep its text."""
        peer = self._peer(service)
        peer.announced = True
        peer.last_report_at = now
        peer.report_text = text

    def _fresh(self, peer: _Peer, now: float) -> bool:
        return peer.last_report_at is None or now - peer.last_report_at <= self._stale_after_s

    def readiness(self, now: float) -> Readiness:
        missing = tuple(n for n, p in self._peers.items() if not (p.announced and self._fresh(p, now)))
        return Readiness(not missing, missing)

    def reports(self, now: float) -> list[str]:
        """The latest metrics text of every peer whose reports are current."""
        return [
            p.report_text
            for p in self._peers.values()
            if p.last_report_at is not None and self._fresh(p, now) and p.report_text
        ]
