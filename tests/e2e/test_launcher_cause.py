"""The launcher names the cause of a stop: a fatal error reported while a child is already dying (a worker
rank killed: rank 0's collective fails as the rank's sockets close, before the kernel reports its exit) is
put down to the dead child, which the launcher looks for during CAUSE_GRACE_S."""

from __future__ import annotations

import subprocess
import sys

from himamba.services import launch


def _launcher(children: list[launch.Child]) -> launch.Launcher:
    launcher = object.__new__(launch.Launcher)  # only the supervision state this test drives
    launcher.children = children
    return launcher


def test_a_death_that_shows_late_is_still_found() -> None:
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        launcher = _launcher([launch.Child("worker-rank1", dying)])
        assert launcher._dead_child() is None  # not yet
        found = launcher._dead_child(wait_s=launch.CAUSE_GRACE_S + 5)
        assert found is not None and found.name == "worker-rank1" and found.proc.returncode == 0
    finally:
        dying.kill()
        dying.wait()


def test_without_a_death_the_wait_ends() -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _launcher([launch.Child("cache", alive)])._dead_child(wait_s=0.1) is None
    finally:
        alive.kill()
        alive.wait()
