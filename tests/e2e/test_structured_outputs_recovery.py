"""Structured outputs through the ZeroMQ client, and a matcher that survives retraction: requests
retracted under KV pressure are recomputed from their tokens (a reset sequence gets its history
and the worker rebuilds its matcher), and their output still matches the grammar exactly."""

from __future__ import annotations

import asyncio
import re

import pytest

from himamba.common.client import AsyncClient, Client, HimambaError
from himamba.common.types import GrammarSpec
from tests.e2e.prompts import random_tokens

PAGE = 16
DIGITS = r"[0-9]{100}"  # 50 to 100 tokens with the demo vocabulary: enough to be retracted mid-way


def test_constrained_requests_retracted_under_memory_pressure_still_match(server_factory, model_dir):
    # Six samples of one request are admitted together, on 16 pages of KV: their shared prompt (6
    # pages) and six answers of 50 to 100 tokens outgrow the pool, so decode must retract whenever
    # the request arrives (six separate requests could arrive spread out on a loaded machine and
    # run one after another, which once left nothing to retract).
    server = server_factory(
        model_dir, "--max-total-tokens", "256", "--max-context-len", "256", "--max-mamba-cache-size", "24",
        "--mamba-track-interval", str(PAGE),
    )  # fmt: skip
    prompt = random_tokens(90, seed=700)
    grammar = GrammarSpec(kind="regex", spec=DIGITS)

    async def run():
        async with AsyncClient(server.endpoint) as c:
            return await c.generate_n(input_ids=prompt, n=6, max_tokens=110, temperature=1.0, seed=1, grammar=grammar)

    outs = asyncio.run(run())
    assert "retracting" in server.log()
    for o in outs:
        assert re.fullmatch(DIGITS, o.text), o.text
        assert o.finish_reason == "stop"
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0


@pytest.fixture(scope="module")
def plain_server(server_factory, model_dir):
    return server_factory(model_dir)


def test_zeromq_requests_take_a_grammar_and_an_invalid_one_is_a_400(plain_server):
    with Client(plain_server.endpoint) as c:
        out = c.generate("answer: ", max_tokens=20, grammar=GrammarSpec(kind="choice", spec='["yes", "no"]'))
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        for bad, why in [
            (GrammarSpec(kind="regex", spec="a(b"), "unclosed group"),
            (GrammarSpec(kind="json_schema", spec='{"type": 3}'), "grammar:"),
            (GrammarSpec(kind="choice", spec='"yes"'), "list of strings"),
            (GrammarSpec(kind="ebnf", spec="root ::= nothing"), "nothing"),
        ]:
            with pytest.raises(HimambaError) as err:
                c.generate("x", max_tokens=5, grammar=bad)
            assert err.value.code == 400 and err.value.message.startswith("grammar:") and why in err.value.message
        # The server kept serving.
        assert c.generate("x", max_tokens=3, ignore_eos=True).finish_reason == "length"
