"""Stop strings over streamed text: never stream part of a stop string, cut the text before it.

Text arrives in deltas, so a stop string can straddle two of them. The matcher holds back the
longest suffix of the text that is a prefix of some stop string: that suffix may still become a
match, everything before it cannot (a match starting earlier would make a longer held suffix).

When several stop strings occur, the one that is *completed first* wins, as it would if the
text arrived one character at a time (generation halts at that point); among those completed at
the same character, the one that starts earliest. So the result never depends on how the text
was split into deltas. The stop string itself is not part of the output (OpenAI semantics).
"""

from __future__ import annotations

from typing import NamedTuple


class StopResult(NamedTuple):
    """What may be streamed now, and whether a stop string completed (the request is over)."""

    emit: str
    stopped: bool


class StopMatcher:
    """Feed text deltas; get back the safe-to-stream text. Empty `stops` passes text through."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = sorted(set(stops))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopResult:
        """Add `delta`; return the text that can be streamed and whether a stop string completed."""
        if self._stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(delta, False)
        text = self._held + delta
        cut = self._first_match(text)
        if cut is not None:
            self._held = ""
            self._stopped = True
            return StopResult(text[:cut], True)
        hold = self._longest_partial_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""
        return StopResult(text[: len(text) - hold], False)

    def flush(self) -> str:
        """The held-back text, released at the end of the stream (nothing after a stop)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, text: str) -> int | None:
        """Start of the match that ends first (ties: earliest start), or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), start)
                if best is None or key < best:
                    best = key
        return None if best is None else best[1]

    def _longest_partial_suffix(self, text: str) -> int:
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[len(text) - n :]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
