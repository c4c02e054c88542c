"""Clients that keep everything the server sent: a raw ZeroMQ DEALER speaking the documented wire
protocol (every reply recorded by rid, so a lost, late or duplicated reply is visible), and a
streaming OpenAI `/v1/completions` client over HTTP (server-sent events)."""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any, NamedTuple

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from himamba.common.messages import ClientReply, ErrorReply, GenerateChunk, GenerateRequest
from himamba.common.types import SamplingParams


def is_final(reply: ClientReply) -> bool:
    return isinstance(reply, ErrorReply) or reply.finished


class RecordingDealer:
    """One DEALER connection; any number of requests in flight. `replies[rid]` holds every reply
    naming `rid`, in arrival order, including any that come after the final one."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replies: dict[str, list[ClientReply]] = collections.defaultdict(list)
        self.sent: list[str] = []
        self._final: dict[str, asyncio.Event] = {}
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        self._encoder = msgspec.msgpack.Encoder()
        self._reader: asyncio.Task[None] | None = None

    async def send(self, req: GenerateRequest) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._final[req.rid] = asyncio.Event()
        self.sent.append(req.rid)
        await self.sock.send(self._encoder.encode(req))

    async def send_raw(self, frames: list[bytes]) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        await self.sock.send_multipart(frames)

    async def wait_final(self, rid: str, timeout_s: float = 60.0) -> list[ClientReply]:
        await asyncio.wait_for(self._final[rid].wait(), timeout_s)
        return self.replies[rid]

    async def generate(
        self, rid: str, input_ids: list[int], max_tokens: int, *, stream: bool = True, timeout_s: float = 60.0
    ) -> list[ClientReply]:
        """Greedy, ignore_eos: exactly `max_tokens` tokens are due."""
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        await self.send(GenerateRequest(rid=rid, input_ids=input_ids, sampling=sampling, stream=stream))
        return await self.wait_final(rid, timeout_s)

    async def _read(self) -> None:
        while True:
            payload = await self.sock.recv()
            reply = self._decoder.decode(payload)
            self.replies[reply.rid].append(reply)
            if is_final(reply) and reply.rid in self._final:
                self._final[reply.rid].set()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self.sock.close(linger=0)


def token_ids_of(replies: list[ClientReply]) -> list[int]:
    return [t for r in replies if isinstance(r, GenerateChunk) for t in r.token_ids]


class HttpOutcome(NamedTuple):
    """What one streamed /v1/completions call returned."""

    status: int
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any] | None
    saw_done: bool
    error: dict[str, Any] | None


async def http_stream_completion(
    session: aiohttp.ClientSession, base_url: str, input_ids: list[int], max_tokens: int, *, stop_after: int = 0
) -> HttpOutcome:
    """Stream a greedy, ignore_eos completion of token ids. With `stop_after` > 0 the connection
    is dropped once that many tokens have arrived (a client going away mid-stream)."""
    body = {
        "prompt": input_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    ids: list[int] = []
    finish: str | None = None
    usage: dict[str, Any] | None = None
    done = False
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return HttpOutcome(resp.status, [], None, None, False, (await resp.json()).get("error"))
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return HttpOutcome(resp.status, ids, finish, usage, False, event["error"])
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage = event["usage"]
            if stop_after and len(ids) >= stop_after:
                resp.close()  # drop the connection mid-stream
                break
    return HttpOutcome(200, ids, finish, usage, done, None)
