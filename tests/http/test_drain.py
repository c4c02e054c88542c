"""The front door's drain: new requests are refused at once, running ones may finish, and
whatever is left when the bound passes is answered 503 (in-process, no sockets to peers needed)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from himamba.common import config as config_mod
from himamba.common.messages import ErrorReply, GenerateChunk, GenerateRequest, TokenBatch, TokenOut
from himamba.common.types import SamplingParams
from himamba.services.tokenizer.service import TokenizerService


def _service(model_dir: Path) -> TokenizerService:
    tag = uuid.uuid4().hex[:12]
    eps = ("zmq_endpoint", "tokenizer_ipc", "scheduler_ipc", "worker_ipc", "cache_ipc", "control_ipc")
    cfg = config_mod.load(
        overrides={
            "model": {"model": str(model_dir)},
            "endpoints": {n: f"ipc://@himamba-test-{tag}-{n}" for n in eps},
            "http": {"port": 0},
            "log": {"level": "warning"},
        }
    )
    return TokenizerService(cfg)


def test_drain_refuses_new_requests_and_waits_for_running_ones(model_dir: Path):
    async def scenario() -> None:
        svc = _service(model_dir)
        await svc.start()
        try:
            req = GenerateRequest(rid="a", prompt="hello", sampling=SamplingParams(max_tokens=4), stream=False)
            running = await svc.open_stream(req)
            (entry,) = svc.table.entries()
            drain = asyncio.get_running_loop().create_task(svc.drain(timeout_s=30))
            await asyncio.sleep(0.1)
            assert not drain.done()  # a request is still running
            assert not svc.readiness().ready
            refused = await svc.open_stream(GenerateRequest(rid="b", prompt="late"))
            reply = refused.ready_nowait()
            assert isinstance(reply, ErrorReply) and reply.code == 503
            out = TokenOut(rid=entry.rid, token_ids=[5], finish_reason="length", prompt_tokens=1, completion_tokens=1)
            await svc.handle(TokenBatch(outs=[out]), [])
            await asyncio.wait_for(drain, 5)
            final = await running.next()
            assert isinstance(final, GenerateChunk) and final.finished and final.finish_reason == "length"
        finally:
            await svc.stop()
            svc.ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_stop_answers_what_the_drain_left_with_503(model_dir: Path):
    async def scenario() -> None:
        svc = _service(model_dir)
        await svc.start()
        try:
            stream = await svc.open_stream(GenerateRequest(rid="c", prompt="never finishes"))
            await svc.drain(timeout_s=0.2)
            assert len(svc.table) == 1
        finally:
            await svc.stop()
            svc.ctx.destroy(linger=0)
        assert len(svc.table) == 0
        reply = await asyncio.wait_for(stream.next(), 1)
        assert isinstance(reply, ErrorReply) and reply.code == 503

    asyncio.run(scenario())
