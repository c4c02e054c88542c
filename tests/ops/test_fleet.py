"""A fleet as the docs page docs/operations/fleet.md ("A fleet behind sglang's router") writes it, run as written: its
fenced `fleet.sh` block with this test's checkpoint, secrets, data directory and free ports
substituted (as the page says; its router flags for health checks, circuit breakers and retries
included), and small pools. Redis (one shared L3, with a password), two himamba servers with an
API key, the real sglang-router 0.3.2 with `cache_aware`, and Prometheus.

Then: the router discovers the model; `cache_aware` keeps each conversation on the server that
holds its prefix (later turns are *device* hits there: a shared L3 alone would only give storage
hits); sglang's native /generate works through the router; Prometheus scrapes every server and
the router; /flush_cache empties one server's device and host tiers; a server killed mid-traffic
(a request and streams running on it) is routed around: every request started after the kill is
served (0 errors), and the streams on it end, cut short, without hanging. Every process is
stopped by its PID (its process group).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.http_request import free_port, http_request
from tests.system_packages import PROMETHEUS, REDIS, requires

ROOT = Path(__file__).resolve().parents[2]
KEY = "fleet-test-key-8d1f"
REDIS_PASSWORD = "fleet-redis-pw-51c0"
FLEET_PAGE = "docs/operations/fleet.md"
PORTS = (30000, 30001, 30002, 29000, 9090, 6379)  # the page's ports, replaced by free ones
# Test-only additions: small pools and one torch thread per server (2 shared cores); the router
# registers the servers sooner and logs only warnings. Its health checks and retries are the page's.
SERVER_FLAGS = ("--torch-threads", "1", "--max-total-tokens", "4096", "--max-mamba-cache-size", "32",
                "--hicache-tokens", "8192", "--hicache-mamba-slots", "64", "--report-interval-s", "0.5")  # fmt: skip
ROUTER_FLAGS = ("--worker-startup-check-interval", "1", "--log-level", "warn")

pytestmark = requires(REDIS, PROMETHEUS)


def fleet_page_block() -> list[str]:
    """The commands of the fleet page's `fleet.sh` block, `\\` continuations joined."""
    text = (ROOT / FLEET_PAGE).read_text()
    m = re.search(r'^```bash title="fleet.sh"\n(.*?)^```', text, re.MULTILINE | re.DOTALL)
    assert m, f'{FLEET_PAGE} has no ```bash title="fleet.sh" block'
    lines = m.group(1).replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip()]


@dataclass
class Fleet:
    tmp: Path
    env: dict[str, str]
    ports: dict[int, int]  # the page's port -> the port used here
    model_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def port(self, page_port: int) -> int:
        return self.ports[page_port]

    @property
    def servers(self) -> list[int]:
        return [self.port(30001), self.port(30002)]

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def request(self, port: int, method: str, path: str, body: Any = None, key: str | None = KEY) -> Any:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        return http_request(port, method, path, data, headers, timeout_s=120)

    def ok(self, port: int, method: str, path: str, body: Any = None) -> Any:
        r = self.request(port, method, path, body)
        assert r.status == 200, (port, path, r.status, r.body[:500])
        return r.json()

    def metric(self, port: int, name: str, **labels: str) -> float:
        """The sum of `name`'s samples with these labels on a server's /metrics."""
        text = self.request(port, "GET", "/metrics", key=None).body.decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _substitute(line: str, fleet: Fleet) -> str:
    for page_port, port in fleet.ports.items():
        line = re.sub(rf"(?<![\d.]){page_port}(?!\d)", str(port), line)
    line = line.replace("grafana/prometheus-fleet.yaml", str(fleet.tmp / "prometheus-fleet.yaml"))
    return line.replace("/var/lib/himamba-prometheus", str(fleet.tmp / "prometheus-data"))


def _wait(what: str, ok: Any, timeout_s: float, fleet: Fleet, logs: tuple[str, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = ok()
        except (OSError, AssertionError, ValueError):
            got = None
        if got:
            return got
        for name, proc in fleet.procs.items():
            assert proc.poll() is None or name.startswith("killed"), f"{name} exited:\n{fleet.log(name)}"
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{fleet.log(n)}" for n in logs)
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{tails}")
        time.sleep(0.25)


def _health(port: int) -> bool:
    return http_request(port, "GET", "/health", timeout_s=5).status == 200


def _run_block(fleet: Fleet) -> None:
    """Each line of the block as the page says: exports set the environment (ours substituted),
    `&` lines start in the background, and "# once every server answers /health" waits."""
    servers = 0
    for line in fleet_page_block():
        if line.startswith("#"):
            if "once every server answers /health" in line:
                for port in fleet.servers[:servers]:
                    _wait(f"server {port} healthy", lambda p=port: _health(p), 240, fleet, ("server-0", "server-1"))
            continue
        line = _substitute(line, fleet)
        if line.startswith("export "):
            name = line.split()[1].split("=", 1)[0]
            assert name in fleet.env, f"the fleet page exports {name}, which this test does not substitute"
            continue
        assert line.endswith("&"), f"every command of the block runs in the background: {line}"
        expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: fleet.env[m.group(1)], line[:-1])  # as the shell would
        argv = shlex.split(expanded)
        if argv[0] == "himamba":
            name = f"server-{servers}"
            servers += 1
            argv += SERVER_FLAGS
        elif argv[:3] == ["python", "-m", "sglang_router.launch_router"]:
            name = "router"
            argv[0] = sys.executable
            argv += ROUTER_FLAGS
        else:
            name = Path(argv[0]).name
        with open(fleet.tmp / f"{name}.log", "wb") as log:
            fleet.procs[name] = subprocess.Popen(
                argv, env=fleet.env, stdout=log, stderr=subprocess.STDOUT, cwd=fleet.tmp, start_new_session=True
            )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from himamba.services.modelgen.checkpoint import make_checkpoint

    tmp = tmp_path_factory.mktemp("fleet")
    model_dir = make_checkpoint("nemotron_h", tmp / "nemotron-h-tiny", preset="tiny", seed=0)
    (tmp / "run").mkdir(mode=0o700)
    env = dict(
        os.environ,
        MODEL=str(model_dir), HIMAMBA_API_KEY=KEY, REDIS_PASSWORD=REDIS_PASSWORD,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # this venv's himamba
        XDG_RUNTIME_DIR=str(tmp / "run"), PYTHONSAFEPATH="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    env.pop("RUNTIME_DIRECTORY", None)
    ports = {p: free_port() for p in PORTS}
    f = Fleet(tmp, env, ports, model_dir)
    config = (ROOT / "grafana" / "prometheus-fleet.yaml").read_text()
    (tmp / "prometheus-fleet.yaml").write_text(_substitute(config, f))
    try:
        _run_block(f)
        # The router registers both servers (health, /server_info, /model_info), then serves.
        _wait(
            "the router lists the model", lambda: f.ok(f.port(30000), "GET", "/v1/models")["data"], 60, f, ("router",)
        )
        yield f
    finally:
        for proc in reversed(list(f.procs.values())):
            _stop(proc)


def _router_sees_down(fleet: Fleet, server_port: int) -> bool:
    """The router's own metrics (`smg_worker_health`) hold the server's URL at 0."""
    text = fleet.request(fleet.port(29000), "GET", "/metrics", key=None).body.decode()
    url = f"127.0.0.1:{server_port}"
    return any(
        line.startswith("smg_worker_health") and url in line and float(line.rsplit(" ", 1)[1]) == 0
        for line in text.splitlines()
    )


def _chat(fleet: Fleet, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": fleet.model_dir.name, "messages": messages, "max_tokens": 8, "temperature": 0}
    return fleet.ok(fleet.port(30000), "POST", "/v1/chat/completions", body)


def _served_chats(fleet: Fleet) -> list[float]:
    return [
        fleet.metric(p, "himamba_http_responses_total", route="chat_completions", status="2xx") for p in fleet.servers
    ]


def _turn(fleet: Fleet, conv: list[dict[str, str]], text: str) -> tuple[dict[str, Any], int]:
    """One turn through the router: the answer and which server (0 or 1) served it."""
    before = _served_chats(fleet)
    conv.append({"role": "user", "content": text})
    out = _chat(fleet, conv)
    conv.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    after = _wait("the serving server's count", lambda: (a := _served_chats(fleet)) != before and a, 10, fleet)
    moved = [i for i in range(2) if after[i] != before[i]]
    assert len(moved) == 1, (before, after)
    return out, moved[0]


STORY = ("Tell me a long story about a lighthouse keeper on a rocky island, the storms of the northern sea, "
         "the ships that pass at night and the letters she writes to her brother in the city.")  # fmt: skip
# Two conversations that share no prefix: cache_aware places a new one on the least loaded cache.
OPENINGS = (STORY, ("Explain, step by step and with worked examples, how a compiler turns source code into "
            "machine instructions: lexing, parsing, type checking, optimisation passes and register allocation."))  # fmt: skip


@dataclass
class Conversations:
    convs: list[list[dict[str, str]]]
    home: list[int]  # the server (0 or 1) of each conversation


class _StreamedChat:
    """A chat turn streamed through the router, held open after its first event: while it runs,
    its server has one request in flight, so cache_aware places a new conversation elsewhere."""

    def __init__(self, fleet: Fleet, conv: list[dict[str, str]], text: str):
        conv.append({"role": "user", "content": text})
        self.conv = conv
        body = {"model": fleet.model_dir.name, "messages": conv, "max_tokens": 160, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        self.conn = http.client.HTTPConnection("127.0.0.1", fleet.port(30000), timeout=120)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.text = ""
        while not self.text:
            line = self.resp.readline()
            assert line, "the stream ended before its first token"
            self._take(line)

    def _take(self, line: bytes) -> None:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[len(b"data: ") :])["choices"]:
                self.text += choice["delta"].get("content") or ""

    def finish(self) -> None:
        for line in self.resp.read().splitlines():
            self._take(line)
        self.conn.close()
        self.conv.append({"role": "assistant", "content": self.text})


@pytest.fixture(scope="module")
def conversations(fleet: Fleet) -> Conversations:
    convs: list[list[dict[str, str]]] = [[], []]
    before = _served_chats(fleet)
    first = _StreamedChat(fleet, convs[0], OPENINGS[0])
    convs[1].append({"role": "user", "content": OPENINGS[1]})
    convs[1].append({"role": "assistant", "content": _chat(fleet, convs[1])["choices"][0]["message"]["content"]})
    first.finish()

    def both_counted() -> list[float] | None:
        now = _served_chats(fleet)
        return now if sum(now) == sum(before) + 2 else None

    after = _wait("both first turns counted", both_counted, 10, fleet)
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1], "one new conversation per server"
    homes: list[list[int]] = [[], []]
    for turn in (2, 3):
        for c in range(2):
            out, server = _turn(fleet, convs[c], f"And then, part {turn}?")
            homes[c].append(server)
            # The prefix (earlier turns and their answers) is on this server's device tier: the
            # router sent the turn where the conversation lives.
            assert out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["device"] >= 32, (c, out["usage"])
    assert all(len(set(h)) == 1 for h in homes), f"cache_aware moved a conversation between servers: {homes}"
    assert homes[0][0] != homes[1][0], f"both conversations on one server: {homes}"
    return Conversations(convs, [h[0] for h in homes])


def test_the_router_discovers_the_model_and_needs_the_key(fleet: Fleet):
    router = fleet.port(30000)
    assert [m["id"] for m in fleet.ok(router, "GET", "/v1/models")["data"]] == [fleet.model_dir.name]
    body = {"model": fleet.model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert fleet.request(router, "POST", "/v1/chat/completions", body, key=None).status == 401
    for port in fleet.servers:
        info = fleet.ok(port, "GET", "/server_info")
        assert info["served_model_name"] == fleet.model_dir.name and info["model_path"] == str(fleet.model_dir)
        assert info["max_total_tokens"] == 4096 and info["max_mamba_cache_size"] == 32  # the pools as sized
        text = json.dumps(info)
        assert KEY not in text and REDIS_PASSWORD not in text  # no secret, yet the store is named
        assert info["config"]["cache"]["hicache_storage_url"].startswith("redis://:<redacted>@127.0.0.1:")
        assert fleet.ok(port, "GET", "/model_info")["architectures"] == ["NemotronHForCausalLM"]
        for method, path in (("GET", "/server_info"), ("POST", "/generate"), ("POST", "/flush_cache")):
            assert fleet.request(port, method, path, {"text": "x"}, key=None).status == 401
        assert fleet.request(port, "GET", "/metrics", key=None).status == 200
        assert fleet.request(port, "GET", "/health", key=None).status == 200
        assert fleet.ok(port, "GET", "/health_generate") == {"status": "ok"}


def test_cache_aware_keeps_each_conversation_on_the_server_that_holds_it(conversations: Conversations):
    # Asserted while the conversations ran (fixture): later turns were device hits, each
    # conversation on its own server throughout.
    assert sorted(conversations.home) == [0, 1]


def test_sglang_native_generate_through_the_router(fleet: Fleet, conversations: Conversations):
    router = fleet.port(30000)
    body = {"text": STORY, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = fleet.ok(router, "POST", "/generate", body)
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    again = fleet.ok(router, "POST", "/generate", body)
    assert again["text"] == out["text"] and again["meta_info"]["cached_tokens_by_tier"]["device"] > 0
    r = urllib.request.Request(
        f"http://127.0.0.1:{router}/generate", json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(r, timeout=120) as resp:
        events = [e[len("data: ") :] for e in resp.read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == out["text"]  # cumulative, as sglang's


def test_prometheus_scrapes_every_server_and_the_router(fleet: Fleet):
    url = f"http://127.0.0.1:{fleet.port(9090)}/api/v1/targets"

    def all_up() -> list[dict[str, Any]] | None:
        with urllib.request.urlopen(url, timeout=5) as resp:
            targets = json.loads(resp.read())["data"]["activeTargets"]
        return targets if len(targets) == 3 and all(t["health"] == "up" for t in targets) else None

    targets = _wait("every target up in Prometheus", all_up, 60, fleet, ("prometheus",))
    assert {t["labels"]["job"] for t in targets} == {"himamba", "sglang-router"}


def _process_group(pgid: int) -> list[int]:
    """The pids of a process group (the server's launcher and its four services)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _remove_shared_memory(pids: list[int]) -> None:
    """A SIGKILLed worker cannot unlink its host pools' segments (named after its pid): do it."""
    for pid in pids:
        for seg in Path("/dev/shm").glob(f"himamba-{pid}-*"):
            seg.unlink(missing_ok=True)


def _pool_bytes(fleet: Fleet, port: int, tier: str) -> float:
    return fleet.metric(port, "himamba_pool_used_bytes", tier=tier)


def test_flush_cache_empties_one_servers_device_and_host_tiers(fleet: Fleet, conversations: Conversations):
    home = conversations.home[0]
    port, other = fleet.servers[home], fleet.servers[1 - home]
    assert _pool_bytes(fleet, port, "device") > 0 and _pool_bytes(fleet, port, "host") > 0
    out = fleet.ok(port, "POST", "/flush_cache")
    assert out["freed"]["device_pages"] > 0 and out["freed"]["host_pages"] > 0, out
    for tier in ("device", "host"):
        _wait(f"{tier} pools empty after the flush", lambda t=tier: _pool_bytes(fleet, port, t) == 0, 15, fleet)
    assert _pool_bytes(fleet, other, "device") > 0  # the other server keeps its cache
    # The conversation's next turn finds nothing on this server's device or host tier.
    answer, server = _turn(fleet, conversations.convs[0], "Go on, part 4?")
    tiers = answer["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert tiers["device"] == 0 and tiers["host"] == 0, answer["usage"]
    assert server == home  # still the server the router believes holds it


class _CutStream:
    """A chat stream through the router, read to its end in a thread: whether it ended, and how
    (`data: [DONE]`, an error event, or the connection closing)."""

    def __init__(self, fleet: Fleet, messages: list[dict[str, str]]):
        body = {"model": fleet.model_dir.name, "messages": messages, "max_tokens": 2000, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        self.conn = http.client.HTTPConnection("127.0.0.1", fleet.port(30000), timeout=120)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.events = 0
        self.done = False
        self.error = ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while line := self.resp.readline():
                if line.startswith(b"data: [DONE]"):
                    self.done = True
                elif line.startswith(b"data: {"):
                    self.events += 1
                    if b'"error"' in line:
                        self.error = line.decode(errors="replace")[:300]
        except (OSError, http.client.HTTPException) as e:  # the connection cut: an error, not a hang
            self.error = repr(e)
        finally:
            self.conn.close()


KILL_STREAMS = 2
AFTER_KILL = 6  # requests started after the kill, each continuing the dead server's conversation


def test_a_server_killed_mid_traffic_costs_no_request_started_after_it(fleet: Fleet, conversations: Conversations):
    victim_index = conversations.home[1]
    victim = fleet.procs[f"server-{victim_index}"]
    router = fleet.port(30000)
    conv = conversations.convs[1]
    outcome: list[int] = []
    body = {"model": fleet.model_dir.name, "messages": [*conv, {"role": "user", "content": "A long one now."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0}  # fmt: skip

    def running() -> None:
        try:
            outcome.append(fleet.request(router, "POST", "/v1/chat/completions", body).status)
        except OSError:
            outcome.append(-1)

    thread = threading.Thread(target=running)
    thread.start()
    # Streams of the same conversation: cache_aware sends them where it lives, the victim.
    streams = [_CutStream(fleet, [*conv, {"role": "user", "content": f"Stream {i}, a long one."}])
               for i in range(KILL_STREAMS)]  # fmt: skip
    victim_port = fleet.servers[victim_index]
    _wait(
        "the long request and the streams running on the victim",
        lambda: fleet.metric(victim_port, "himamba_scheduler_running_requests") >= 1 + KILL_STREAMS
        and all(st.events > 0 for st in streams),
        60,
        fleet,
    )
    group = _process_group(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole server, as a lost host
    victim.wait()
    _remove_shared_memory(group)
    fleet.procs[f"killed-server-{victim_index}"] = fleet.procs.pop(f"server-{victim_index}")
    # At once, before the router's next health check: every request that starts now is served
    # (the first one's failed attempt opens the dead server's breaker; its retry goes elsewhere).
    survivor = fleet.servers[1 - victim_index]
    statuses = []
    for turn in range(AFTER_KILL):
        r = fleet.request(router, "POST", "/v1/chat/completions", {
            "model": fleet.model_dir.name, "max_tokens": 8, "temperature": 0,
            "messages": [*conv, {"role": "user", "content": f"After the storm, part {turn + 5}?"}],
        })  # fmt: skip
        statuses.append(r.status)
    assert statuses == [200] * AFTER_KILL, f"requests started after the kill failed: {statuses}"
    # The streams that were on the dead server end, cut short (no [DONE]); none hangs.
    for st in streams:
        st.thread.join(timeout=120)
        assert not st.thread.is_alive(), "a stream on the killed server never ended"
        assert st.status == 200 and st.events > 0
        assert not st.done, "a stream on the killed server claims to be complete"
    thread.join(timeout=180)
    assert not thread.is_alive(), "the request running on the killed server never ended"
    assert outcome and outcome[0] in (200, 500, 502, 503, -1), outcome
    _wait("the router marks the killed server unhealthy", lambda: _router_sees_down(fleet, victim_port), 60, fleet,
          ("router",))  # fmt: skip
    # The conversation goes on, on the live server.
    for turn in range(2):
        served = fleet.metric(survivor, "himamba_http_responses_total", route="chat_completions", status="2xx")
        conv.append({"role": "user", "content": f"And later, part {turn + 20}?"})
        out = _chat(fleet, conv)
        conv.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        assert out["usage"]["completion_tokens"] == 8
        assert (
            fleet.metric(survivor, "himamba_http_responses_total", route="chat_completions", status="2xx") == served + 1
        )
