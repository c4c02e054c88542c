"""The HTTP front door: OpenAI-compatible endpoints, /health and /metrics, on the tokenizer's loop.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}], GET /health
(200 only when every service is ready), GET /metrics (all services' metrics, one target),
POST /tokenize, POST /detokenize, GET /version (vLLM's; tokenize_routes.py); CORS in cors.py.
Every generation goes through the front door's own request path (`FrontDoor.open_stream`), so
HTTP and ZeroMQ clients behave the same; a client that disconnects aborts its request.
Errors use OpenAI's shape. With an API key set, every route requires `Authorization: Bearer <key>`
except /health and /metrics (probes and scrapers carry no key); two such headers that differ are a 400.
sglang's native routes (/generate, /server_info, /flush_cache, ...) are in sglang_routes.py, OpenAI's
Responses API (/v1/responses) in responses_routes.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec
from aiohttp import web
from tokenizers import Tokenizer

from himamba.common.config import Config, HttpConfig
from himamba.common.messages import ErrorReply, GenerateChunk, GenerateRequest
from himamba.common.metrics import HTTP_RESPONSES
from himamba.common.metrics_report import ServiceMetrics
from himamba.common.types import GrammarSpec, Usage, combined_usage
from himamba.services.tokenizer.generation_defaults import SamplingDefaults
from himamba.services.tokenizer.http.batch import BatchedCompletion
from himamba.services.tokenizer.http.bodies import (
    ChatBody,
    CompletionBody,
    CompletionPrompt,
    chat_logprobs_ask,
    chat_messages,
    check_completion,
    completion_prompts,
    decode_body,
    sampling_of,
)
from himamba.services.tokenizer.http.chat_parsing import ChatParsing
from himamba.services.tokenizer.http.chat_template import ChatTemplate
from himamba.services.tokenizer.http.connections import (
    ConnectionGuard,
    MalformedRequestFilter,
    connection_cap,
    read_body,
)
from himamba.services.tokenizer.http.cors import Cors
from himamba.services.tokenizer.http.errors import ApiError, reply_error
from himamba.services.tokenizer.http.logprobs_json import LogprobsAsk
from himamba.services.tokenizer.http.responses import Kind, ResponseBuilder
from himamba.services.tokenizer.http.responses_routes import ResponsesRoutes
from himamba.services.tokenizer.http.sglang_routes import ROUTES as SGLANG_ROUTES
from himamba.services.tokenizer.http.sglang_routes import SglangRoutes
from himamba.services.tokenizer.http.structured_outputs import check_constraint, grammar_field
from himamba.services.tokenizer.http.tokenize_routes import (
    DetokenizeBody,
    TokenizeBody,
    detokenize,
    render_chat,
    tokenize,
    version,
)
from himamba.services.tokenizer.local_clients import ReplyStream
from himamba.services.tokenizer.peers import Readiness
from himamba.services.tokenizer.tool_parsers.streaming import AnswerShaper

_ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/responses": "responses",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/version": "version",
    **SGLANG_ROUTES,  # sglang's native routes (sglang_routes.py)
}
# Open without the API key: probes and scrapers carry none.
_OPEN_ROUTES = ("/health", "/metrics")
_BYTES_PER_CONTEXT_TOKEN = 64  # body size limit: generous for text or JSON token ids of a full context
_SHUTDOWN_TIMEOUT_S = 2.0
# --access-log: client, request line, status, bytes, seconds, user agent (the log line has the time).
_ACCESS_FORMAT = '%a "%r" %s %b %Tfs "%{User-Agent}i"'


class FrontDoor(Protocol):
    """What the HTTP server needs from the tokenizer service."""

    cfg: Config
    model_name: str
    max_context_len: int
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    sampling_defaults: SamplingDefaults
    metrics: ServiceMetrics

    def readiness(self) -> Readiness: ...

    def metrics_text(self) -> str: ...

    async def open_stream(self, req: GenerateRequest) -> ReplyStream: ...

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """ValueError when `spec` does not build for this model (off the event loop, cached)."""
        ...

    def check_batch_reply_size(self, reqs: Sequence[GenerateRequest]) -> None:
        """ValueError when batched prompts' replies would carry more logprob entries in all than
        one request may (each prompt alone may be under the bound)."""
        ...


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _error_response(err: ApiError) -> web.Response:
    return _json(err.body(), err.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class ChatRequest(NamedTuple):
    """A chat body made into a request: what to generate, the logprobs it asks for, and the
    maker of its answer shaper (None: the answer is plain content)."""

    req: GenerateRequest
    ask: LogprobsAsk
    shaping: Callable[[], AnswerShaper] | None


class _Runner(web.AppRunner):
    """An AppRunner whose server is bounded by a ConnectionGuard."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self._guard.attach(server)
        return server


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class HttpServer:
    """aiohttp application bound to `cfg.host:cfg.port` on the running (uvloop) event loop."""

    def __init__(self, door: FrontDoor, cfg: HttpConfig, log: logging.Logger, reserved_fds: int = 0):
        """`reserved_fds`: descriptors the HTTP connection cap leaves to ZeroMQ clients."""
        self.door = door
        self.cfg = cfg
        self.log = log
        self._created = int(time.time())
        max_body = max(1 << 20, _BYTES_PER_CONTEXT_TOKEN * door.max_context_len)
        self.app = web.Application(client_max_size=max_body, middlewares=[self._middleware])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_get("/version", self.version)
        Cors(cfg.allowed_origins).install(self.app)
        SglangRoutes(door).add_routes(self.app.router)  # type: ignore[arg-type]  # door is the TokenizerService
        self.responses = ResponsesRoutes(self)  # /v1/responses (responses_routes.py)
        self.responses.add_routes(self.app.router)
        self._runner: web.AppRunner | None = None
        self.port = cfg.port
        self.guard = ConnectionGuard(connection_cap(cfg.max_connections, reserved_fds), cfg.request_timeout_s, log)
        self._malformed = MalformedRequestFilter(log)
        self._parsing: ChatParsing | None = None  # from the chat template, on first use
        self._parsing_template: ChatTemplate | None = None

    async def start(self) -> str:
        """Bind and serve; returns the base URL."""
        # handler_cancellation: a client that goes away cancels its handler, which aborts the request.
        access: dict[str, Any] = {"access_log": None}
        if self.cfg.access_log:  # --access-log: one line per request, in the tokenizer's log
            access = {"access_log": logging.getLogger("himamba.tokenizer.access"), "access_log_format": _ACCESS_FORMAT}
        if self.cfg.host not in _LOOPBACK and not self.cfg.api_key:
            self.log.warning(
                "HTTP listens on %s without an API key: anyone who can reach it can generate (set --api-key)",
                self.cfg.host,
            )
        logging.getLogger("aiohttp.server").addFilter(self._malformed)
        self._runner = _Runner(
            self.app,
            self.guard,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            keepalive_timeout=self.cfg.request_timeout_s,
            **access,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        return f"http://{self.cfg.host}:{self.cfg.port}"

    async def stop(self) -> None:
        await self.responses.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        logging.getLogger("aiohttp.server").removeFilter(self._malformed)

    # ------------------------------------------------------------ middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        route = _ROUTES.get(request.path, "models" if request.path.startswith("/v1/models/") else "other")
        self.guard.request_started(request.protocol)
        try:
            if request.path not in _OPEN_ROUTES:
                self._check_api_key(request)
            response = await handler(request)
        except ApiError as e:
            response = _error_response(e)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
            response = _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}", code=code))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away
        except Exception:  # a bug must cost one request: a JSON 500 that shows no internals
            self.log.error("%s %s failed\n%s", request.method, request.path, traceback.format_exc())
            response = _error_response(ApiError(500, "internal error (see the server log)", code="internal_error"))
        finally:
            self.guard.request_done(request.protocol)
        status = f"{min(max(response.status // 100, 2), 5)}xx"
        if status in ("2xx", "4xx", "5xx"):
            self.door.metrics[HTTP_RESPONSES].labels(route=route, status=status).inc()
        return response

    def _check_api_key(self, request: web.Request) -> None:
        if not self.cfg.api_key:
            return
        given = request.headers.getall("Authorization", [])
        if len(set(given)) > 1:
            # Judged by one of them, a proxy that judged the other would disagree with us. The same
            # header twice is no disagreement: sglang's router adds its own beside the client's.
            raise ApiError(400, "more than one Authorization header", code="invalid_api_key")
        header = given[0] if given else ""
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.cfg.api_key.encode()):
            raise ApiError(
                401, "invalid or missing API key (send `Authorization: Bearer <key>`)", code="invalid_api_key"
            )

    # ------------------------------------------------------------ simple routes

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.door.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "himamba",
            "max_model_len": self.door.max_context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        state = self.door.readiness()
        if state.ready:
            return _json({"status": "ok"})
        message = f"not ready: waiting for {', '.join(state.not_ready)}"
        raise ApiError(503, message, code="not_ready")

    async def metrics(self, request: web.Request) -> web.Response:
        # prometheus_client's text format 0.0.4
        return web.Response(
            body=self.door.metrics_text().encode("utf-8"),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body, _ = decode_body(await read_body(request, self.cfg.body_timeout_s), TokenizeBody)
        self._check_model(body.model)
        door = self.door
        return _json(tokenize(body, door.chat_template, door.tokenizer, door.max_context_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        body, _ = decode_body(await read_body(request, self.cfg.body_timeout_s), DetokenizeBody)
        self._check_model(body.model)
        return _json(detokenize(body, self.door.tokenizer, self.door.tokenizer.get_vocab_size(with_added_tokens=True)))

    async def version(self, request: web.Request) -> web.Response:
        return _json(version())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.door.model_name:
            raise ApiError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")

    # ------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, _ = decode_body(await read_body(request, self.cfg.body_timeout_s), CompletionBody)
        self._check_model(body.model)
        ask = check_completion(body)
        prompts = completion_prompts(body)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = sampling_of(body, body.max_tokens, ask.logprobs, self.door.sampling_defaults.values(), ask)
        await check_constraint(sampling.grammar, lambda: grammar_field(body), self.door.check_grammar)
        reqs, builders = [], []
        for i, prompt in enumerate(prompts):
            reqs.append(
                GenerateRequest(
                    rid=response_id, prompt=prompt.text, input_ids=prompt.token_ids, sampling=sampling, stream=body.stream
                )
            )
            builder = self._builder(
                "completion", response_id, body.return_token_ids, ask.logprobs, prompt.token_ids, body.n,
                ask=ask, tokens_as_ids=body.return_tokens_as_token_ids, index_base=i * body.n,
                echo_text=self._echo_text(prompt) if body.echo else None,
            )  # fmt: skip
            builders.append(builder)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        if len(reqs) == 1:
            return await self._serve(request, reqs[0], builders[0], include_usage)
        try:  # before any prompt is queued
            self.door.check_batch_reply_size(reqs)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        batch = BatchedCompletion(reqs, builders, self.door.open_stream, reply_error)
        return await self._serve_batch(request, batch, include_usage)

    def _echo_text(self, prompt: CompletionPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.door.tokenizer.decode(prompt.token_ids or [], skip_special_tokens=False)

    async def _serve_batch(
        self, request: web.Request, batch: BatchedCompletion, include_usage: bool
    ) -> web.StreamResponse:
        try:
            await batch.open()
            if not batch.reqs[0].stream:
                return _json(await batch.whole(self.whole_chunks))
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
            await response.prepare(request)
            try:
                await batch.write_stream(response, include_usage)
            except ConnectionResetError:
                pass  # the client went away: closing the streams aborts the requests
            return response
        finally:
            await batch.close()

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, _ = decode_body(await read_body(request, self.cfg.body_timeout_s), ChatBody)
        self._check_model(body.model)
        chat = await self.chat_request(body, f"chatcmpl-{uuid.uuid4().hex}")
        builder = self._builder(
            "chat", chat.req.rid, body.return_token_ids, body.logprobs, chat.req.input_ids, body.n,
            ask=chat.ask, tokens_as_ids=body.return_tokens_as_token_ids, shaping=chat.shaping,
        )  # fmt: skip
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await self._serve(request, chat.req, builder, include_usage)

    async def chat_request(self, body: ChatBody, rid: str, input_ids: list[int] | None = None) -> ChatRequest:
        """A chat body checked (its constraint built off the event loop), rendered by the chat
        template and tokenized (the Responses API builds its requests here too: `input_ids`, when
        given, are the prompt, which the rendered text must equal in meaning: a stored
        conversation extended token for token)."""
        messages = chat_messages(body)
        ask = chat_logprobs_ask(body)
        parsing = self._chat_parsing(self.door.chat_template)
        plan = parsing.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        text = render_chat(
            self.door.chat_template,
            self.door.max_context_len,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        # The template writes the special tokens itself (as HF's apply_chat_template does).
        if input_ids is None:
            input_ids = self.door.tokenizer.encode(text, add_special_tokens=False).ids
        if not input_ids:
            raise ApiError(400, "the chat template rendered an empty prompt", param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        own = sampling_of(body, max_tokens, body.logprobs, self.door.sampling_defaults.values(), ask)
        sampling = parsing.constrain(own, plan)
        field = (lambda: grammar_field(body)) if own.grammar is not None else (lambda: "tools")
        await check_constraint(sampling.grammar, field, self.door.check_grammar)
        req = GenerateRequest(rid=rid, input_ids=input_ids, sampling=sampling, stream=body.stream)
        return ChatRequest(req, ask, parsing.shaping(plan, body.tools, text))

    def _chat_parsing(self, template: ChatTemplate | None) -> ChatParsing:
        # Recomputed when the template is replaced in a running front door.
        if self._parsing is None or self._parsing_template is not template:
            self._parsing_template = template
            self._parsing = ChatParsing(self.cfg, template.source if template is not None else None)
            self.log.info(
                "chat answers: tool-call parser %s, reasoning parser %s",
                self._parsing.tool_parser or "none",
                self._parsing.reasoning_parser or "none",
            )
        return self._parsing

    def _builder(
        self,
        kind: Kind,
        response_id: str,
        return_token_ids: bool,
        logprobs: bool,
        prompt_ids: list[int] | None,
        n: int,
        **extra: Any,
    ) -> ResponseBuilder:
        return ResponseBuilder(
            kind,
            response_id=response_id,
            created=int(time.time()),
            model=self.door.model_name,
            tokenizer=self.door.tokenizer,
            return_token_ids=return_token_ids,
            logprobs=logprobs,
            prompt_token_ids=prompt_ids,
            n=n,
            **extra,
        )

    async def _serve(
        self, request: web.Request, req: GenerateRequest, builder: ResponseBuilder, include_usage: bool
    ) -> web.StreamResponse:
        stream = await self.door.open_stream(req)
        try:
            # Refusals (validation, prompt too long) are answered at once: a plain error status.
            first = stream.ready_nowait()
            if isinstance(first, ErrorReply):
                raise reply_error(first)
            if not req.stream:
                return _json(builder.whole(await self.whole_chunks(stream, first, req.sampling.n)))
            return await self._stream(request, stream, first, builder, include_usage)
        finally:
            await stream.close()

    async def whole_chunks(self, stream: ReplyStream, first: GenerateChunk | None, n: int) -> list[GenerateChunk]:
        """The one finished chunk of each of the `n` samples of a stream=False request."""
        chunks: list[GenerateChunk] = []
        reply: ErrorReply | GenerateChunk = first if first is not None else await stream.next()
        while True:
            if isinstance(reply, ErrorReply):
                raise reply_error(reply)
            assert reply.finished, "a stream=False request has one, finished, chunk per sample"
            chunks.append(reply)
            if len(chunks) == n:
                return chunks
            reply = await stream.next()

    async def _stream(
        self,
        request: web.Request,
        stream: ReplyStream,
        first: GenerateChunk | None,
        builder: ResponseBuilder,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            await self._write_events(response, stream, first, builder, include_usage)
        except ConnectionResetError:
            pass  # the client went away: closing the stream aborts the request
        return response

    async def _write_events(
        self,
        response: web.StreamResponse,
        stream: ReplyStream,
        first: GenerateChunk | None,
        builder: ResponseBuilder,
        include_usage: bool,
    ) -> None:
        reply = first if first is not None else await stream.next()
        usages: list[Usage | None] = [None] * builder.n  # by choice, once it finished
        unfinished = builder.n
        while True:
            if isinstance(reply, ErrorReply):
                # Headers are gone already: the error travels as an event, as OpenAI does.
                await response.write(_sse(reply_error(reply).body()))
                break
            for event in builder.deltas(reply, include_usage):
                await response.write(_sse(event))
            if reply.finished:
                usages[reply.index] = reply.usage
                unfinished -= 1
            if unfinished == 0:
                done = [u for u in usages if u is not None]
                if include_usage and len(done) == builder.n:
                    await response.write(_sse(builder.usage_chunk(combined_usage(done))))
                break
            reply = await stream.next()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
