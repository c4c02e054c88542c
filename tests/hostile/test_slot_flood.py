"""No deadlock under slot exhaustion: a flood of n > 1 requests on a state pool that holds one
of them at a time (besides a stream) all finish, and a concurrent stream keeps receiving chunks
while they run (counted, not timed). Before, 12 concurrent n=4 requests on a tiny pool ended
at 0 running / 35 waiting with /health still 200."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from himamba.bench.servers import ServerProcess, start_server
from himamba.common.client import AsyncClient
from himamba.services.modelgen.checkpoint import make_checkpoint

N = 4
FLOOD = 12
TOKENS = 24


@pytest.fixture(scope="module")
def small_pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("flood")
    model = make_checkpoint("nemotron_h", tmp / "model", preset="tiny", seed=0)
    # extra_buffer_lazy: 2 slots per sample, so 10 slots hold one n=4 request and one stream.
    server = start_server(
        model, tmp / "logs", "--max-mamba-cache-size", "10", "--max-total-tokens", "4096",
        "--max-context-len", "256", "--mamba-scheduler-strategy", "extra_buffer_lazy",
        "--hicache-storage-backend", "none",
    )  # fmt: skip
    yield server
    server.stop()


def test_an_n_gt_1_flood_on_small_pools_finishes_and_a_stream_is_served(small_pools: ServerProcess) -> None:
    async def scenario() -> tuple[int, list[list[tuple[int, str]]], tuple[int, str]]:
        async with AsyncClient(small_pools.endpoint, timeout_s=300) as c:
            chunks_during_flood = 0
            flood_done = asyncio.Event()

            async def stream() -> tuple[int, str]:
                nonlocal chunks_during_flood
                got, reason = 0, ""
                async for chunk in c.stream(input_ids=[7, 8, 9], max_tokens=200, ignore_eos=True):
                    got += len(chunk.token_ids)
                    if not flood_done.is_set() and got > 1:
                        chunks_during_flood += 1
                    if chunk.finished:
                        reason = chunk.finish_reason or ""
                return got, reason

            async def one(i: int) -> list[tuple[int, str]]:
                outs = await c.generate_n(input_ids=[20 + i, 21, 22, 23], n=N, max_tokens=TOKENS, ignore_eos=True, temperature=0.8, seed=i)
                return [(len(o.token_ids), o.finish_reason or "") for o in outs]

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(0)  # the stream is sent first
            flood = await asyncio.gather(*(one(i) for i in range(FLOOD)))
            flood_done.set()
            return chunks_during_flood, list(flood), await streaming

    during, flood, stream_result = asyncio.run(scenario())
    assert flood == [[(TOKENS, "length")] * N] * FLOOD, flood
    assert stream_result == (200, "length"), stream_result
    assert during > 10, during
    stats = small_pools.cache_stats()
    assert stats.invariants_ok and stats.running_requests == 0, stats


def test_the_largest_n_the_state_pool_holds_is_served_and_one_more_is_a_400_naming_it(
    small_pools: ServerProcess,
) -> None:
    # 10 slots, 2 a sample: n=5 is the most one request can ever have admitted at once. Turn 3
    # (N6): with 2 slots, every n >= 2 request was a 500 "not enough state slots", even alone.
    from himamba.common.client import Client, HimambaError

    with Client(small_pools.endpoint, timeout_s=300) as c:
        outs = c.generate_n(input_ids=[5, 6, 7], n=5, max_tokens=4, ignore_eos=True, temperature=0.8, seed=1)
        assert [len(o.token_ids) for o in outs] == [4] * 5
        with pytest.raises(HimambaError) as refused:
            c.generate_n(input_ids=[5, 6, 7], n=6, max_tokens=4, ignore_eos=True, temperature=0.8, seed=1)
    assert refused.value.code == 400, refused.value
    message = str(refused.value)
    assert "n may be at most 5" in message and "10" in message and "extra_buffer_lazy" in message, message
