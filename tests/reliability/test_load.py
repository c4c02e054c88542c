"""Load: 64 concurrent streaming ZeroMQ clients (half on `AsyncClient`, half on a raw DEALER that
records every reply) and 16 streaming HTTP clients send a few hundred requests of mixed lengths
on shared prefixes to a server whose device pools are far smaller than the load. Every request
ends exactly once with exactly its tokens, equal to the no-cache reference; afterwards the
pools hold nothing but free and cached entries."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import aiohttp
import pytest
import zmq.asyncio

from himamba.common.client import AsyncClient, Completion
from himamba.common.messages import CacheStats, ClientReply, ErrorReply, GenerateChunk
from tests.reliability.pools import assert_nothing_leaked, wait_drained
from tests.reliability.prompts import Prompt, mixed_prompts
from tests.reliability.stream_clients import (
    HttpOutcome,
    RecordingDealer,
    http_stream_completion,
    is_final,
    token_ids_of,
)

ZMQ_CLIENTS = 64  # half AsyncClient, half RecordingDealer
HTTP_CLIENTS = 16


class LoadRun(NamedTuple):
    prompts: dict[str, Prompt]  # rid -> what was asked
    recorded: dict[str, list[ClientReply]]  # raw DEALER rids -> every reply
    never_sent_replies: list[ClientReply]  # replies naming a rid no DEALER sent
    completions: dict[str, Completion | BaseException]  # AsyncClient rids
    http: dict[str, HttpOutcome | BaseException]
    stats: CacheStats


async def _async_client(endpoint: str, k: int, prompts: list[Prompt], out: dict[str, Completion | BaseException]) -> None:
    async with AsyncClient(endpoint, timeout_s=120) as c:
        for i, p in enumerate(prompts):
            rid = f"a{k}-{i}"
            try:
                ids: list[int] = []
                last = None
                async for chunk in c.stream(input_ids=p.input_ids, max_tokens=p.max_tokens, ignore_eos=True, rid=rid):
                    ids += chunk.token_ids
                    last = chunk
                assert last is not None
                out[rid] = Completion(rid, "", ids, last.finish_reason, last.usage, None)
            except Exception as e:  # kept as the request's result; the tests report it
                out[rid] = e


async def _dealer_client(dealer: RecordingDealer, k: int, prompts: list[Prompt]) -> None:
    for i, p in enumerate(prompts):
        try:
            await dealer.generate(f"d{k}-{i}", p.input_ids, p.max_tokens, timeout_s=120)
        except TimeoutError:
            pass  # a missing final reply is reported by the tests


async def _http_client(base_url: str, k: int, prompts: list[Prompt], out: dict[str, HttpOutcome | BaseException]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for i, p in enumerate(prompts):
            try:
                out[f"h{k}-{i}"] = await http_stream_completion(session, base_url, p.input_ids, p.max_tokens)
            except Exception as e:
                out[f"h{k}-{i}"] = e


async def _run(served, rounds: int) -> LoadRun:
    asked: dict[str, Prompt] = {}
    completions: dict[str, Completion | BaseException] = {}
    http: dict[str, HttpOutcome | BaseException] = {}
    ctx = zmq.asyncio.Context()
    dealers = [RecordingDealer(ctx, served.main.endpoint) for _ in range(ZMQ_CLIENTS // 2)]
    jobs = []
    for k in range(ZMQ_CLIENTS // 2):
        ps = mixed_prompts(rounds, seed=k)
        asked.update({f"a{k}-{i}": p for i, p in enumerate(ps)})
        jobs.append(_async_client(served.main.endpoint, k, ps, completions))
    for k, dealer in enumerate(dealers):
        ps = mixed_prompts(rounds, seed=1000 + k)
        asked.update({f"d{k}-{i}": p for i, p in enumerate(ps)})
        jobs.append(_dealer_client(dealer, k, ps))
    for k in range(HTTP_CLIENTS):
        ps = mixed_prompts(rounds, seed=2000 + k)
        asked.update({f"h{k}-{i}": p for i, p in enumerate(ps)})
        jobs.append(_http_client(served.base_url, k, ps, http))
    try:
        await asyncio.gather(*jobs)
        await asyncio.sleep(0.5)  # anything still arriving now is a duplicate or a late reply
        recorded: dict[str, list[ClientReply]] = {}
        strays: list[ClientReply] = []
        for dealer in dealers:
            sent = set(dealer.sent)
            for rid, replies in dealer.replies.items():
                if rid in sent:
                    recorded[rid] = replies
                else:
                    strays += replies
            recorded.update({rid: [] for rid in sent if rid not in dealer.replies})
    finally:
        for dealer in dealers:
            await dealer.close()
        ctx.term()
    return LoadRun(asked, recorded, strays, completions, http, wait_drained(served.main))


@pytest.fixture(scope="module")
def load_run(served, soak_scale) -> LoadRun:
    return asyncio.run(_run(served, soak_scale.load_rounds))


def test_every_zmq_request_ends_once_with_exactly_its_tokens(load_run):
    assert not load_run.never_sent_replies
    expected = {rid for rid in load_run.prompts if rid.startswith("d")}
    assert set(load_run.recorded) == expected
    problems = []
    for rid, replies in load_run.recorded.items():
        p = load_run.prompts[rid]
        finals = [i for i, r in enumerate(replies) if is_final(r)]
        if len(finals) != 1 or finals[0] != len(replies) - 1:
            problems.append(f"{rid}: final replies at {finals} of {len(replies)}")
            continue
        last = replies[-1]
        if isinstance(last, ErrorReply):
            problems.append(f"{rid}: error {last.message!r}")
            continue
        got = token_ids_of(replies)
        if len(got) != p.max_tokens or last.finish_reason != "length":
            problems.append(f"{rid}: {len(got)} tokens ({last.finish_reason}), asked {p.max_tokens}")
        elif last.usage is None or (last.usage.prompt_tokens, last.usage.completion_tokens) != (len(p.input_ids), p.max_tokens):
            problems.append(f"{rid}: usage {last.usage} for a {len(p.input_ids)}-token prompt")
        if any(not isinstance(r, GenerateChunk) or r.rid != rid for r in replies):
            problems.append(f"{rid}: foreign reply in its stream")
    assert not problems, f"{len(problems)} of {len(load_run.recorded)} requests went wrong: {problems[:10]}"


def test_every_async_client_request_completes(load_run):
    expected = {rid for rid in load_run.prompts if rid.startswith("a")}
    assert set(load_run.completions) == expected
    problems = []
    for rid, out in load_run.completions.items():
        p = load_run.prompts[rid]
        if isinstance(out, BaseException):
            problems.append(f"{rid}: {out!r}")
        elif len(out.token_ids) != p.max_tokens or out.finish_reason != "length":
            problems.append(f"{rid}: {len(out.token_ids)} tokens ({out.finish_reason}), asked {p.max_tokens}")
    assert not problems, problems[:10]


def test_every_http_stream_completes(load_run):
    expected = {rid for rid in load_run.prompts if rid.startswith("h")}
    assert set(load_run.http) == expected
    problems = []
    for rid, out in load_run.http.items():
        p = load_run.prompts[rid]
        if isinstance(out, BaseException):
            problems.append(f"{rid}: {out!r}")
        elif out.status != 200 or out.error or not out.saw_done:
            problems.append(f"{rid}: status {out.status}, error {out.error}, [DONE] {out.saw_done}")
        elif len(out.token_ids) != p.max_tokens or out.finish_reason != "length":
            problems.append(f"{rid}: {len(out.token_ids)} tokens ({out.finish_reason}), asked {p.max_tokens}")
        elif not out.usage or out.usage["completion_tokens"] != p.max_tokens:
            problems.append(f"{rid}: usage {out.usage}")
    assert not problems, problems[:10]


def test_answers_equal_the_no_cache_reference(load_run, reference_tokens):
    got: dict[str, list[int]] = {}
    for rid, replies in load_run.recorded.items():
        got[rid] = token_ids_of(replies)
    for rid, c in load_run.completions.items():
        if not isinstance(c, BaseException):
            got[rid] = c.token_ids
    for rid, h in load_run.http.items():
        if isinstance(h, HttpOutcome):
            got[rid] = h.token_ids
    rids = sorted(got)
    want = reference_tokens([(load_run.prompts[r].input_ids, load_run.prompts[r].max_tokens) for r in rids])
    wrong = [rid for rid, w in zip(rids, want, strict=True) if got[rid] != w]
    assert not wrong, f"{len(wrong)} of {len(rids)} answers differ from the reference: {wrong[:10]}"


def test_shared_prefixes_were_served_from_the_cache(load_run):
    # Over every ZeroMQ request (the DEALERs' and AsyncClient's): with pools far smaller than the
    # load, which requests find their prefix still cached depends on timing, not that some do.
    cached = 0
    for replies in load_run.recorded.values():
        last = replies[-1] if replies else None
        if isinstance(last, GenerateChunk) and last.usage is not None:
            cached += last.usage.cached_tokens.total
    for out in load_run.completions.values():
        if isinstance(out, Completion) and out.usage is not None:
            cached += out.usage.cached_tokens.total
    assert cached > 0


def test_pools_hold_only_free_and_cached_entries_after_the_drain(load_run):
    assert_nothing_leaked(load_run.stats)
