"""One request cannot fail everyone's batch: values that cannot sample are refused at the door,
and a sequence whose sampling fails anyway (NaN logits, injected by the test-only
fault_site/sitecustomize.py) fails alone while its batch-mates finish every token."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from himamba.common.client import AsyncClient, HimambaError
from himamba.common.messages import ErrorReply, GenerateChunk
from tests.hostile.conftest import API_KEY, NAN_SEED, Door, Hostile

STREAMS = 8
TOKENS = 160
PROMPTS = [[11 + i, 12, 13 + i, 14] for i in range(STREAMS)]

# field -> values that pass a plain range check (or JSON/msgpack typing) but cannot sample
POISON = [
    ("temperature", 1e-40),
    ("repetition_penalty", 1e-40),
    ("temperature", math.nan),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("top_p", math.nan),
    ("top_k", 2**64 - 1),
]


async def _stream(c: AsyncClient, i: int, started: asyncio.Event, counts: list[int], **extra: object) -> tuple[int, str]:
    """Stream one request; returns (tokens received, finish reason or the error)."""
    got = 0
    try:
        async for chunk in c.stream(input_ids=PROMPTS[i], max_tokens=TOKENS, ignore_eos=True, **extra):  # type: ignore[arg-type]
            got += len(chunk.token_ids)
            counts[i] = got
            if got >= 8 and all(n >= 8 for n in counts[:STREAMS]):
                started.set()
            if chunk.finished:
                return got, chunk.finish_reason or ""
    except HimambaError as e:
        started.set()
        return got, f"error {e.code}: {e}"
    return got, "no final chunk"


def test_poison_values_mid_decode_are_refused_and_every_stream_finishes(hostile: Hostile) -> None:
    async def scenario() -> tuple[list[tuple[int, str]], list[ErrorReply | GenerateChunk]]:
        async with AsyncClient(hostile.endpoint, timeout_s=300, api_key=API_KEY) as c:
            started = asyncio.Event()
            counts = [0] * STREAMS
            tasks = [asyncio.create_task(_stream(c, i, started, counts, temperature=0.7, seed=i)) for i in range(STREAMS)]
            await asyncio.wait_for(started.wait(), 300)  # every stream is decoding
            replies = await asyncio.to_thread(_send_poison, hostile)
            return list(await asyncio.gather(*tasks)), replies

    results, replies = asyncio.run(scenario())
    assert results == [(TOKENS, "length")] * STREAMS, results
    for (field, value), reply in zip(POISON, replies, strict=True):
        assert isinstance(reply, ErrorReply) and reply.code == 400, (field, value, reply)
        assert field in reply.message, (field, reply.message)
    # The HTTP door refuses them the same way.
    for field in ("temperature", "repetition_penalty"):
        r = hostile.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, field: 1e-40})
        assert r.status == 400 and r.json()["error"]["param"] == field, r.body[:300]


def _send_poison(hostile: Hostile) -> list[ErrorReply | GenerateChunk]:
    d = Door(hostile.endpoint)
    try:
        out = []
        for field, value in POISON:
            req = d.request(sampling={"max_tokens": 50, "temperature": 0.5, field: value}, stream=True)
            out.append(d.exchange([msgspec.msgpack.encode(req)]))
        return out
    finally:
        d.close()


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_a_sequence_whose_sampling_fails_fails_alone(hostile: Hostile, greedy: bool) -> None:
    """NaN logits pushed past validation (fault_site, for seed NAN_SEED) in one of 8
    co-batched streams: exactly 1 error, 7 complete streams."""
    poisoned = STREAMS // 2

    async def scenario() -> list[tuple[int, str]]:
        async with AsyncClient(hostile.endpoint, timeout_s=300, api_key=API_KEY) as c:
            started = asyncio.Event()
            counts = [0] * STREAMS
            counts[poisoned] = TOKENS  # not waited for: it starts once the others decode
            tasks = {
                i: asyncio.create_task(_stream(c, i, started, counts, temperature=0.0 if greedy else 0.8, seed=i))
                for i in range(STREAMS)
                if i != poisoned
            }
            await asyncio.wait_for(started.wait(), 300)
            extra = {"temperature": 0.0 if greedy else 0.8, "seed": NAN_SEED}
            tasks[poisoned] = asyncio.create_task(_stream(c, poisoned, asyncio.Event(), [0] * STREAMS, **extra))
            return [await tasks[i] for i in range(STREAMS)]

    results = asyncio.run(scenario())
    errors = [r for r in results if r[1].startswith("error")]
    assert len(errors) == 1 and results[poisoned][1].startswith("error 500") and "sampling failed" in results[poisoned][1], results
    assert [r for i, r in enumerate(results) if i != poisoned] == [(TOKENS, "length")] * (STREAMS - 1), results
    assert hostile.alive()
