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

