"""Admission checks before it acts, on a running server: a waiting head that does not fit evicts
nothing (the cached prefixes it does not need stay on device, and a repeat of one is a device
hit), and each request's cache lookup is counted once in the hit metrics, however often its
admission was retried."""

from __future__ import annotations

import asyncio
import time

from himamba.common.client import AsyncClient
from tests.e2e.prompts import random_tokens
from tests.live_server import start_live_server
from tests.scrape import samples
from tests.worker.hf_reference import greedy

PAGE = 16
QUERY = "himamba_cache_query_tokens_total"


def _query_tokens(server) -> float:
    return samples(server.get("/metrics").body.decode()).get(QUERY, 0.0)


def _wait_metric(server, want: float, timeout_s: float = 20.0) -> float:
    """The query-token counter once the cache controller's next report has it."""
    deadline = time.monotonic() + timeout_s
    got = _query_tokens(server)
    while got < want and time.monotonic() < deadline:
        time.sleep(0.2)
        got = _query_tokens(server)
    return got


def test_a_head_that_does_not_fit_evicts_nothing_and_is_counted_once(model_dir, ref, tmp_path):
    # 32 pages of KV (512 tokens). Two cached prompts (A, B) and a long decode (L) that holds most
    # pages; the head (H) needs more than is free or evictable while L runs, so it waits. It gets
    # in only when L is aborted and frees its pages: nothing cached is evicted for it, ever.
    server = start_live_server(
        model_dir, tmp_path, "--max-total-tokens", "512", "--max-context-len", "512",
        "--max-mamba-cache-size", "32", "--mamba-track-interval", str(PAGE), "--no-enable-hierarchical-cache",
    )  # fmt: skip
    try:
        a, b = random_tokens(40, 701), random_tokens(40, 702)
        long_prompt = random_tokens(8, 703)
        prompts_served = 0

        async def run() -> None:
            nonlocal prompts_served
            async with AsyncClient(server.endpoint) as c:
                for p in (a, b):
                    out = await c.generate(input_ids=p, max_tokens=4, ignore_eos=True)
                    assert out.token_ids == greedy(ref, p, 4)
                    prompts_served += len(p)
                cached = server.cache_stats()
                assert cached.cached_pages >= 4

                stream = c.stream(input_ids=long_prompt, max_tokens=300, ignore_eos=True, rid="long").__aiter__()
                seen = 0
                while seen < 200:
                    seen += len((await stream.__anext__()).token_ids)
                prompts_served += len(long_prompt)
                st = server.cache_stats()
                # More than is free plus everything cached (all of it unlocked: L shares nothing).
                need_pages = st.free_pages + st.cached_pages + 1
                head = random_tokens(need_pages * PAGE - 8, 704)
                steps = st.cache_steps
                head_task = asyncio.ensure_future(c.generate(input_ids=head, max_tokens=2, ignore_eos=True))
                while server.cache_stats().cache_steps < steps + 3:  # the head was tried (and refused)
                    await asyncio.sleep(0.05)
                during = server.cache_stats()
                assert during.running_requests == 1 and not head_task.done()
                assert during.cached_pages == st.cached_pages, "a refused admission evicted cached prefixes"
                await c.abort("long")
                async for _ in stream:  # drain L's end
                    pass
                out = await head_task
                prompts_served += len(head)
                assert out.token_ids == greedy(ref, head, 2)
                assert out.usage.cached_tokens.total == 0
                # A and B were never evicted for the head: a repeat of A is a device hit.
                again = await c.generate(input_ids=a, max_tokens=4, ignore_eos=True)
                prompts_served += len(a)
                assert again.usage.cached_tokens.device >= 32
                assert again.token_ids == greedy(ref, a, 4)

        asyncio.run(run())
        # Each served request's lookup counted once (the head's refused attempts not at all).
        assert _wait_metric(server, prompts_served) == prompts_served
        stats = server.cache_stats()
        assert stats.invariants_ok, stats.invariants_error
        assert stats.running_requests == 0
    finally:
        server.stop()
