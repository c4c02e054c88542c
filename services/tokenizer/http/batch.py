"""Batched prompts on /v1/completions: `prompt` is a list of strings or of token-id lists.

Each prompt is its own request through the front door (so the scheduler batches them like any
others and each may hit the prefix cache); choice `index` is i * n + j for sample j of prompt i,
as OpenAI's. Usage is summed over the prompts (each prompt's samples count its prompt once).
All prompts are checked before any answer goes out: one refused prompt refuses the whole
request (the others are aborted). Streams interleave the prompts' chunks as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from himamba.common.messages import ErrorReply, GenerateChunk, GenerateRequest
from himamba.common.types import CachedTokens, Usage, combined_usage
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.http.responses import ResponseBuilder, usage_json
from himamba.services.tokenizer.local_clients import ReplyStream

OpenStream = Callable[[GenerateRequest], Awaitable[ReplyStream]]
ToError = Callable[[ErrorReply], ApiError]
WholeChunks = Callable[[ReplyStream, "GenerateChunk | None", int], Awaitable[list[GenerateChunk]]]


def summed_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of several prompts' requests: every count summed."""
    cached = CachedTokens(
        device=sum(u.cached_tokens.device for u in usages),
        host=sum(u.cached_tokens.host for u in usages),
        storage=sum(u.cached_tokens.storage for u in usages),
    )
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=cached,
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class BatchedCompletion:
    """One batched completions request: a stream and a builder per prompt."""

    def __init__(
        self,
        reqs: Sequence[GenerateRequest],
        builders: Sequence[ResponseBuilder],
        open_stream: OpenStream,
        to_error: ToError,
    ):
        self.reqs = list(reqs)
        self.builders = list(builders)
        self._open = open_stream
        self._to_error = to_error
        self.streams: list[ReplyStream] = []
        self.firsts: list[GenerateChunk | None] = []

    async def open(self) -> None:
        """Submit every prompt; raise the first refusal (after the rest were closed)."""
        for req in self.reqs:
            self.streams.append(await self._open(req))
        for i, stream in enumerate(self.streams):
            first = stream.ready_nowait()
            if isinstance(first, ErrorReply):
                err = self._to_error(first)
                param = "prompt" if err.param in (None, "input_ids") else err.param  # the body's name for it
                raise ApiError(err.status, f"prompt {i}: {err.message}", param=param, code=err.code)
            self.firsts.append(first)

    async def close(self) -> None:
        for stream in self.streams:
            await stream.close()

    async def whole(self, whole_chunks: WholeChunks) -> dict[str, Any]:
        """The non-streamed response: every prompt's choices, in index order, usage summed."""
        n = self.reqs[0].sampling.n
        gathered = await asyncio.gather(
            *(whole_chunks(s, f, n) for s, f in zip(self.streams, self.firsts, strict=True))
        )
        out: dict[str, Any] | None = None
        usages: list[Usage] = []
        for builder, chunks in zip(self.builders, gathered, strict=True):
            part = builder.whole(chunks)
            if out is None:
                out = part
            else:
                out["choices"].extend(part["choices"])
            done = [c.usage for c in sorted(chunks, key=lambda c: c.index) if c.usage is not None]
            if len(done) == len(chunks):
                usages.append(combined_usage(done))
        assert out is not None  # at least two prompts
        out.pop("prompt_token_ids", None)  # per prompt: each choice carries its own
        if len(usages) == len(self.builders):
            out["usage"] = usage_json(summed_usage(usages))
        else:
            out.pop("usage", None)
        return out

    async def write_stream(self, response: web.StreamResponse, include_usage: bool) -> None:
        """SSE events of every prompt as they come, then the summed usage chunk and [DONE]."""
        queue: asyncio.Queue[tuple[int, ErrorReply | GenerateChunk]] = asyncio.Queue()

        async def pump(i: int) -> None:
            reply: ErrorReply | GenerateChunk = self.firsts[i] or await self.streams[i].next()
            while True:
                await queue.put((i, reply))
                if isinstance(reply, ErrorReply):
                    return
                if reply.finished:
                    left[i] -= 1
                    if left[i] == 0:
                        return
                reply = await self.streams[i].next()

        left = [b.n for b in self.builders]
        pending = sum(left)
        usages: list[list[Usage | None]] = [[None] * b.n for b in self.builders]
        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.streams))]
        try:
            while pending:
                i, reply = await queue.get()
                if isinstance(reply, ErrorReply):
                    await response.write(_sse(self._to_error(reply).body()))
                    break
                event = self.builders[i].delta(reply, include_usage)
                if event is not None:
                    await response.write(_sse(event))
                if reply.finished:
                    usages[i][reply.index] = reply.usage
                    pending -= 1
            else:
                if include_usage and all(u is not None for per in usages for u in per):
                    per_prompt = [combined_usage([u for u in per if u is not None]) for per in usages]
                    await response.write(_sse(self.builders[0].usage_chunk(summed_usage(per_prompt))))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
