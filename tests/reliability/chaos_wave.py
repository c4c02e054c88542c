"""One wave of chaos: "keeper" requests run while "victims" on the same shared prefixes are
aborted at random points (client.abort, leaving the stream, an abort right behind the request)
or lose their client mid-stream (a DEALER closed without a word, an AsyncClient closed under its
streams, an HTTP connection dropped)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import aiohttp
import zmq.asyncio

from himamba.common.client import AsyncClient, HimambaError
from himamba.common.messages import GenerateRequest
from himamba.common.types import FinishReason, SamplingParams
from tests.reliability.prompts import Prompt
from tests.reliability.stream_clients import RecordingDealer, http_stream_completion, token_ids_of

VICTIMS_PER_KIND = 4
VICTIM_MAX_TOKENS = 300  # long enough that every victim is still running when its fate comes
KINDS = ("abort", "leave", "abort_at_once", "disconnect", "close_client", "http_drop")
NUM_VICTIMS = VICTIMS_PER_KIND * len(KINDS)


async def keep(endpoint: str, prompts: list[Prompt]) -> list[list[int]]:
    async with AsyncClient(endpoint, timeout_s=120) as c:
        outs = await asyncio.gather(
            *(c.generate(input_ids=p.input_ids, max_tokens=p.max_tokens, ignore_eos=True) for p in prompts)
        )
    return [o.token_ids for o in outs]


async def _abort(c: AsyncClient, p: Prompt, rid: str, after: int) -> FinishReason | None:
    got, sent_abort, reason = 0, False, None
    async for chunk in c.stream(input_ids=p.input_ids, max_tokens=VICTIM_MAX_TOKENS, ignore_eos=True, rid=rid):
        got += len(chunk.token_ids)
        if got >= after and not sent_abort:
            await c.abort(rid)
            sent_abort = True
        if chunk.finished:
            reason = chunk.finish_reason
    return reason


async def _leave(c: AsyncClient, p: Prompt, after: int) -> None:
    got = 0
    stream = c.stream(input_ids=p.input_ids, max_tokens=VICTIM_MAX_TOKENS, ignore_eos=True)
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            got += len(chunk.token_ids)
            if got >= after:
                break  # closing the stream early aborts the request


async def _abort_at_once(c: AsyncClient, p: Prompt, rid: str) -> None:
    """Abort right behind the request: the abort may meet it anywhere before its first token."""

    async def run() -> None:
        async for _ in c.stream(input_ids=p.input_ids, max_tokens=VICTIM_MAX_TOKENS, ignore_eos=True, rid=rid):
            pass

    task = asyncio.get_running_loop().create_task(run())
    await asyncio.sleep(0)  # the stream sends its request on its first step
    await c.abort(rid)
    await task


async def _disconnect(ctx: zmq.asyncio.Context, endpoint: str, p: Prompt, rid: str, after: int) -> None:
    dealer = RecordingDealer(ctx, endpoint)
    try:
        sampling = SamplingParams(max_tokens=VICTIM_MAX_TOKENS, ignore_eos=True)
        await dealer.send(GenerateRequest(rid=rid, input_ids=p.input_ids, sampling=sampling, stream=True))
        for _ in range(3000):
            if len(token_ids_of(dealer.replies[rid])) >= after:
                break
            await asyncio.sleep(0.01)
    finally:
        await dealer.close()  # the socket goes away without an abort


async def _close_client(endpoint: str, prompts: list[Prompt], after: int) -> None:
    c = AsyncClient(endpoint, timeout_s=120)
    seen = asyncio.Event()

    async def one(p: Prompt) -> None:
        got = 0
        with contextlib.suppress(HimambaError):
            async for chunk in c.stream(input_ids=p.input_ids, max_tokens=VICTIM_MAX_TOKENS, ignore_eos=True):
                got += len(chunk.token_ids)
                if got >= after:
                    seen.set()

    tasks = [asyncio.get_running_loop().create_task(one(p)) for p in prompts]
    await asyncio.wait_for(seen.wait(), 120)
    await c.aclose()  # every stream of this client ends with "client closed"
    await asyncio.gather(*tasks)


async def _http_drop(base_url: str, p: Prompt, after: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await http_stream_completion(session, base_url, p.input_ids, VICTIM_MAX_TOKENS, stop_after=after)


async def run_wave(
    served, keepers: list[Prompt], victims: list[Prompt], rng: random.Random
) -> tuple[list[list[int]], list[FinishReason | None]]:
    """Run the keepers beside NUM_VICTIMS victims; returns the keepers' tokens and the finish
    reasons of the victims aborted with client.abort."""
    ctx = zmq.asyncio.Context()
    jobs: list = []
    abort_jobs: list = []
    async with AsyncClient(served.main.endpoint, timeout_s=120) as vc:
        by_kind = {k: victims[i * VICTIMS_PER_KIND : (i + 1) * VICTIMS_PER_KIND] for i, k in enumerate(KINDS)}
        for i, p in enumerate(by_kind["abort"]):
            abort_jobs.append(_abort(vc, p, f"abort-{i}", rng.randint(1, 4)))
        for p in by_kind["leave"]:
            jobs.append(_leave(vc, p, rng.randint(1, 4)))
        for i, p in enumerate(by_kind["abort_at_once"]):
            jobs.append(_abort_at_once(vc, p, f"at-once-{i}"))
        for i, p in enumerate(by_kind["disconnect"]):
            jobs.append(_disconnect(ctx, served.main.endpoint, p, f"gone-{i}", rng.randint(1, 4)))
        jobs.append(_close_client(served.main.endpoint, by_kind["close_client"], rng.randint(1, 4)))
        for p in by_kind["http_drop"]:
            jobs.append(_http_drop(served.base_url, p, rng.randint(1, 4)))
        try:
            results = await asyncio.gather(keep(served.main.endpoint, keepers), asyncio.gather(*abort_jobs), *jobs)
        finally:
            ctx.term()
    return results[0], results[1]
