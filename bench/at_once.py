"""Calls made all at once, one thread each, and timed together: a batch of requests as that many
concurrent users send them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def wall_seconds_at_once(calls: Sequence[Callable[[], object]]) -> float:
    """Start every call on its own thread; wall seconds until the last one returns. The first
    error a call raised is raised here, once every call has ended."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall
