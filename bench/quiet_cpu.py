"""Waiting until the machine's CPUs are quiet before a timed run.

A pause of fixed length is not enough between engines: some keep a core busy after their last
reply (vLLM's server polls its shared-memory queue for about a second after a batch), and whoever
runs next would pay for it. So the bench first pauses, then samples /proc/stat until the CPUs'
busy time over a short window (user, system, interrupts; not idle, I/O wait or time the hypervisor
stole) falls below a fraction of one core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (of /proc/stat's "cpu" line)


class CpuTimes(NamedTuple):
    """The machine's busy CPU time so far (all CPUs), in seconds."""

    busy_s: float


class QuietWait(NamedTuple):
    """How a wait for quiet CPUs ended: whether they were quiet, after how long, and the busy
    cores (busy seconds per second) over the last window sampled; `measured` is False where the
    CPU times could not be read (then nothing was waited for)."""

    quiet: bool
    waited_s: float
    busy_cores: float
    measured: bool = True


def read_cpu_times(stat: str, ticks_per_s: int) -> CpuTimes:
    """The busy time of /proc/stat's aggregate "cpu" line (`stat`: the file's text)."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(v) for v in fields[1:8]] + [0] * 7
            return CpuTimes(sum(ticks[i] for i in _BUSY_FIELDS) / ticks_per_s)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def _proc_stat() -> CpuTimes:
    return read_cpu_times(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def wait_quiet(
    limit_s: float = 10.0,
    window_s: float = 0.25,
    busy_cores: float = 0.2,
    sample: Callable[[], CpuTimes] = _proc_stat,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> QuietWait:
    """Sample the CPUs every `window_s` until less than `busy_cores` of a core was busy over the
    last window, or `limit_s` has passed (then `quiet` is False). Where /proc/stat cannot be read
    (not Linux) it returns at once, `measured` False."""
    try:
        before = sample()
    except OSError:
        return QuietWait(False, 0.0, 0.0, measured=False)
    start = last = clock()
    while True:
        sleep(window_s)
        after, now = sample(), clock()
        cores = (after.busy_s - before.busy_s) / max(now - last, 1e-9)
        if cores < busy_cores:
            return QuietWait(True, now - start, cores)
        if now - start >= limit_s:
            return QuietWait(False, now - start, cores)
        before, last = after, now
