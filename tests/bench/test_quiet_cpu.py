"""Waiting for quiet CPUs before a timed run: /proc/stat's busy time, a wait that ends once a
window is quiet or at its limit, and a real busy process seen as busy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from himamba.bench.quiet_cpu import CpuTimes, read_cpu_times, wait_quiet

_STAT = """cpu  100 5 20 900 7 3 2 50 0 0
cpu0 60 5 10 400 3 1 1 25 0 0
cpu1 40 0 10 500 4 2 1 25 0 0
ctxt 12345
"""


def test_busy_time_is_user_nice_system_and_interrupts_not_idle_iowait_or_steal() -> None:
    assert read_cpu_times(_STAT, ticks_per_s=100) == CpuTimes((100 + 5 + 20 + 3 + 2) / 100)
    with pytest.raises(ValueError, match="cpu"):
        read_cpu_times("ctxt 1\n", ticks_per_s=100)


class _Machine:
    """A fake machine whose CPUs are busy `cores[i]` over window i, and its clock."""

    def __init__(self, cores: list[float]) -> None:
        self.cores, self.now, self.busy, self.window = cores, 0.0, 0.0, 0

    def sample(self) -> CpuTimes:
        return CpuTimes(self.busy)

    def sleep(self, seconds: float) -> None:
        self.busy += self.cores[min(self.window, len(self.cores) - 1)] * seconds
        self.now += seconds
        self.window += 1


def test_the_wait_ends_at_the_first_quiet_window() -> None:
    m = _Machine([1.9, 1.0, 0.05, 2.0])
    waited = wait_quiet(limit_s=10, window_s=0.25, busy_cores=0.2, sample=m.sample, sleep=m.sleep, clock=lambda: m.now)
    assert waited.quiet and waited.measured
    assert waited.waited_s == pytest.approx(0.75)
    assert waited.busy_cores == pytest.approx(0.05)


def test_the_wait_gives_up_at_its_limit_and_says_how_busy_the_cpus_were() -> None:
    m = _Machine([1.0])
    waited = wait_quiet(limit_s=1.0, window_s=0.25, busy_cores=0.2, sample=m.sample, sleep=m.sleep, clock=lambda: m.now)
    assert not waited.quiet
    assert waited.waited_s == pytest.approx(1.0)
    assert waited.busy_cores == pytest.approx(1.0)


def test_without_cpu_times_nothing_is_waited_for_and_the_result_says_so() -> None:
    def unreadable() -> CpuTimes:
        raise OSError("no /proc")

    waited = wait_quiet(sample=unreadable, sleep=lambda s: pytest.fail("slept"))
    assert not waited.measured and not waited.quiet and waited.waited_s == 0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_a_process_spinning_on_a_core_keeps_the_machine_from_being_quiet() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        waited = wait_quiet(limit_s=0.6, window_s=0.2, busy_cores=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert not waited.quiet
    assert waited.busy_cores > 0.5
