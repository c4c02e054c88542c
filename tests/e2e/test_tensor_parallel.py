"""`himamba serve --tensor-parallel-size 2` on the CPU (gloo): transformers' greedy tokens for the three
sharded families, through device- and host-tier prefix hits, and from the storage tier after a restart on
the same store; a rank that dies stops the server with one line, leaving no rank running and no shared
memory behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from himamba.bench.servers import start_server
from himamba.common.client import Client
from himamba.common.types import GrammarSpec
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.e2e.prompts import random_tokens
from tests.e2e.storage_flags import STORAGE_FLAGS
from tests.worker.hf_reference import greedy, load_reference

# The GPU check (scripts/gpu/check.sh, step tp) runs this module on CUDA: NCCL, one GPU per rank.
DEVICE = ("--device", os.environ["HIMAMBA_TEST_DEVICE"]) if os.environ.get("HIMAMBA_TEST_DEVICE") else ()
TP = ("--tensor-parallel-size", "2", "--hicache-storage-backend", "none", *DEVICE)
# Small device pools, so that a conversation is pushed out to the host pools and comes back from there.
POOLS = (
    "--max-total-tokens", "512", "--max-context-len", "512", "--max-mamba-cache-size", "12",
    "--hicache-tokens", "8192", "--hicache-mamba-slots", "32", "--max-running-requests", "2",
    "--mamba-track-interval", "16",
)  # fmt: skip


# granite_hybrid's tiny preset has one Mamba2 group: its B and C are replicated on both ranks.
@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next", "granite_hybrid"])
def served(request, tmp_path_factory):
    model_dir = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), preset="tiny")
    server = start_server(model_dir, tmp_path_factory.mktemp("logs"), *TP, *POOLS)
    yield server, load_reference(model_dir)
    server.stop()


def test_device_and_host_hits_equal_transformers(served):
    server, ref = served
    assert "tensor parallel rank 0 of 2" in server.log()
    with Client(server.endpoint) as c:
        history = random_tokens(50, 1, vocab=2000)  # crosses page boundaries (16 tokens a page)
        first = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert first.token_ids == greedy(ref, history, 10)
        again = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert again.token_ids == first.token_ids  # a device-tier hit computes what recompute did
        assert again.usage.cached_tokens.device > 0
        history = history + first.token_ids + random_tokens(30, 2, vocab=2000)
        second = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert second.token_ids == greedy(ref, history, 10)
        assert second.usage.cached_tokens.device > 0
        for k in range(3):  # push the conversation out of the small device pool
            c.generate(input_ids=random_tokens(150, 10 + k, vocab=2000), max_tokens=2, ignore_eos=True)
        history = history + second.token_ids + random_tokens(20, 3, vocab=2000)
        third = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert third.token_ids == greedy(ref, history, 10)
        assert third.usage.cached_tokens.host > 0  # each rank copied its shard back from its own host pool
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


def test_structured_output_is_rank_0s_alone_and_the_ranks_stay_in_step(served):
    server, ref = served
    with Client(server.endpoint) as c:
        out = c.generate("answer: ", max_tokens=20, grammar=GrammarSpec(kind="choice", spec='["yes", "no"]'))
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        ids = random_tokens(20, 5, vocab=2000)
        assert c.generate(input_ids=ids, max_tokens=4, ignore_eos=True).token_ids == greedy(ref, ids, 4)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_dead_rank_stops_the_server(tmp_path):
    model_dir = make_checkpoint("nemotron_h", tmp_path / "m", preset="tiny")
    server = start_server(model_dir, tmp_path / "logs", *TP)
    try:
        with Client(server.endpoint) as c:
            c.generate(input_ids=random_tokens(20, 1, vocab=2000), max_tokens=2, ignore_eos=True)
        children = _children(server.proc.pid)
        rank1 = int(re.search(r"started worker-rank1 \(pid (\d+)\)", server.log()).group(1))
        assert rank1 in children
        os.kill(rank1, signal.SIGKILL)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert code == 1
    log = server.log()
    assert f"service worker-rank1 (pid {rank1}) died with exit code -9; stopping the server" in log
    assert log.count("stopping the server") == 1, log[-3000:]
    assert "did not stop in time" not in log, log[-3000:]
    alive = [p for p in children if _running(p)]
    assert not alive, alive
    shm = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"himamba-{p}-") for p in children)]
    assert not shm, shm


def _stored_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*.seg"))


def test_a_restart_on_the_same_store_gives_storage_hits(tmp_path):
    """Each page is stored as one blob holding both ranks' shards, under a key of the TP size: a TP=2
    server finds what a TP=2 server stored."""
    model_dir = make_checkpoint("nemotron_h", tmp_path / "m", preset="tiny")
    ref = load_reference(model_dir)
    store = tmp_path / "store"
    flags = ("--tensor-parallel-size", "2", *DEVICE, *STORAGE_FLAGS, "--hicache-storage-dir", str(store))
    server = start_server(model_dir, tmp_path / "logs", *flags)
    history: list[int] = []
    try:
        with Client(server.endpoint) as c:
            for turn, new in enumerate((40, 60)):
                history = history + random_tokens(new, turn, vocab=2000)
                out = c.generate(input_ids=history, max_tokens=8, ignore_eos=True)
                assert out.token_ids == greedy(ref, history, 8)
                history = history + out.token_ids
        last, deadline = -1, time.monotonic() + 10
        while time.monotonic() < deadline and (_stored_bytes(store) != last or last == 0):
            last = _stored_bytes(store)
            time.sleep(0.5)
    finally:
        server.stop()
    assert _stored_bytes(store) > 0
    server = start_server(model_dir, tmp_path / "logs", *flags)
    try:
        nxt = history + random_tokens(20, 7, vocab=2000)
        with Client(server.endpoint) as c:
            out = c.generate(input_ids=nxt, max_tokens=8, ignore_eos=True)
        assert out.usage is not None and out.usage.cached_tokens.storage >= 96, out.usage
        assert out.token_ids == greedy(ref, nxt, 8)
        stats = server.cache_stats()
        assert stats.invariants_ok, stats.invariants_error
    finally:
        server.stop()
