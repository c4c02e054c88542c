"""Mamba track-buffer strategies, lazy allocation failure, memory pressure and overlap, on
running servers, against transformers' greedy tokens."""

from __future__ import annotations

import asyncio

import pytest

from himamba.common.client import AsyncClient, Client
from tests.e2e.prompts import random_tokens
from tests.worker.hf_reference import greedy

PAGE = 16


def _flags(strategy: str, *more: str) -> list[str]:
    return [
        "--mamba-scheduler-strategy", strategy, "--mamba-track-interval", str(PAGE),
        "--max-total-tokens", "16384", "--max-mamba-cache-size", "48", *more,
    ]


def _conversation(endpoint: str, ref, turns: int = 4, seed: int = 3, new: int = 37, gen: int = 21):
    """Run a conversation; check every turn against transformers; return per-turn (prompt_len, cached)."""
    history: list[int] = []
    seen = []
    with Client(endpoint) as c:
        for t in range(turns):
            history = history + random_tokens(new, seed * 100 + t)
            out = c.generate(input_ids=history, max_tokens=gen, ignore_eos=True)
            assert out.token_ids == greedy(ref, history, gen), f"turn {t}"
            seen.append((len(history), out.usage.cached_tokens.total))
            history = history + out.token_ids
    return seen


@pytest.mark.parametrize(
    "strategy,extra",
    [("extra_buffer", ["--disable-overlap"]), ("extra_buffer_lazy", []), ("no_buffer", [])],
)
def test_strategies_cache_generated_text_as_specified(server_factory, model_dir, ref, strategy, extra):
    server = server_factory(model_dir, *_flags(strategy, *extra))
    seen = _conversation(server.endpoint, ref)
    prev_prompt = 0
    for t, (prompt_len, cached) in enumerate(seen):
        if t == 0:
            assert cached == 0
        elif strategy == "no_buffer":
            assert 0 < cached <= prev_prompt  # only the previous prompt, never its generated text
        else:
            assert cached > prev_prompt  # the generated text of the previous turn was tracked
        prev_prompt = prompt_len
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


def test_lazy_allocation_failure_keeps_the_older_tracked_state(server_factory, model_dir, ref):
    # Every boundary slot is refused: the first boundary still tracks (into the resident track
    # slot), later ones cannot, and that older tracked state is what the next turn hits.
    server = server_factory(model_dir, *_flags("extra_buffer_lazy", "--debug-fail-lazy-alloc"))
    seen = _conversation(server.endpoint, ref)
    for t in range(1, len(seen)):
        prev_prompt, cached = seen[t - 1][0], seen[t][1]
        assert prev_prompt < cached <= seen[t][0]  # generated text of the previous turn was kept
    assert "no slot for its lazy track buffer" in server.log()
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


def test_memory_pressure_completes_every_request_through_retraction(server_factory, model_dir, ref):
    # 24 pages of KV for six requests that need ~10 pages each at the end: decode must retract.
    server = server_factory(
        model_dir, "--max-total-tokens", "384", "--max-context-len", "384", "--max-mamba-cache-size", "24",
        "--mamba-track-interval", str(PAGE),
    )
    prompts = [random_tokens(90 + 7 * i, seed=500 + i) for i in range(6)]
    want = [greedy(ref, p, 60) for p in prompts]

    async def run():
        async with AsyncClient(server.endpoint) as c:
            return await asyncio.gather(*(c.generate(input_ids=p, max_tokens=60, ignore_eos=True) for p in prompts))

    outs = asyncio.run(run())
    assert [o.token_ids for o in outs] == want
    assert "retracting" in server.log()
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


def test_n_samples_with_a_state_pool_for_one_requests_samples_complete(server_factory, model_dir, ref):
    # 4 samples x 2 slots (extra_buffer_lazy: working + track) = 8 state slots: exactly one request's
    # samples fit at a time. Sample 0's admission reserves its siblings' slots, all or nothing, so
    # samples of different requests never hold each other's slots.
    server = server_factory(
        model_dir, "--mamba-scheduler-strategy", "extra_buffer_lazy", "--mamba-track-interval", str(PAGE),
        "--max-mamba-cache-size", "8", "--max-total-tokens", "8192",
    )  # fmt: skip
    prompts = [random_tokens(40 + 9 * i, seed=900 + i) for i in range(3)]
    want = [greedy(ref, p, 12) for p in prompts]

    async def run():
        async with AsyncClient(server.endpoint) as c:
            return await asyncio.gather(
                *(c.generate_n(input_ids=p, n=4, max_tokens=12, ignore_eos=True, temperature=0.0) for p in prompts)
            )

    outs = asyncio.run(run())
    for samples, expected in zip(outs, want, strict=True):
        assert [s.token_ids for s in samples] == [expected] * 4
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0 and stats.free_slots + stats.cached_slots == stats.total_slots
