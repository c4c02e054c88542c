"""Drive one multi-turn run against a server and time every request: ours over ZeroMQ (`ZmqTurns`),
or any OpenAI-compatible server over HTTP (`openai_turns.OpenAITurns`), through the same loop.

Like sglang's bench_multiturn: the first round of every conversation is ready at the start; a
conversation's next round becomes ready when its answer arrives. A launcher pops ready rounds
(`random` or `fifo`), keeps at most `max_parallel` in flight, and waits an arrival gap after
each launch (open loop at the request rate; an infinite rate makes it a closed loop).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Literal, NamedTuple, Protocol, Self

from himamba.bench.arrivals import Arrivals
from himamba.bench.latency_summary import TIERS, RequestRecord
from himamba.bench.progress import Progress
from himamba.bench.workload import Conversation, Turn, WorkloadSpec, conversations
from himamba.common.client import AsyncClient, HimambaError

ReadyPolicy = Literal["random", "fifo"]


class RunResult(NamedTuple):
    records: list[RequestRecord]
    duration_s: float  # first launch to last answer


class TurnClient(Protocol):
    """Sends one round and times it; used as an async context manager around a whole run."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def timed_request(self, turn: Turn, output_length: int) -> tuple[RequestRecord, list[int]]: ...


class ZmqTurns:
    """Rounds sent to our server over ZeroMQ (`common.client.AsyncClient`)."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0) -> None:
        self._client = AsyncClient(endpoint, timeout_s=timeout_s)

    async def __aenter__(self) -> Self:
        await self._client.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.__aexit__(exc_type, exc, tb)

    async def timed_request(self, turn: Turn, output_length: int) -> tuple[RequestRecord, list[int]]:
        client = self._client
        rec = RequestRecord(turn.client, turn.round, len(turn.input_ids), turn.repeated_len)
        token_ids: list[int] = []
        t0 = time.perf_counter()
        last = t0
        try:
            async for chunk in client.stream(input_ids=turn.input_ids, max_tokens=output_length, ignore_eos=True):
                now = time.perf_counter()
                if chunk.token_ids:
                    if rec.ttft_s is None:
                        rec.ttft_s = now - t0
                    else:
                        # A chunk carrying several tokens spreads its gap over them, so ITL stays per token.
                        gap = (now - last) / len(chunk.token_ids)
                        rec.itl_s.extend([gap] * len(chunk.token_ids))
                    last = now
                    token_ids.extend(chunk.token_ids)
                if chunk.finished:
                    rec.e2e_s = now - t0
                    if chunk.usage is not None:
                        rec.cached = {t: getattr(chunk.usage.cached_tokens, t) for t in TIERS}
                    if chunk.finish_reason not in ("length", "stop"):
                        rec.error = f"finished with {chunk.finish_reason!r}"
        except (HimambaError, TimeoutError) as e:
            rec.error = str(e)
        except Exception as e:  # any other failure is this request's result, never a hung run
            rec.error = repr(e)
        rec.completion_tokens = len(token_ids)
        if rec.ok and rec.e2e_s is None:
            rec.error = "the stream ended without a final chunk"
        return rec, token_ids


async def run_multiturn(
    turns: TurnClient,
    spec: WorkloadSpec,
    token_pool: Sequence[int],
    *,
    max_parallel: int,
    arrivals: Arrivals,
    ready_policy: ReadyPolicy = "random",
    progress: Progress | None = None,
) -> RunResult:
    """Run every conversation of `spec` to its end (or its first failed round)."""
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    convs = conversations(spec, token_pool)
    ready: list[tuple[Conversation, Turn]] = [(c, c.next_turn()) for c in convs]
    pick = random.Random(spec.seed)
    records: list[RequestRecord] = []
    expected = spec.num_requests
    in_flight = 0
    changed = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def serve_one(conv: Conversation, turn: Turn) -> None:
        nonlocal in_flight, expected
        rec, answer = await turns.timed_request(turn, spec.output_length)
        records.append(rec)
        in_flight -= 1
        if rec.ok and not conv.finished:
            conv.add_answer(answer)
            ready.append((conv, conv.next_turn()))
        elif not rec.ok:
            # Without an answer the conversation cannot go on: its later rounds are never sent.
            skipped = spec.num_rounds - turn.round
            expected -= skipped
            if progress is not None:
                progress.grow(-skipped)
        if progress is not None:
            progress.update()
        changed.set()

    async with turns:
        t0 = time.perf_counter()
        while len(records) < expected:
            if ready and in_flight < max_parallel:
                conv, turn = ready.pop(pick.randrange(len(ready)) if ready_policy == "random" else 0)
                in_flight += 1
                task = asyncio.get_running_loop().create_task(serve_one(conv, turn))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                gap = arrivals.next_gap_s()
                if gap:
                    await asyncio.sleep(gap)
                continue
            # Nothing to launch now: wait for an answer (no await between the check and clear).
            changed.clear()
            await changed.wait()
        duration = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    return RunResult(records, duration)
