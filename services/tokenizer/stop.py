"""Stop strings over streamed text: never stream part of a stop string, cut the text before it.

Text arrives in deltas, so a stop string can straddle two of them. The matcher holds back the
longest suffix of the text that is a prefix of some stop string: that suffix may still become a
match, everything before it cannot (a match starting earlier would make a longer held suffix).

When several stop strings occur, the one that is *completed first* wins, as it would if the
text arrived one character at a time (generation halts at that point); among those completed at
the same character, the one that starts earliest. So the result never depends on how the text
was split into deltas. The stop string itself is not part of the output (OpenAI semantics).

Matching is an Aho-Corasick automaton over characters, built once per request: each new
character costs O(1) amortised whatever the number of stop strings, and the automaton's state
is exactly the held suffix (the longest suffix of the text that is a prefix of a stop string).
"""

from __future__ import annotations

from typing import NamedTuple


class StopResult(NamedTuple):
    """What may be streamed now, and whether a stop string completed (the request is over)."""

    emit: str
    stopped: bool


class _Automaton:
    """Aho-Corasick over the stop strings: `goto` per state, failure links, and for each state
    the longest stop string that ends there (0: none)."""

    def __init__(self, stops: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        self.ends = [0]  # length of the longest stop string ending at this state
        for s in stops:
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.fail.append(0)
                    self.ends.append(0)
                    self.goto[state][ch] = nxt
                state = nxt
            self.ends[state] = max(self.ends[state], len(s))
        queue = list(self.goto[0].values())
        for state in queue:  # breadth first: a state's failure target is shallower, so done
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                target = self.goto[f].get(ch, 0)
                self.fail[nxt] = target if target != nxt else 0
                self.ends[nxt] = max(self.ends[nxt], self.ends[self.fail[nxt]])
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


class StopMatcher:
    """Feed text deltas; get back the safe-to-stream text. Empty `stops` passes text through."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._auto = _Automaton(sorted(set(stops))) if stops else None
        self._state = 0
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that completed

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopResult:
        """Add `delta`; return the text that can be streamed and whether a stop string completed."""
        if self._stopped:
            return StopResult("", True)
        auto = self._auto
        if auto is None:
            return StopResult(delta, False)
        text = self._held + delta
        state = self._state
        base = len(self._held)
        for i, ch in enumerate(delta):
            state = auto.step(state, ch)
            if auto.ends[state]:
                # The first match to complete; the longest one ending here starts earliest.
                end = base + i + 1
                self._held = ""
                self._stopped = True
                self.matched = text[end - auto.ends[state] : end]
                return StopResult(text[: end - auto.ends[state]], True)
        self._state = state
        hold = auto.depth[state]
        self._held = text[len(text) - hold :] if hold else ""
        return StopResult(text[: len(text) - hold], False)

    def flush(self) -> str:
        """The held-back text, released at the end of the stream (nothing after a stop)."""
        held, self._held = self._held, ""
        self._state = 0
        return "" if self._stopped else held
