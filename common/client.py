"""The himamba client: `Client` (blocking) and `AsyncClient` (asyncio) over ZeroMQ.

Wire protocol
=============
The server binds a ZeroMQ ROUTER socket at its client endpoint (`[endpoints] zmq_endpoint`;
by default the unix socket `client.sock` in the server instance's private runtime directory,
e.g. `/run/himamba/port-30000/client.sock` for root or `$XDG_RUNTIME_DIR/himamba/port-30000/
client.sock`, which only the server's user can reach: `find_endpoint(port=...)` or
`find_endpoint(instance=...)` computes it; the server prints it when ready). A client connects a DEALER
(or anything speaking to a ROUTER) and exchanges single-frame messages; the ROUTER adds and
strips the identity frame, so a DEALER sees only the payload frame. Many requests may be in
flight on one connection: every reply names the request it belongs to (`rid`).

Each payload is one MessagePack **map**. Its `"type"` key names the message; every other key is a
field. Fields left out take their defaults; unknown keys are refused.

Client -> server (`ClientRequest`):

- ``{"type": "GenerateRequest", "rid": str, "prompt": str | nil, "input_ids": [int] | nil,
  "sampling": {...}, "stream": bool}``: exactly one of `prompt` / `input_ids`. `rid` is chosen
  by the client, unique among its in-flight requests on this connection (empty: the server
  picks one). `sampling` (all optional; `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`
  left out of the map take the checkpoint's generation_config.json values, as HTTP requests do, and
  `Client` sends every field): `max_tokens` (int | nil: server default, else up to the context length),
  `temperature` (0 = greedy), `top_p`, `top_k` (0 = off), `min_p`, `seed`, `stop` ([str]),
  `stop_token_ids` ([int]), `ignore_eos`, `repetition_penalty`, `frequency_penalty`,
  `presence_penalty`, `n` (samples of the prompt, 1 to 16; sample i uses `seed` + i when a seed
  is given), `logprobs` (bool), `top_logprobs` (int: alternatives per generated token, with
  `logprobs`), `prompt_logprobs` (int | nil: the prompt tokens' logprobs with that many
  alternatives; such a request skips the prefix cache), `grammar` (structured outputs:
  ``{"kind": "json_schema" | "json_object" | "regex" | "choice" | "ebnf", "spec": str}``, the
  schema as JSON text, the choices as a JSON list; an invalid one is a 400), `logit_bias` ({int: float}: at
  most 300 token ids, each bias in -100..100). `api_key` (str): required when the server was started with
  `--api-key` (the same key HTTP clients send as a Bearer token); a request without it is
  answered by an ErrorReply with code 401. `rid` is at most 256 characters. A tcp:// client
  endpoint is either CURVE-encrypted with an allow-list of client keys (`CurveKeys`) or marked
  insecure by the operator.
- ``{"type": "AbortGenerate", "rid": str}``: give up on a request (only this connection's own).

Server -> client (`ClientReply`):

- ``{"type": "GenerateChunk", "rid", "text", "token_ids", "finished", "finish_reason",
  "usage", "logprobs", "prompt_token_ids", "index", "top_logprobs", "prompt_logprobs"}``: with `stream` true, one chunk per step
  carrying the *new* text and token ids; with `stream` false, one chunk with everything. The last
  chunk has `finished` true, `finish_reason` one of "stop" (eos, stop token or stop string; a
  stop string is not included in the text), "length", "abort", and `usage` =
  ``{"prompt_tokens", "completion_tokens", "cached_tokens": {"device", "host", "storage"}}``
  (prompt tokens served from each cache tier). `prompt_token_ids` comes on the first chunk when
  the prompt was text. `index` says which sample (0 .. n-1) a chunk belongs to: with `n` > 1 the
  samples' chunks interleave and the request is over after one finished chunk per sample. Each
  sample's usage is its own (the siblings of sample 0 report the prompt tokens they found in
  the cache); `combined_usage` in `common/types.py` counts the prompt once. `top_logprobs` (one
  `[logprob, top_ids, top_logprobs, rank]` per token) and `prompt_logprobs` (the same, for prompt
  tokens 1.., on the first chunk of sample 0) come when asked for; logprobs are the model's raw
  log-softmax, before penalties and temperature.
- ``{"type": "ErrorReply", "message": str, "rid": str, "code": int}``: the request was refused
  or failed (400 bad input, 401 missing or wrong api_key, 404 unknown rid, 409 rid in flight,
  500 server error, 503 shutting down). `rid` is "" when the payload could not be read at all. An error ends the whole request,
  all its samples. An abort is answered by a final chunk with `finish_reason` "abort" for each
  sample still running.

Example (plain msgpack, any language)::

    import msgpack, zmq
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect("ipc:///run/himamba/port-30000/client.sock")  # see find_endpoint
    sock.send(msgpack.packb({"type": "GenerateRequest", "rid": "1", "prompt": "def f(x):",
                             "sampling": {"max_tokens": 16}}))
    while True:
        reply = msgpack.unpackb(sock.recv())
        print(reply["text"], end="")
        if reply["type"] == "ErrorReply" or reply["finished"]:
            break
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Generator, Mapping
from typing import NamedTuple, TypedDict, Unpack

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from himamba.common.messages import (
    AbortGenerate,
    ClientReply,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    TokenLogprobs,
)
from himamba.common.runtime_dir import client_endpoint
from himamba.common.types import FinishReason, GrammarSpec, SamplingParams, Usage

_log = logging.getLogger("himamba.client")

_CLOSED_CODE = 499  # ErrorReply code used locally when the client is closed under a waiting request


class HimambaError(Exception):
    """The server refused or failed a request (an `ErrorReply`)."""

    def __init__(self, message: str, code: int = 500, rid: str = ""):
        super().__init__(f"[{code}] {message}")
        self.message = message
        self.code = code
        self.rid = rid


class Completion(NamedTuple):
    """A finished request (or one sample, `index`, of an n > 1 request)."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: Usage | None  # prompt/completion tokens and cached tokens by tier
    prompt_token_ids: list[int] | None
    logprobs: list[float] | None = None
    index: int = 0
    top_logprobs: list[TokenLogprobs] | None = None  # sampling.top_logprobs > 0: one per token
    prompt_logprobs: list[TokenLogprobs] | None = None  # sampling.prompt_logprobs: prompt tokens 1..
    # finish "stop": the stop string or stop token id (None for EOS), and the same or the EOS id
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of `generate` / `stream` (see `make_request`)."""

    input_ids: list[int] | None
    rid: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int | None
    grammar: GrammarSpec | None
    logit_bias: dict[int, float] | None


def make_request(
    prompt: str | None = None,
    *,
    stream: bool = True,
    input_ids: list[int] | None = None,
    rid: str | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logprobs: bool = False,
    n: int = 1,
    top_logprobs: int = 0,
    prompt_logprobs: int | None = None,
    grammar: GrammarSpec | None = None,
    logit_bias: dict[int, float] | None = None,
) -> GenerateRequest:
    """Build a GenerateRequest (a fresh rid when none is given). Ranges are checked by the server."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("exactly one of prompt and input_ids must be given")
    if isinstance(stop, str):
        stop = [stop]
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        logit_bias=dict(logit_bias or {}),
    )
    return GenerateRequest(
        rid=rid or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=None if input_ids is None else list(input_ids),
        sampling=sampling,
        stream=stream,
    )


class CompletionBuilder:
    """Folds the chunks of one request (or of one sample of it) into a Completion."""

    def __init__(self, rid: str, index: int = 0):
        self._rid = rid
        self._index = index
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[float] | None = None
        self._top: list[TokenLogprobs] | None = None
        self._prompt_logprobs: list[TokenLogprobs] | None = None
        self._prompt_ids: list[int] | None = None
        self._reason: FinishReason | None = None
        self._usage: Usage | None = None
        self._stopped: tuple[int | str | None, int | str | None] = (None, None)

    def add(self, chunk: GenerateChunk) -> None:
        self._text.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(chunk.logprobs)
        if chunk.top_logprobs is not None:
            self._top = (self._top or []) + list(chunk.top_logprobs)
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.prompt_token_ids is not None:
            self._prompt_ids = list(chunk.prompt_token_ids)
        if chunk.finished:
            self._reason = chunk.finish_reason
            self._usage = chunk.usage
            self._stopped = (chunk.stop_reason, chunk.matched_stop)

    def build(self) -> Completion:
        return Completion(
            self._rid,
            "".join(self._text),
            self._ids,
            self._reason,
            self._usage,
            self._prompt_ids,
            self._logprobs,
            self._index,
            self._top,
            self._prompt_logprobs,
            *self._stopped,
        )


class SamplesBuilder:
    """Folds the interleaved chunks of an n-sample request into its Completions, by index."""

    def __init__(self, rid: str, n: int):
        self._builders = [CompletionBuilder(rid, i) for i in range(n)]

    def add(self, chunk: GenerateChunk) -> None:
        if not (0 <= chunk.index < len(self._builders)):
            raise HimambaError(
                f"reply for sample {chunk.index} of a {len(self._builders)}-sample request", rid=chunk.rid
            )
        self._builders[chunk.index].add(chunk)

    def build(self) -> list[Completion]:
        return [b.build() for b in self._builders]


def _check_single(options: Mapping[str, object]) -> None:
    if options.get("n", 1) != 1:
        raise ValueError("n: generate() returns one completion; use generate_n() for n > 1")


class CurveKeys(NamedTuple):
    """CURVE for a server whose client endpoint is tcp:// with CURVE on: the server's public key
    file and this client's key pair (zmq.auth's certificate files); the server must list this
    client's public key."""

    server_public_key_file: str
    client_secret_key_file: str

    def apply(self, sock: zmq.Socket) -> None:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(self.server_public_key_file)
        public, secret = zmq.auth.load_certificate(self.client_secret_key_file)
        if secret is None:
            raise ValueError(f"{self.client_secret_key_file} holds no secret key")
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret


def find_endpoint(endpoint: str | None = None, *, port: int = 0, instance: str = "") -> str:
    """The client endpoint: `endpoint` as given, else the server named by `instance` or by its
    HTTP `port` (default: the default port's), in this user's runtime directory."""
    if endpoint:
        return endpoint
    return client_endpoint(instance=instance, port=port)


def _raise_if_error(reply: ClientReply) -> GenerateChunk:
    if isinstance(reply, ErrorReply):
        raise HimambaError(reply.message, reply.code, reply.rid)
    return reply


def _connection_event(raw: list[bytes]) -> bool | None:
    """True for 'connected', False for 'disconnected', None for other monitor events."""
    event = parse_monitor_message(raw)["event"]
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return True
    if event == zmq.EVENT_DISCONNECTED:
        return False
    return None


class _ReplyCount:
    """When a request's reply stream is over: at an error, or after one finished chunk per sample.
    `done` stays False while the caller may still owe the server an abort."""

    def __init__(self, num_samples: int) -> None:
        self.unfinished = num_samples
        self.done = False

    def chunk(self, reply: ClientReply) -> GenerateChunk:
        """The chunk of `reply` (raises HimambaError for an ErrorReply, which ends the stream)."""
        if isinstance(reply, ErrorReply):
            self.done = True  # the server already ended it: nothing to abort
        chunk = _raise_if_error(reply)
        if chunk.finished:
            self.unfinished -= 1
        self.done = self.unfinished == 0
        return chunk


class Client:
    """Blocking client on one DEALER connection. Not thread-safe; several streams may interleave.

    `timeout_s` bounds each wait for the next reply (None: wait forever); on expiry the request
    is aborted and TimeoutError raised.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_s: float | None = 600,
        *,
        port: int = 0,
        instance: str = "",
        api_key: str = "",
        curve: CurveKeys | None = None,
    ):
        self.endpoint = find_endpoint(endpoint, port=port, instance=instance)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)
        self._connected = False
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: dict[str, collections.deque[ClientReply]] = {}
        self._closed = False

    # ------------------------------------------------------------ public

    def wait_connected(self, timeout_s: float = 3.0) -> bool:
        """Whether a server is there: True once the connection handshake succeeded within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain_monitor(0)
            if self._connected:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._drain_monitor(remaining)
            if self._connected:
                return True

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """Run one request to the end and return it whole. Raises HimambaError on an ErrorReply."""
        _check_single(options)
        req = make_request(prompt, stream=False, **options)
        builder = CompletionBuilder(req.rid)
        for chunk in self._run(req):
            builder.add(chunk)
        return builder.build()

    def generate_n(self, prompt: str | None = None, *, n: int, **options: Unpack[GenerateOptions]) -> list[Completion]:
        """Run one request for `n` samples of the prompt; their Completions by index. The
        samples share the prompt's cache; with a `seed`, sample i uses seed + i."""
        req = make_request(prompt, stream=False, n=n, **options)
        builder = SamplesBuilder(req.rid, n)
        for chunk in self._run(req):
            builder.add(chunk)
        return builder.build()

    def stream(
        self, prompt: str | None = None, *, n: int = 1, **options: Unpack[GenerateOptions]
    ) -> Generator[GenerateChunk, None, None]:
        """Send a request now; iterate its chunks (deltas; with `n` > 1 the samples' chunks
        interleave, told apart by `index`). Closing the iterator early aborts it."""
        req = make_request(prompt, stream=True, n=n, **options)
        return self._run(req)

    def abort(self, rid: str) -> None:
        """Ask the server to abort `rid`; its stream then ends with finish_reason "abort"."""
        self._send(AbortGenerate(rid=rid))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ machinery

    def _send(self, msg: GenerateRequest | AbortGenerate) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        if self.api_key and isinstance(msg, GenerateRequest):
            msg = msgspec.structs.replace(msg, api_key=self.api_key)
        self._sock.send(self._encoder.encode(msg))

    def _run(self, req: GenerateRequest) -> Generator[GenerateChunk, None, None]:
        if req.rid in self._pending:
            raise ValueError(f"rid {req.rid!r} is already in flight on this client")
        self._pending[req.rid] = collections.deque()
        self._send(req)
        return self._iterate(req.rid, req.sampling.n)

    def _iterate(self, rid: str, n: int) -> Generator[GenerateChunk, None, None]:
        replies = _ReplyCount(n)
        try:
            while not replies.done:
                yield replies.chunk(self._next_reply(rid))
        finally:
            self._pending.pop(rid, None)
            if not replies.done and not self._closed:
                self._send(AbortGenerate(rid=rid))

    def _next_reply(self, rid: str) -> ClientReply:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        queue = self._pending[rid]
        while not queue:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms):
                raise TimeoutError(f"no reply for {rid!r} from {self.endpoint} within {self.timeout_s}s")
            self._route(self._sock.recv())
        return queue.popleft()

    def _route(self, payload: bytes) -> None:
        try:
            reply = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            _log.warning("dropped an undecodable reply: %s", e)
            return
        if reply.rid in self._pending:
            self._pending[reply.rid].append(reply)
        elif isinstance(reply, ErrorReply) and not reply.rid:
            # The server could not read one of our messages and cannot say which: fail them all.
            for queue in self._pending.values():
                queue.append(reply)
        # else: a late reply for a request given up on (abort, closed iterator)

    def _drain_monitor(self, timeout_s: float) -> None:
        if self._monitor.poll(int(timeout_s * 1000)):
            while self._monitor.poll(0):
                state = _connection_event(self._monitor.recv_multipart())
                if state is not None:
                    self._connected = state


class AsyncClient:
    """asyncio client on one DEALER connection; any number of concurrent requests (routed by rid)."""

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_s: float | None = 600,
        *,
        port: int = 0,
        instance: str = "",
        api_key: str = "",
        curve: CurveKeys | None = None,
    ):
        self.endpoint = find_endpoint(endpoint, port=port, instance=instance)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)
        self._connected = False
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        self._encoder = msgspec.msgpack.Encoder()
        self._queues: dict[str, asyncio.Queue[ClientReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------ public

    async def wait_connected(self, timeout_s: float = 3.0) -> bool:
        """Whether a server is there: True once the connection handshake succeeded within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self._connected:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self._monitor.poll(int(remaining * 1000)):
                return self._connected
            state = _connection_event(await self._monitor.recv_multipart())
            if state is not None:
                self._connected = state
        return True

    async def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """Run one request to the end and return it whole. Raises HimambaError on an ErrorReply."""
        _check_single(options)
        req = make_request(prompt, stream=False, **options)
        builder = CompletionBuilder(req.rid)
        async with contextlib.aclosing(self._run(req)) as chunks:
            async for chunk in chunks:
                builder.add(chunk)
        return builder.build()

    async def generate_n(
        self, prompt: str | None = None, *, n: int, **options: Unpack[GenerateOptions]
    ) -> list[Completion]:
        """Run one request for `n` samples of the prompt; their Completions by index. The
        samples share the prompt's cache; with a `seed`, sample i uses seed + i."""
        req = make_request(prompt, stream=False, n=n, **options)
        builder = SamplesBuilder(req.rid, n)
        async with contextlib.aclosing(self._run(req)) as chunks:
            async for chunk in chunks:
                builder.add(chunk)
        return builder.build()

    async def stream(
        self, prompt: str | None = None, *, n: int = 1, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Yield the chunks (deltas) of a new request (with `n` > 1 the samples' chunks
        interleave, told apart by `index`). Leaving the loop early aborts it."""
        req = make_request(prompt, stream=True, n=n, **options)
        async with contextlib.aclosing(self._run(req)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def abort(self, rid: str) -> None:
        """Ask the server to abort `rid`; its stream then ends with finish_reason "abort"."""
        await self._send(AbortGenerate(rid=rid))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        for queue in self._queues.values():
            queue.put_nowait(ErrorReply(message="client closed", code=_CLOSED_CODE))
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def aclose(self) -> None:
        """Close, and wait for the reply reader to end (no pending task is left behind)."""
        reader = self._reader
        self.close()
        if reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ machinery

    async def _send(self, msg: GenerateRequest | AbortGenerate) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        if self.api_key and isinstance(msg, GenerateRequest):
            msg = msgspec.structs.replace(msg, api_key=self.api_key)
        await self._sock.send(self._encoder.encode(msg))

    async def _run(self, req: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        if req.rid in self._queues:
            raise ValueError(f"rid {req.rid!r} is already in flight on this client")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name="himamba-client-reader")
        queue: asyncio.Queue[ClientReply] = asyncio.Queue()
        self._queues[req.rid] = queue
        replies = _ReplyCount(req.sampling.n)
        try:
            await self._send(req)
            while not replies.done:
                try:
                    reply = await asyncio.wait_for(queue.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    msg = f"no reply for {req.rid!r} from {self.endpoint} within {self.timeout_s}s"
                    raise TimeoutError(msg) from None
                yield replies.chunk(reply)
        finally:
            self._queues.pop(req.rid, None)
            if not replies.done and not self._closed:
                await self._send(AbortGenerate(rid=req.rid))

    async def _read_loop(self) -> None:
        while True:
            payload = await self._sock.recv()
            try:
                reply = self._decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                _log.warning("dropped an undecodable reply: %s", e)
                continue
            queue = self._queues.get(reply.rid)
            if queue is not None:
                queue.put_nowait(reply)
            elif isinstance(reply, ErrorReply) and not reply.rid:
                # The server could not read one of our messages and cannot say which: fail them all.
                for q in self._queues.values():
                    q.put_nowait(reply)
