"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A response is generated as a chat completion is (`HttpServer.chat_request`: template, tools,
grammar-enforced tool_choice and structured outputs, parsers), and shaped by responses_output.py.
With `store` (the default) it is kept in the front door's bounded `ResponseStore`; a request with
`previous_response_id` continues that conversation: its prompt is the stored conversation's items
(earlier inputs and outputs) followed by the new input, rendered by the chat template, so the
earlier turns are a prefix the prefix cache serves. As OpenAI's, `instructions` are not carried
over from the previous response. An unknown id is a 404 naming it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from himamba.common.messages import ErrorReply, GenerateChunk
from himamba.services.tokenizer.http.bodies import decode_body
from himamba.services.tokenizer.http.connections import read_body
from himamba.services.tokenizer.http.errors import ApiError, reply_error
from himamba.services.tokenizer.http.response_store import ResponseStore
from himamba.services.tokenizer.http.responses_body import (
    ResponsesBody,
    chat_body_of,
    chat_messages_of_items,
    check_refused,
    input_items,
)
from himamba.services.tokenizer.http.responses_output import ResponseOutput, item_id, responses_usage
from himamba.services.tokenizer.local_clients import ReplyStream
from himamba.services.tokenizer.tool_parsers.streaming import AnswerShaper

if TYPE_CHECKING:
    from himamba.services.tokenizer.http.server import HttpServer

_MIB = 1 << 20
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


class _Answer:
    """One response being generated: its chat answer shaper (or plain text) and its output."""

    def __init__(self, shaper: AnswerShaper | None):
        self.shaper = shaper
        self.output = ResponseOutput()
        self.chunk: GenerateChunk | None = None  # the last one: finish reason and usage

    def feed(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        self.chunk = chunk
        if self.shaper is None:
            deltas = [{"content": chunk.text}]
        else:
            deltas = self.shaper.feed(chunk.text)
            if chunk.finished:
                deltas += self.shaper.finish()
        events = self.output.feed(deltas)
        if chunk.finished:
            events += self.output.finish()
        return events


class ResponsesRoutes:
    """The Responses API routes and the stored responses, served by one `HttpServer`."""

    def __init__(self, server: HttpServer):
        self.server = server
        cfg = server.cfg
        self.store = ResponseStore(cfg.responses_store_max, cfg.responses_store_mib * _MIB)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.retrieve)
        router.add_delete("/v1/responses/{response_id}", self.delete)

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        found = self.store.get(response_id)
        if found is None:
            raise _not_found(response_id)
        return _json(found.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        body, _ = decode_body(await read_body(request, server.cfg.body_timeout_s), ResponsesBody)
        server._check_model(body.model)
        check_refused(body)
        items: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise ApiError(
                    404, f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id", code="not_found",
                )  # fmt: skip
            items = list(previous.items)
        new_items = input_items(body.input)
        conversation = items + new_items
        response_id = item_id("resp")
        chat = server.chat_request(chat_body_of(body, chat_messages_of_items(conversation)), response_id)
        answer = _Answer(chat.shaping() if chat.shaping is not None else None)
        response = self._response(body, response_id, chat.req.sampling.temperature, chat.req.sampling.top_p)
        stream = await server.door.open_stream(chat.req)
        try:
            first = stream.ready_nowait()
            if isinstance(first, ErrorReply):
                raise reply_error(first)
            if not body.stream:
                (chunk,) = await server.whole_chunks(stream, first, 1)
                answer.feed(chunk)
                self._finish(response, answer, conversation)
                return _json(response)
            return await self._stream(request, stream, first, answer, response, conversation)
        finally:
            await stream.close()

    def _response(self, body: ResponsesBody, response_id: str, temperature: float, top_p: float) -> dict[str, Any]:
        """The Response object before any output (status in_progress)."""
        text = body.text if body.text is not None and body.text.get("format") else {"format": {"type": "text"}}
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.server.door.model_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store and self.store.max_count > 0,
            "temperature": temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "top_p": top_p,
            "truncation": body.truncation,
            "usage": None,
            "user": None,
            "metadata": body.metadata or {},
        }

    def _finish(self, response: dict[str, Any], answer: _Answer, conversation: list[dict[str, Any]]) -> None:
        """`response` completed (or incomplete) from its answer; stored when asked."""
        chunk = answer.chunk
        assert chunk is not None and chunk.finished, "a response finishes with its last chunk"
        response["output"] = answer.output.items
        if chunk.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        if chunk.usage is not None:
            reasoning = answer.output.reasoning_text
            tokens = len(self.server.door.tokenizer.encode(reasoning, add_special_tokens=False).ids) if reasoning else 0
            response["usage"] = responses_usage(chunk.usage, tokens)
        if response["store"]:
            response["store"] = self.store.put(response["id"], response, conversation + answer.output.items)

    async def _stream(
        self,
        request: web.Request,
        stream: ReplyStream,
        first: GenerateChunk | None,
        answer: _Answer,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers=_SSE_HEADERS)
        await out.prepare(request)
        output = answer.output
        try:
            await out.write(_sse(output.event("response.created", response=dict(response))))
            await out.write(_sse(output.event("response.in_progress", response=dict(response))))
            reply = first if first is not None else await stream.next()
            while True:
                if isinstance(reply, ErrorReply):
                    # Headers are gone already: the error travels as events, as OpenAI's.
                    err = reply_error(reply)
                    await out.write(_sse(output.event("error", code=err.code, message=err.message, param=err.param)))
                    response.update(status="failed", error={"code": err.code or "server_error", "message": err.message})
                    await out.write(_sse(output.event("response.failed", response=response)))
                    break
                for event in answer.feed(reply):
                    await out.write(_sse(event))
                if reply.finished:
                    self._finish(response, answer, conversation)
                    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                    await out.write(_sse(output.event(kind, response=response)))
                    break
                reply = await stream.next()
            await out.write_eof()
        except ConnectionResetError:
            pass  # the client went away: closing the stream aborts the request
        return out
