"""A running `himamba serve` streams exactly the greedy tokens of transformers (float32)."""

from __future__ import annotations

import asyncio

import pytest

from himamba.common.client import AsyncClient, Client
from himamba.services.modelgen.tokenizer_files import train_demo_tokenizer
from tests.e2e.prompts import random_tokens
from tests.worker.hf_reference import HF_VOCAB, greedy, load_reference, save_granite_hybrid, save_nemotron_h

PROMPT_LENS = [1, 7, 64, 300, 700]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["nemotron_h", "granite_hybrid"])
def served(request, tmp_path_factory, server_factory):
    d = tmp_path_factory.mktemp(request.param)
    (save_nemotron_h if request.param == "nemotron_h" else save_granite_hybrid)(d)
    train_demo_tokenizer(d, vocab_size=HF_VOCAB)
    server = server_factory(d, "--max-total-tokens", "16384", "--max-mamba-cache-size", "64")
    ref = load_reference(d)
    return server, ref


def test_greedy_tokens_equal_transformers(served):
    server, ref = served
    with Client(server.endpoint) as c:
        for i, n in enumerate(PROMPT_LENS):
            ids = random_tokens(n, seed=i, vocab=HF_VOCAB)
            out = c.generate(input_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert out.token_ids == greedy(ref, ids, NEW_TOKENS), f"prompt length {n}"
            assert out.finish_reason == "length"


def test_concurrent_requests_equal_one_by_one(served):
    server, ref = served
    prompts = [random_tokens(5 + 37 * i, seed=100 + i, vocab=HF_VOCAB) for i in range(8)]
    expected = [greedy(ref, p, 16) for p in prompts]

    async def run():
        async with AsyncClient(server.endpoint) as c:
            return await asyncio.gather(*(c.generate(input_ids=p, max_tokens=16, ignore_eos=True) for p in prompts))

    outs = asyncio.run(run())
    assert [o.token_ids for o in outs] == expected
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0
