"""A grammar that takes the worker seconds to build stalls no one (turn 3's N4: a step waited
1.8-5.1 s for a build, freezing every stream). The front door queues a constrained request only
once the worker reports its grammar built (`GrammarReady`), so no step ever waits for a build;
streams running meanwhile keep receiving tokens. Shown by the worker's own record of waits and
by chunks counted while the grammar request was pending, not by timing."""

from __future__ import annotations

import asyncio
import json

from himamba.common.client import AsyncClient
from himamba.common.types import GrammarSpec
from tests.hostile.conftest import API_KEY, Hostile
from tests.http_request import http_request

PROPERTIES = 10_000  # a schema whose build takes the worker about 2 s on the demo vocabulary


def test_a_slow_grammar_build_never_holds_a_step(hostile: Hostile) -> None:
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(PROPERTIES)},
        "required": [f"p{i}" for i in range(PROPERTIES)],
    }
    grammar = GrammarSpec(kind="json_schema", spec=json.dumps(schema))

    async def scenario() -> tuple[int, list[int], int]:
        async with AsyncClient(hostile.endpoint, timeout_s=300, api_key=API_KEY) as c:
            pending = asyncio.Event()
            started: set[int] = set()
            during = 0

            async def victim(i: int) -> int:
                nonlocal during
                got = 0
                async for chunk in c.stream(input_ids=[30 + i, 31, 32], max_tokens=400, ignore_eos=True):
                    got += len(chunk.token_ids)
                    started.add(i)
                    if pending.is_set():
                        during += len(chunk.token_ids)
                return got

            victims = [asyncio.create_task(victim(i)) for i in range(4)]
            while len(started) < len(victims):  # the victims run before the grammar arrives
                await asyncio.sleep(0.05)
            pending.set()
            done = await c.generate(input_ids=[5, 6, 7], max_tokens=4, grammar=grammar)
            pending.clear()
            return len(done.token_ids), list(await asyncio.gather(*victims)), during

    constrained, victims, during = asyncio.run(scenario())
    assert constrained == 4
    assert victims == [400] * 4
    assert during > 0  # the streams went on while the grammar was built
    assert "for a grammar build" not in hostile.server.log()  # no step waited for one


TOOLS = 512  # each with a regex-heavy pattern: a 166 KB schema whose conversion held the worker's GIL


def test_512_regex_heavy_tools_stall_no_stream_and_the_worker_converts_nothing(hostile: Hostile) -> None:
    """The tools' grammar is checked and lowered in the front door's grammar process (off its event
    loop); the worker gets the lowered text and only compiles it (native, GIL-free) beside its steps.
    Shown by the stream chunks that arrive while the request is pending, the worker's log (no spec
    converted there, no step waited) and the front door answering /health throughout."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            "a": {"type": "array", "items": {"type": "object", "properties": {
                "b": {"type": "string", "pattern": "(a|b)*a(a|b){12}"}}}}}}}}
        for i in range(TOOLS)
    ]  # fmt: skip
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "tools": tools, "tool_choice": "required"}

    async def scenario() -> tuple[int, list[int], int, int]:
        async with AsyncClient(hostile.endpoint, timeout_s=300, api_key=API_KEY) as c:
            pending = asyncio.Event()
            started: set[int] = set()
            during = 0

            async def victim(i: int) -> int:
                nonlocal during
                got = 0
                async for chunk in c.stream(input_ids=[60 + i, 61, 62], max_tokens=300, ignore_eos=True):
                    got += len(chunk.token_ids)
                    started.add(i)
                    if pending.is_set():
                        during += len(chunk.token_ids)
                return got

            victims = [asyncio.create_task(victim(i)) for i in range(2)]
            while len(started) < len(victims):
                await asyncio.sleep(0.05)
            pending.set()
            tools_call = asyncio.ensure_future(asyncio.to_thread(hostile.post, "/v1/chat/completions", body))
            health = 0
            while not tools_call.done():  # the front door's loop answers while the grammar is handled
                if (await asyncio.to_thread(http_request, hostile.port, "GET", "/health")).status == 200:
                    health += 1
            r = await tools_call
            pending.clear()
            return r.status, list(await asyncio.gather(*victims)), during, health

    status, victims, during, health = asyncio.run(scenario())
    assert status == 200
    assert victims == [300] * 2
    assert during > 0 and health > 0  # streams and /health went on while the tools' grammar was handled
    log = hostile.server.log()
    assert "converted in the worker" not in log  # the worker compiled the front door's lowered text
    assert "for a grammar build" not in log  # no step waited for one
