"""The storage tier on real servers: a conversation survives a restart (storage hits, exactly the
greedy tokens of transformers), a host pool smaller than the stored prefix gets a truncated
prefetch, and flaky / slow / corrupted / read-only storage leaves outputs correct, the server up
and the cache invariants clean."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from himamba.common.client import AsyncClient, Client
from tests.e2e.prompts import random_tokens
from tests.e2e.storage_flags import STORAGE_FLAGS
from tests.worker.hf_reference import greedy

GEN = 8


def _files(store: Path) -> int:
    """Bytes in the store's segment files."""
    return sum(p.stat().st_size for p in store.rglob("*.seg"))


def _settle(store: Path, timeout_s: float = 10.0) -> None:
    """Wait until background backups stop adding bytes."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        n = _files(store)
        if n == last and n > 0:
            return
        last = n
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stored_conversation(server_factory, model_dir, ref, tmp_path_factory):
    """Two turns served and backed up to a fresh store; the server is stopped afterwards."""
    store = tmp_path_factory.mktemp("store")
    s = server_factory(model_dir, *STORAGE_FLAGS, "--hicache-storage-dir", str(store))
    history: list[int] = []
    with Client(s.endpoint) as c:
        for turn, new in enumerate((40, 60)):  # states land at 32, then 96
            history = history + random_tokens(new, turn)
            out = c.generate(input_ids=history, max_tokens=GEN, ignore_eos=True)
            assert out.token_ids == greedy(ref, history, GEN)
            history = history + out.token_ids
    _settle(store)
    st = s.cache_stats(check_invariants=True)
    assert st.invariants_ok, st.invariants_error
    s.stop()
    assert _files(store) > 0
    return store, history


def test_restart_serves_the_next_turn_from_storage_with_the_same_tokens(
    server_factory, model_dir, ref, stored_conversation
):
    store, history = stored_conversation
    s = server_factory(model_dir, *STORAGE_FLAGS, "--hicache-storage-dir", str(store))
    nxt = history + random_tokens(20, 7)
    with Client(s.endpoint) as c:
        out = c.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
    assert out.usage is not None and out.usage.cached_tokens.storage >= 96
    assert out.token_ids == greedy(ref, nxt, GEN)
    st = s.cache_stats(check_invariants=True)
    assert st.invariants_ok, st.invariants_error


def test_small_host_pool_truncates_the_prefetch(server_factory, model_dir, ref, stored_conversation, tmp_path):
    store, history = stored_conversation
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    # 4 host pages: the 6-page stored prefix does not fit; the deepest state within 4 pages is at 32.
    s = server_factory(model_dir, *STORAGE_FLAGS, "--hicache-storage-dir", str(copy), "--hicache-tokens", "64")
    nxt = history + random_tokens(20, 8)
    with Client(s.endpoint) as c:
        out = c.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
    assert out.usage is not None and 32 <= out.usage.cached_tokens.storage <= 64
    assert out.token_ids == greedy(ref, nxt, GEN)
    st = s.cache_stats(check_invariants=True)
    assert st.invariants_ok, st.invariants_error


def test_flaky_slow_corrupt_read_only_storage_keeps_serving(server_factory, model_dir, ref, stored_conversation, tmp_path):
    store, history = stored_conversation
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    victim = min(copy.rglob("*.seg"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    for p in [copy, *copy.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    s = server_factory(
        model_dir, *STORAGE_FLAGS[:-2], "--prefetch-timeout-max-s", "2", "--hicache-storage-dir", str(copy),
        "--debug-storage-fail-rate", "0.3", "--debug-storage-slow-s", "0.01",
    )
    prompts = [history + random_tokens(10, 20 + i) for i in range(3)] + [random_tokens(70, 30 + i) for i in range(2)]
    try:
        with Client(s.endpoint) as c:
            for p in prompts + prompts[:2]:
                out = c.generate(input_ids=p, max_tokens=GEN, ignore_eos=True)
                assert out.token_ids == greedy(ref, p, GEN)
        time.sleep(1.0)
        st = s.cache_stats(check_invariants=True)
        assert st.invariants_ok, st.invariants_error
        assert st.running_requests == 0
    finally:
        for p in [copy, *copy.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert s.proc.poll() is None, "the server died"
    if os.geteuid() != 0:
        assert _files(copy) <= _files(store)  # a read-only store gained nothing


def test_a_request_waiting_for_its_prefetch_makes_no_cache_round_trips(
    server_factory, model_dir, ref, stored_conversation, tmp_path
):
    # Every storage operation takes 0.4 s, so the prefetch (lookup, then fetch) keeps the request
    # waiting for most of a second. The scheduler is woken when it completes; before the fix it
    # retried the admission in a loop (thousands of CacheSteps a second).
    store, history = stored_conversation
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    s = server_factory(
        model_dir, *STORAGE_FLAGS, "--hicache-storage-dir", str(copy), "--debug-storage-slow-s", "0.4"
    )
    idle_before = s.cache_stats().cache_steps
    time.sleep(1.0)  # an idle server: no round trips at all
    before = s.cache_stats().cache_steps
    assert before == idle_before
    nxt = history + random_tokens(20, 11)
    with Client(s.endpoint) as c:
        out = c.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
    assert out.usage is not None and out.usage.cached_tokens.storage >= 96
    assert out.token_ids == greedy(ref, nxt, GEN)
    # Prefetch + admission attempt, the admission after PrefetchDone, pages for at most GEN decode
    # steps, the release: a handful, however long the prefetch took.
    assert s.cache_stats().cache_steps - before <= GEN + 4


def test_best_effort_admits_a_hybrid_mid_prefetch_with_the_arrived_prefix_and_its_state(
    server_factory, model_dir, ref, stored_conversation, tmp_path
):
    """best_effort on a hybrid model: a request admitted while its prefetch is in flight gets the
    prefix that has arrived, with the state stored at its end, as a storage hit. The test hook
    holds the prefetch after 2 pages (the first stored state) until the request is admitted; the
    request waits behind a running one (one request at a time) until the hold is seen."""
    store, history = stored_conversation  # states at 32 (2 pages) and 96 (6 pages)
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    s = server_factory(
        model_dir, *STORAGE_FLAGS[:-4], "--hicache-storage-prefetch-policy", "best_effort",
        "--prefetch-timeout-max-s", "60", "--hicache-storage-dir", str(copy), "--max-running-requests", "1",
        "--debug-storage-prefetch-stall-pages", "2",
    )  # fmt: skip
    nxt = history + random_tokens(20, 12)

    async def admitted_mid_prefetch():  # type: ignore[no-untyped-def]
        async with AsyncClient(s.endpoint, timeout_s=120) as c:
            blocker = c.stream(input_ids=random_tokens(20, 13), max_tokens=400, ignore_eos=True).__aiter__()
            await blocker.__anext__()  # running: the next request waits for its turn
            task = asyncio.get_running_loop().create_task(c.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True))
            deadline = time.monotonic() + 60
            while "holds after 2 pages" not in s.log():
                assert time.monotonic() < deadline, "the prefetch never reached the hold"
                assert not task.done(), "admitted before its prefetch was in flight"
                await asyncio.sleep(0.05)
            await blocker.aclose()  # aborted: the waiting request is admitted mid-prefetch
            return await task

    out = asyncio.run(admitted_mid_prefetch())
    assert out.usage is not None
    assert out.usage.cached_tokens.storage == 32, out.usage  # the arrived prefix, not the stored 96
    assert out.token_ids == greedy(ref, nxt, GEN)
    st = s.cache_stats(check_invariants=True)
    assert st.invariants_ok, st.invariants_error
    assert st.host_pages_protected == 0 and st.host_states_protected == 0


def test_two_servers_share_the_default_directory_under_one_cap(server_factory, model_dir, ref, tmp_path, monkeypatch):
    """Both back up into the default directory, each reads the other's prefix after a restart,
    and the directory stays under the one cap while they fill it past it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = tmp_path / "xdg" / "himamba" / "storage"
    cap = 600_000
    flags = (*STORAGE_FLAGS, "--hicache-storage-dir", "", "--hicache-storage-max-bytes", str(cap))
    servers = [server_factory(model_dir, *flags) for _ in range(2)]
    histories = []
    for i, s in enumerate(servers):
        h = random_tokens(100, 40 + i)
        with Client(s.endpoint) as c:
            out = c.generate(input_ids=h, max_tokens=GEN, ignore_eos=True)
        assert out.token_ids == greedy(ref, h, GEN)
        histories.append(h + out.token_ids)
    _settle(store)
    for s in servers:
        s.stop()
    assert 0 < _files(store) <= cap
    servers = [server_factory(model_dir, *flags) for _ in range(2)]
    for i, s in enumerate(servers):
        nxt = histories[1 - i] + random_tokens(20, 50 + i)  # the other server's conversation
        with Client(s.endpoint) as c:
            out = c.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
        assert out.token_ids == greedy(ref, nxt, GEN)
        assert out.usage is not None and out.usage.cached_tokens.storage >= 96, out.usage
    # Fill well past the cap from both servers: the directory stays under it, the oldest segments go.
    before = set(store.rglob("*.seg"))
    with Client(servers[0].endpoint) as c0, Client(servers[1].endpoint) as c1:
        for j in range(12):
            p = random_tokens(200, 60 + j)
            out = (c0 if j % 2 else c1).generate(input_ids=p, max_tokens=2, ignore_eos=True)
            assert out.token_ids == greedy(ref, p, 2)
    _settle(store)
    assert _files(store) <= cap
    assert not before <= set(store.rglob("*.seg")), "nothing was evicted: the fill never reached the cap"
    for s in servers:
        st = s.cache_stats(check_invariants=True)
        assert st.invariants_ok, st.invariants_error
