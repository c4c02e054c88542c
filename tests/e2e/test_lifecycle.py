"""Lifecycle of `himamba serve`: clean stop, a dead child takes the server down, bad input is
answered and nothing leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import msgspec
import pytest
import zmq

from himamba.common.client import Client
from himamba.common.messages import ClientReply, ErrorReply


def _children(pid: int) -> dict[str, int]:
    """name -> pid of the services started by a launcher (from their command lines)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid_s, args = line.strip().split(" ", 1)
        parts = args.split()
        if "service" in parts:
            found[parts[parts.index("service") + 1]] = int(pid_s)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_sigterm_leaves_no_child(server_factory, model_dir):
    server = server_factory(model_dir, "--disable-radix-cache")
    kids = _children(server.proc.pid)
    assert set(kids) == {"worker", "cache", "scheduler", "tokenizer"}
    assert server.stop(timeout_s=10) == 0
    assert "killed: none" in server.log()  # every service stopped on its own, none by the launcher's kill
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in kids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in kids.items() if _alive(p)]


def test_killing_the_worker_stops_the_server_naming_it(server_factory, model_dir):
    server = server_factory(model_dir, "--disable-radix-cache")
    kids = _children(server.proc.pid)
    os.kill(kids["worker"], signal.SIGKILL)
    code = server.proc.wait(timeout=15)
    assert code != 0
    assert "service worker" in server.log() and "died" in server.log()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in kids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in kids.items() if _alive(p)]


@pytest.fixture(scope="module")
def plain_server(server_factory, model_dir):
    return server_factory(
        model_dir, "--disable-radix-cache", "--max-total-tokens", "2048", "--max-mamba-cache-size", "16", "--max-context-len", "2048"
    )


def test_malformed_message_gets_an_error_and_server_keeps_serving(plain_server):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(plain_server.endpoint)
    try:
        for payload in [b"\xc1garbage", msgspec.msgpack.encode({"type": "GenerateRequest", "input_ids": "nope"})]:
            sock.send(payload)
            assert sock.poll(10_000), "no reply to a malformed message"
            reply = msgspec.msgpack.decode(sock.recv(), type=ClientReply)
            assert isinstance(reply, ErrorReply) and reply.code == 400 and reply.message
    finally:
        sock.close(0)
    with Client(plain_server.endpoint) as c:
        assert len(c.generate("def f(x):", max_tokens=4, ignore_eos=True).token_ids) == 4


def test_aborted_stream_frees_its_pool_slots(plain_server):
    before = plain_server.cache_stats()
    with Client(plain_server.endpoint) as c:
        stream = c.stream("import os\n" * 20, max_tokens=1000, ignore_eos=True)
        got = 0
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                break  # leaving the stream aborts the request
        stream.close()
        time.sleep(0.5)
        assert len(c.generate("x = 1", max_tokens=2, ignore_eos=True).token_ids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = plain_server.cache_stats()
        if after.running_requests == 0:
            break
        time.sleep(0.2)
    assert (after.free_pages, after.free_slots) == (before.free_pages, before.free_slots)
    assert after.invariants_ok, after.invariants_error
