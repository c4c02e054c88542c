"""Process faults under `himamba serve`: `kill -9` of any one service, while a request streams,
takes the whole server down cleanly: a non-zero exit within ~5 s, a log line naming the dead
service, and no service process left behind. (Under supervisord the dead service is restarted
instead: tests/ops/test_supervisord.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from himamba.common.client import Client, HimambaError

SERVICES = ("tokenizer", "scheduler", "worker", "cache")


def _children(launcher_pid: int) -> dict[str, int]:
    """name -> pid of the services a launcher started (from their command lines)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True, check=False)
    found = {}
    for line in out.stdout.splitlines():
        pid, args = line.strip().split(" ", 1)
        parts = args.split()
        if "service" in parts:
            found[parts[parts.index("service") + 1]] = int(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"  # a zombie is gone
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.parametrize("victim", SERVICES)
def test_kill_9_of_a_service_stops_the_server_naming_it(expendable, victim):
    server = expendable[victim]
    kids = _children(server.proc.pid)
    assert set(kids) == set(SERVICES), kids
    outcome: list[BaseException | int] = []

    def stream() -> None:  # a request in flight when the service dies
        try:
            with Client(server.endpoint, timeout_s=3) as c:
                outcome.append(len(list(c.stream(input_ids=[3, 4, 5], max_tokens=1000, ignore_eos=True))))
        except (HimambaError, TimeoutError) as e:
            outcome.append(e)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    time.sleep(0.5)
    os.kill(kids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    code = server.proc.wait(timeout=30)
    took = time.monotonic() - t0
    assert code != 0, server.log()[-2000:]
    # The launcher gives the survivors a 4 s grace before it kills them; slack for a loaded CI.
    assert took < 7, f"the server took {took:.1f}s to go down"
    assert f"service {victim}" in server.log() and "died" in server.log(), server.log()[-2000:]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in kids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in kids.items() if _alive(p)], "services left behind"
    t.join(timeout=10)
    assert outcome and not isinstance(outcome[0], int), f"the stream finished normally: {outcome}"
