"""A distributed store (Redis, Mooncake Store) that dies mid-load and comes back, and one that is
full: requests keep completing with exactly the no-cache greedy tokens (as misses while the store
is away), the outage is counted in /metrics, hits resume after the store returns without
restarting himamba, a full store only costs hits, and nothing leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from himamba.bench.servers import start_server
from himamba.services.cache.storage.local_stores import LocalMooncake
from tests.reliability.conftest import free_port
from tests.reliability.pools import assert_nothing_leaked, wait_drained
from tests.reliability.prompts import Prompt
from tests.reliability.store_servers import (
    SMALL_TIERS,
    STORE_KINDS,
    Conversations,
    kill_store,
    run_prompts,
    scrape_storage,
    start_store,
    storage_hits,
    wait_backups_settled,
    wait_metrics,
)


def _check(outs, prompts: list[Prompt], reference_tokens) -> None:  # type: ignore[no-untyped-def]
    want = reference_tokens([(p.input_ids, p.max_tokens) for p in prompts])
    assert [o.token_ids for o in outs] == want


def _turn(endpoint: str, convs: Conversations, reference_tokens) -> int:  # type: ignore[no-untyped-def]
    """One turn of every conversation, checked against the no-cache tokens; returns its storage tokens."""
    prompts = convs.turn()
    outs = asyncio.run(run_prompts(endpoint, prompts))
    _check(outs, prompts, reference_tokens)
    convs.answered(outs)
    return storage_hits(outs)


def _two_turns(endpoint: str, port: int, convs: Conversations, reference_tokens) -> int:  # type: ignore[no-untyped-def]
    """A first turn, its backups, then a second turn; returns the second turn's storage tokens."""
    _turn(endpoint, convs, reference_tokens)
    wait_backups_settled(port)
    return _turn(endpoint, convs, reference_tokens)


def _two_turns_until_a_hit(endpoint: str, port: int, seeds: range, reference_tokens) -> int:  # type: ignore[no-untyped-def]
    """`_two_turns` of fresh conversations (one seed each) until a second turn hits the store, for at
    most 120 s; returns the last pair's storage tokens (0: none hit)."""
    deadline = time.monotonic() + 120
    hits = 0
    for seed in seeds:
        if hits or time.monotonic() >= deadline:
            break
        hits = _two_turns(endpoint, port, Conversations(12, seed=seed), reference_tokens)
    return hits


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_store_killed_mid_load_then_back(
    kind, tiny_model, server_logs, reference_tokens, tmp_path
):
    store, flags = start_store(kind, tmp_path / kind)
    port = free_port()
    server = start_server(
        tiny_model, server_logs, *SMALL_TIERS, *flags, "--port", str(port)
    )
    try:
        # The store serves: turns that no longer fit the device and host tiers come back from it.
        # Until a second turn has hit it: on a loaded machine one pair of turns may find every
        # prefix still on the faster tiers (seen once in a full run; 3 of 3 alone hit at once).
        before = _two_turns_until_a_hit(server.endpoint, port, range(1, 10_000, 100), reference_tokens)
        assert before > 0, "no storage hit while the store was up"
        series = scrape_storage(port)
        assert series.up == 1 and series.backup_bytes["kv"] > 0 and series.backup_bytes["mamba"] > 0, series

        # Killed under load: every request completes, with the no-cache tokens.
        busy = Conversations(12, seed=2)
        load = busy.turn()

        async def killed_mid_load():  # type: ignore[no-untyped-def]
            task = asyncio.get_running_loop().create_task(
                run_prompts(server.endpoint, load)
            )
            await asyncio.sleep(0.5)
            kill_store(store)
            return await task

        _check(asyncio.run(killed_mid_load()), load, reference_tokens)
        # While it is away: misses, counted as unreachable in /metrics, the store reported down.
        away = Conversations(6, seed=3)
        assert _two_turns(server.endpoint, port, away, reference_tokens) == 0
        series = wait_metrics(
            port,
            lambda s: s.events.get("unreachable", 0) > 0 and s.up == 0,
            "store unreachable",
        )
        assert series.events["unreachable"] > 0

        # Back on the same address (empty): without a restart of himamba, hits resume.
        store.start()
        after = _two_turns_until_a_hit(server.endpoint, port, range(10, 100), reference_tokens)
        assert after > 0, "storage hits did not resume after the store came back"
        series = wait_metrics(
            port,
            lambda s: s.up == 1 and s.events.get("reconnect", 0) >= 1,
            "store reconnected",
        )
        assert server.proc.poll() is None
        assert_nothing_leaked(wait_drained(server))
    finally:
        server.stop()
        store.stop()


def _was_full(store, port: int) -> bool:  # type: ignore[no-untyped-def]
    """Redis (noeviction) refused writes; Mooncake evicted or refused an allocation."""
    if isinstance(store, LocalMooncake):
        m = store.master_metrics()
        return (
            m.get("master_evicted_key_count", 0) > 0
            or m.get("master_put_start_alloc_failures_total", 0) > 0
        )
    return scrape_storage(port).events.get("refused_write", 0) > 0


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_full_store_costs_hits_not_answers(
    kind, tiny_model, server_logs, reference_tokens, tmp_path
):
    store, flags = start_store(kind, tmp_path / kind, small=True)
    port = free_port()
    server = start_server(
        tiny_model, server_logs, *SMALL_TIERS, *flags, "--port", str(port)
    )
    try:
        # Until the store has been full and has served a hit (bounded). Fresh conversations each
        # round fill an evicting store (Mooncake); a full Redis (noeviction) keeps what it holds and
        # refuses the rest, so there only the first round's prefixes can ever hit: those
        # conversations take one more turn each round, finding their prefixes in the store once
        # the faster tiers have evicted them (one CI run had no hit in the first round, and fresh
        # conversations alone saw none in 11 more).
        first = Conversations(16, seed=20, first=400)
        hits = _two_turns(server.endpoint, port, first, reference_tokens)
        for round_ in range(1, 12):
            if _was_full(store, port) and hits > 0:
                break
            fresh = Conversations(16, seed=20 + round_, first=400)
            hits += _two_turns(server.endpoint, port, fresh, reference_tokens)
            hits += _turn(server.endpoint, first, reference_tokens)
        assert _was_full(store, port), f"the store never filled: {scrape_storage(port)}"
        assert hits > 0, "no storage hit at all"
        assert scrape_storage(port).up == 1
        assert server.proc.poll() is None
        assert_nothing_leaked(wait_drained(server))
    finally:
        server.stop()
        store.stop()
