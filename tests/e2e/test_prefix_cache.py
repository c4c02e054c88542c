"""The prefix cache on a running server: multi-turn hits on device and host, with exactly the
greedy tokens of a server that computes everything."""

from __future__ import annotations

import pytest

from himamba.common.client import Client
from tests.e2e.prompts import random_tokens


@pytest.fixture(scope="module")
def reference(server_factory, model_dir):
    return server_factory(model_dir, "--disable-radix-cache", "--max-total-tokens", "32768", "--max-mamba-cache-size", "64")


@pytest.fixture(scope="module")
def cached(server_factory, model_dir):
    return server_factory(model_dir, "--max-total-tokens", "32768", "--max-mamba-cache-size", "64")


@pytest.fixture(scope="module")
def small_device(server_factory, model_dir):
    # Device pools far smaller than the conversations: earlier turns must come back from host.
    return server_factory(
        model_dir, "--max-total-tokens", "512", "--max-mamba-cache-size", "12", "--max-context-len", "512",
        "--hicache-tokens", "16384", "--hicache-mamba-slots", "64", "--max-running-requests", "2",
    )


def _conversation(client: Client, turns: int, seed: int, new: int = 40, gen: int = 12):
    history: list[int] = []
    outs = []
    for t in range(turns):
        history = history + random_tokens(new, seed * 100 + t)
        out = client.generate(input_ids=history, max_tokens=gen, ignore_eos=True)
        outs.append(out)
        history = history + out.token_ids
    return outs


def test_five_turns_same_tokens_with_and_without_cache(reference, cached):
    with Client(reference.endpoint) as r, Client(cached.endpoint) as c:
        ref = _conversation(r, 5, seed=1)
        got = _conversation(c, 5, seed=1)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.usage.cached_tokens.total == 0 for o in ref)
    assert got[0].usage.cached_tokens.total == 0
    for o in got[1:]:
        assert o.usage.cached_tokens.device > 0
    stats = cached.cache_stats()
    assert stats.invariants_ok, stats.invariants_error


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_page_boundary_hits_match_recompute(reference, cached, delta):
    prompt = random_tokens(48 + delta, seed=7 + delta)  # 3 pages of 16, and one token either side
    with Client(reference.endpoint) as r, Client(cached.endpoint) as c:
        want = r.generate(input_ids=prompt, max_tokens=10, ignore_eos=True).token_ids
        first = c.generate(input_ids=prompt, max_tokens=10, ignore_eos=True)
        second = c.generate(input_ids=prompt, max_tokens=10, ignore_eos=True)
    assert first.token_ids == want and second.token_ids == want
    assert second.usage.cached_tokens.device > 0
    assert second.usage.cached_tokens.device < len(prompt)


def test_small_device_pool_serves_earlier_turns_from_host(reference, small_device):
    with Client(reference.endpoint) as r, Client(small_device.endpoint) as c:
        # Interleave conversations so each one's earlier turns are evicted from the device.
        histories = {k: [] for k in range(4)}
        host_hits = 0
        for turn in range(3):
            for k in histories:
                histories[k] = histories[k] + random_tokens(60, seed=1000 + 10 * k + turn)
                want = r.generate(input_ids=histories[k], max_tokens=8, ignore_eos=True)
                got = c.generate(input_ids=histories[k], max_tokens=8, ignore_eos=True)
                assert got.token_ids == want.token_ids, f"conversation {k} turn {turn}"
                host_hits += got.usage.cached_tokens.host
                histories[k] = histories[k] + got.token_ids
    assert host_hits > 0
    stats = small_device.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_host_hits_at_page_boundaries_match_recompute(reference, small_device, delta):
    prompt = random_tokens(64 + delta, seed=70 + delta)  # 4 pages of 16, and one token either side
    with Client(reference.endpoint) as r, Client(small_device.endpoint) as c:
        want = r.generate(input_ids=prompt, max_tokens=8, ignore_eos=True).token_ids
        assert c.generate(input_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want
        # Other traffic pushes the prompt's pages out of the small device pool, into host memory.
        for k in range(4):
            c.generate(input_ids=random_tokens(150, seed=900 + 10 * delta + k), max_tokens=2, ignore_eos=True)
        again = c.generate(input_ids=prompt, max_tokens=8, ignore_eos=True)
    assert again.token_ids == want
    assert again.usage.cached_tokens.host > 0
    stats = small_device.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
