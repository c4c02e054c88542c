"""Start several `himamba serve` processes at once (startup is mostly imports: they overlap)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from himamba.bench.servers import ServerProcess, start_server


def start_together(model: Path, log_dir: Path, flag_sets: Sequence[Sequence[str]]) -> list[ServerProcess]:
    """Start several servers at once (startup is mostly imports: they overlap well)."""
    results: list[ServerProcess | BaseException | None] = [None] * len(flag_sets)

    def start(i: int) -> None:
        try:
            results[i] = start_server(model, log_dir, *flag_sets[i])
        except BaseException as e:  # reported below, after every thread is done
            results[i] = e

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(flag_sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, ServerProcess):
                r.stop()
        raise errors[0]
    return [r for r in results if isinstance(r, ServerProcess)]
