"""Real supervisord with configs/supervisord.conf: the four services come up in any order and
serve; the worker is killed, supervisord restarts it, and the server serves again."""

from __future__ import annotations

import contextlib
import getpass
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from himamba.bench.servers import ServerProcess, instance_endpoints
from himamba.common.messages import CacheStats

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("worker", "cache", "scheduler", "tokenizer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Supervised:
    proc: subprocess.Popen[bytes]
    conf: Path
    port: int
    log_dir: Path
    env: dict[str, str]
    endpoints: dict[str, str]
    venv: Path

    def ctl(self, *args: str) -> str:
        cmd = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.conf), *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=30).stdout

    def pid(self, name: str) -> int:
        return int(self.ctl("pid", f"himamba:{name}").strip() or 0)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def complete(self, prompt: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, data
        return json.loads(data)

    def try_complete(self, prompt: str, max_tokens: int) -> object:
        """The HTTP status of one completion, or "dropped" when the connection broke."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=170)
        try:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
        except (OSError, http.client.HTTPException):
            return "dropped"
        finally:
            conn.close()
        if resp.status == 200:
            assert data["usage"]["completion_tokens"] == max_tokens, data
        return resp.status

    def cache_stats(self) -> CacheStats:
        """The cache controller's pool occupancy, with an invariant check."""
        return ServerProcess(None, self.endpoints, self.log_dir / "none.log").cache_stats(check_invariants=True)  # type: ignore[arg-type]

    def wait_serving(self, prompt: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.complete(prompt)
            except (OSError, AssertionError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    logs = "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in SERVICES)
                    raise AssertionError(f"not serving after {timeout_s}s\n{self.ctl('status')}\n{logs}") from None
                time.sleep(0.5)


def venv_prefix(tmp: Path, force_new: bool = False) -> Path:
    """A virtualenv with himamba installed: the one these tests run in, or (when they run in a
    system Python, or `force_new`) a new one made in `tmp` that installs this checkout."""
    if sys.prefix != sys.base_prefix and not force_new:
        return Path(sys.prefix)
    venv = tmp / "venv"
    # --system-site-packages: the dependencies are those of this interpreter (no download).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
        check=True, timeout=600, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )  # fmt: skip
    return venv


def _template(tmp: Path, config_path: Path, venv: Path) -> Path:
    """configs/supervisord.conf substituted as its comments and docs/operations/supervisors.md say: this virtualenv
    for /opt/himamba/venv, this user for `himamba`, and the directories moved into `tmp`; the
    worker left for the test to start last (everything else as shipped)."""
    text = (ROOT / "configs" / "supervisord.conf").read_text()
    head, sep, rest = text.partition("[program:worker]\n")
    assert sep and "autostart=true\n" in rest
    text = head + sep + rest.replace("autostart=true\n", "autostart=false\n", 1)
    assert text.count("command=/opt/himamba/venv/bin/himamba service ") == 4 and text.count("user=himamba\n") == 4
    text = text.replace("/opt/himamba/venv", str(venv)).replace("user=himamba\n", f"user={getpass.getuser()}\n")
    text = text.replace("/etc/himamba/himamba.toml", str(config_path))
    for d, name in (("/run/himamba", "run"), ("/var/log/himamba", "log"), ("/var/lib/himamba", "home"),
                    ("/var/cache/himamba", "cache")):  # fmt: skip
        text = text.replace(d, f"{tmp}/{name}")
        (tmp / name).mkdir(mode=0o700)
    settings = "\n".join(line for line in text.splitlines() if not line.startswith(";"))
    assert "/etc/" not in settings and "/var/" not in settings and "/opt/" not in settings
    conf = tmp / "supervisord.conf"
    conf.write_text(text)
    return conf


@contextlib.contextmanager
def _supervisord(tmp: Path, extra_toml: str = "") -> Iterator[Supervised]:
    """supervisord running the shipped config on a tiny model in `tmp` (the worker not started);
    `extra_toml` is appended to the server's config file."""
    from himamba.services.modelgen.checkpoint import make_checkpoint

    model = make_checkpoint("nemotron_h", tmp / "model", preset="tiny", seed=0)
    tag = uuid.uuid4().hex[:12]
    port = _free_port()
    # The services find each other in the instance's private directory under RUNTIME_DIRECTORY,
    # which the shipped config sets (here: tmp/run).
    endpoint_map = instance_endpoints(f"t-{tag}", str(tmp / "run"))
    endpoints = f'instance = "t-{tag}"'
    config_path = tmp / "himamba.toml"
    config_path.write_text(
        f'[model]\nmodel = "{model}"\ntorch_threads = 1\n\n[endpoints]\n{endpoints}\n\n'
        f"[http]\nport = {port}\n\n[metrics]\nreport_interval_s = 0.5\n{extra_toml}"
    )
    venv = venv_prefix(tmp)
    conf = _template(tmp, config_path, venv)
    # The venv is not on PATH (the usual case): the shipped config names its himamba by path.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(venv)))
    assert str(venv / "bin") not in path.split(os.pathsep)
    env = dict(os.environ, PATH=path)
    env.pop("VIRTUAL_ENV", None)
    cmd = [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(conf)]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sv = Supervised(proc, conf, port, tmp / "log", env, endpoint_map, venv)
    try:
        yield sv
    finally:
        proc.send_signal(signal.SIGTERM)  # supervisord stops every program (stopsignal, stopwaitsecs)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    with _supervisord(tmp_path_factory.mktemp("sv")) as sv:
        yield sv


def _wait_log(sv: Supervised, name: str, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in sv.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{sv.log(name)[-2000:]}"
        time.sleep(0.2)


def test_services_wait_for_a_late_worker_then_serve_and_survive_its_kill(supervised: Supervised):
    # The worker starts last: the others come up, wait for it and say so.
    _wait_log(supervised, "tokenizer", "waiting for worker")
    _wait_log(supervised, "cache", "waiting for the worker")
    assert supervised.pid("worker") == 0
    supervised.ctl("start", "himamba:worker")
    first = supervised.wait_serving("def first(x):", timeout_s=180)
    assert first["choices"][0]["finish_reason"] == "length"
    assert "dtype float32 (--dtype auto on cpu" in supervised.log("worker")  # what auto came to, said once
    for name in SERVICES:
        assert supervised.pid(name) > 0, supervised.ctl("status")
        # Started from the virtualenv (its interpreter runs the console script), not from PATH.
        argv = Path(f"/proc/{supervised.pid(name)}/cmdline").read_bytes().split(b"\0")
        venv = str(supervised.venv)
        assert argv[0].decode().startswith(venv) and argv[1].decode() == f"{venv}/bin/himamba", argv

    old = supervised.pid("worker")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (new := supervised.pid("worker")) in (0, old):
        assert time.monotonic() < deadline, "supervisord did not restart the worker"
        time.sleep(0.2)
    again = supervised.wait_serving("def second(y):", timeout_s=120)
    assert again["usage"]["completion_tokens"] == 3
    assert supervised.log("worker").count("ready") >= 2
    assert new != old
    # The same answer as before the kill, and nothing the dead worker's copies pinned is still held.
    assert supervised.complete("def first(x):")["choices"][0]["text"] == first["choices"][0]["text"]
    deadline = time.monotonic() + 30  # storage backups pin host pages until they are written
    while (stats := supervised.cache_stats()).host_pages_protected or stats.host_states_protected:
        assert time.monotonic() < deadline, f"host pins leaked: {stats}"
        time.sleep(0.5)
    assert stats.invariants_ok, stats.invariants_error


# What a request running through the kill gets: the cache controller's restart is invisible
# (the request is requeued and recomputed); a scheduler restart fails a request that already has
# output with a retryable 503 (one without output is sent again); a dead front door drops the
# connection.
OUTCOMES = {"cache": {200}, "scheduler": {200, 503}, "tokenizer": {"dropped"}}


@pytest.mark.parametrize("victim", ["cache", "scheduler", "tokenizer"])
def test_any_killed_service_comes_back_and_serving_resumes(supervised: Supervised, victim: str):
    """kill -9 of one service while a request runs: supervisord restarts it, the others notice,
    the running request ends as it should, the server answers again with the same greedy tokens,
    and nothing stays allocated."""
    before = supervised.wait_serving("def again(z):", timeout_s=120)
    outcome: list[object] = []
    # Long enough to be still running when the kill comes, whatever the machine's speed.
    running = threading.Thread(target=lambda: outcome.append(supervised.try_complete("def long(w):", 2000)))
    running.start()
    time.sleep(1.0)
    old = supervised.pid(victim)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while supervised.pid(victim) in (0, old):
        assert time.monotonic() < deadline, f"supervisord did not restart the {victim}"
        time.sleep(0.2)
    running.join(timeout=180)
    assert not running.is_alive(), "the request running through the kill never ended"
    assert outcome[0] in OUTCOMES[victim], outcome
    after = supervised.wait_serving("def again(z):", timeout_s=120)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 60
    while (stats := supervised.cache_stats()).running_requests:
        assert time.monotonic() < deadline, f"requests still hold memory: {stats}"
        time.sleep(0.5)
    assert stats.invariants_ok, stats.invariants_error
    assert stats.free_pages + stats.cached_pages == stats.total_pages, stats
    assert stats.free_slots + stats.cached_slots == stats.total_slots, stats


def test_a_constrained_request_survives_a_worker_restart(supervised: Supervised):
    """kill -9 of the worker while a request constrained by a regex runs: the request is requeued,
    the new worker rebuilds its matcher from the tokens so far, and the output still matches."""
    supervised.wait_serving("def again(z):", timeout_s=120)
    pattern = "[0-9]{1500}"  # 750 to 1500 tokens of the demo vocabulary
    outcome: list[dict] = []
    first_token = threading.Event()

    def run() -> None:
        # Streamed, so that the kill lands once the request is under way (its first tokens are out)
        # and long before it ends, however fast the worker decodes.
        conn = http.client.HTTPConnection("127.0.0.1", supervised.port, timeout=170)
        try:
            body = {"prompt": "digits:", "max_tokens": 2000, "temperature": 0, "guided_regex": pattern, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text, reason = [], None
            for line in resp:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                (choice,) = json.loads(line[6:])["choices"]
                text.append(choice["text"])
                reason = choice.get("finish_reason") or reason
                first_token.set()
            outcome.append({"status": resp.status, "text": "".join(text), "finish_reason": reason})
        finally:
            first_token.set()
            conn.close()

    running = threading.Thread(target=run)
    running.start()
    assert first_token.wait(timeout=120), "no token streamed"
    old = supervised.pid("worker")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while supervised.pid("worker") in (0, old):
        assert time.monotonic() < deadline, "supervisord did not restart the worker"
        time.sleep(0.2)
    running.join(timeout=180)
    assert not running.is_alive(), "the request running through the kill never ended"
    (got,) = outcome
    assert got["status"] == 200, got
    assert re.fullmatch(pattern, got["text"]) and got["finish_reason"] == "stop", got
    assert "grammar matcher" in supervised.log("worker")  # rebuilt from the tokens so far


def test_sigterm_stops_every_service_cleanly(supervised: Supervised):
    pids = {name: supervised.pid(name) for name in SERVICES}
    supervised.ctl("stop", "himamba:*")
    status = supervised.ctl("status")
    for name, pid in pids.items():
        assert f"himamba:{name}" in status and "STOPPED" in status.split(f"himamba:{name}")[1].splitlines()[0]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Each exited by itself on SIGTERM, within stopwaitsecs (no SIGKILL from supervisord).
    log = supervised.log_dir.joinpath("supervisord.log").read_text()
    stops = [line for line in log.splitlines() if "stopped:" in line or "waiting for" in line]
    for name in SERVICES:
        assert f"stopped: {name} (exit status 0)" in log, stops


def test_a_worker_killed_during_a_copy_is_restarted_and_nothing_leaks(tmp_path: Path):
    """The worker dies in the middle of its first copy order (KV copied, state not; the batch's
    other orders unacknowledged): supervisord restarts it, the restarted worker does not die again
    (the hook fires once per instance), the same prompt gets transformers' greedy tokens, no host
    pin is left, the pools are whole and the invariants hold."""
    from himamba.common.client import Client
    from tests.worker.hf_reference import greedy, load_reference

    with _supervisord(tmp_path, "\n[debug]\nworker_exit_at_transfer = 1\n") as sv:
        _wait_log(sv, "cache", "waiting for the worker")
        sv.ctl("start", "himamba:worker")
        deadline = time.monotonic() + 180
        while (first := sv.pid("worker")) == 0 or "ready" not in sv.log("worker"):
            assert time.monotonic() < deadline, sv.ctl("status")
            time.sleep(0.2)
        ids = list(range(5, 45))  # 40 tokens: two pages go to host at the first decode step
        want = greedy(load_reference(tmp_path / "model"), ids, 8)
        outcome: list[object] = []

        def ask() -> None:
            try:
                with Client(sv.endpoints["zmq_endpoint"], timeout_s=170) as c:
                    outcome.append(c.generate(input_ids=ids, max_tokens=8, ignore_eos=True).token_ids)
            except Exception as e:  # noqa: BLE001 - whatever the request in flight gets, it must end
                outcome.append(e)

        running = threading.Thread(target=ask)
        running.start()
        deadline = time.monotonic() + 60
        while sv.pid("worker") in (0, first):
            assert time.monotonic() < deadline, f"the worker never died at its copy: {sv.ctl('status')}"
            time.sleep(0.2)
        running.join(timeout=180)
        assert not running.is_alive(), "the request in flight at the worker's death never ended"
        assert "exit status 70" in sv.log_dir.joinpath("supervisord.log").read_text()
        marker = Path(sv.endpoints["worker_ipc"].removeprefix("ipc://")).parent / "debug-worker-exit.fired"
        assert marker.exists()
        _wait_log(sv, "worker", "not again")  # the restarted worker's hook is spent
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(sv.endpoints["zmq_endpoint"], timeout_s=60) as c:
                    got = [c.generate(input_ids=ids, max_tokens=8, ignore_eos=True).token_ids for _ in range(2)]
                break
            except Exception:  # noqa: BLE001 - until the restarted worker serves
                assert time.monotonic() < deadline, sv.ctl("status")
                time.sleep(0.5)
        assert got == [want, want]  # computed, then from the cache the restarted worker filled
        if isinstance(outcome[0], list):
            assert outcome[0] == want, "the request in flight got a wrong answer"
        deadline = time.monotonic() + 60  # storage backups pin host pages until they are written
        while (stats := sv.cache_stats()).host_pages_protected or stats.host_states_protected or stats.running_requests:
            assert time.monotonic() < deadline, f"host pins leaked: {stats}"
            time.sleep(0.5)
        assert stats.invariants_ok, stats.invariants_error
        assert stats.free_pages + stats.cached_pages == stats.total_pages, stats
        assert stats.free_slots + stats.cached_slots == stats.total_slots, stats
        assert sv.pid("worker") > 0
