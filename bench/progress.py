"""A progress bar for benchmarks: tqdm when it is installed, else a plain counter on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Counts finished steps of one run (requests by default; `unit`/`units` name them).
    `grow(-n)` shrinks the total (requests that will never be sent, e.g. the later rounds of a
    conversation whose request failed)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "req", units: str = "requests"):
        self.total = total
        self.desc = desc
        self.units = units
        self.n = 0
        self._bar: Any = None
        self._enabled = enabled
        self._last_print = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, file=sys.stderr, unit=unit, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._enabled:
            now = time.monotonic()
            # At most a few lines a second: the counter must not cost the run it measures.
            if now - self._last_print > 0.5 or self.n >= self.total:
                self._last_print = now
                print(f"\r{self.desc}: {self.n}/{self.total} {self.units}", end="", file=sys.stderr, flush=True)

    def grow(self, delta: int) -> None:
        self.total += delta
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            print(file=sys.stderr, flush=True)
