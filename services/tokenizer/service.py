"""TokenizerService: the front door. Clients in (ROUTER), requests to the scheduler, text back out.

Client side (`cfg.endpoints.zmq_endpoint`): decode `ClientRequest`s, validate and tokenize, send
`AddRequest` / `AbortRequest` to the scheduler, answer every request with `GenerateChunk`s or an
`ErrorReply` (bad input never crashes the service and is never dropped silently).
Scheduler side (own inbox): `TokenBatch` outputs are detokenized, checked for stop strings and
streamed back; a completed stop string sends `StopRequest` to the scheduler.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import msgspec

from himamba.common.config import Config
from himamba.common.messages import (
    AbortGenerate,
    AbortRequest,
    AddRequest,
    ClientRequest,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    StopRequest,
    TokenBatch,
    TokenOut,
    ToTokenizer,
    WorkerInfo,
)
from himamba.common.transport import Outbox
from himamba.common.wire import Decoder, WireError
from himamba.services.actor import Actor
from himamba.services.tokenizer.client_socket import ClientGone, ClientMessage, ClientSocket
from himamba.services.tokenizer.loader import LoadedTokenizer, load_tokenizer
from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.prepare import RequestLimits, prepare_request
from himamba.services.tokenizer.requests import RequestEntry, RequestTable, internal_rid


def _rid_of_raw(payload: bytes) -> str:
    """Best effort: the rid of a payload that did not decode as a ClientRequest."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return ""
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else ""


class TokenizerService(Actor[ToTokenizer]):
    """The client-facing actor: owns the tokenizer, the request table and the ROUTER socket."""

    name = "tokenizer"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.tokenizer_ipc, ToTokenizer)
        self.table = RequestTable()
        self._loaded: LoadedTokenizer | None = None
        self._vocab_size = 0
        self._eos_token_ids: list[int] = []
        self._scheduler: Outbox | None = None
        self._clients: ClientSocket | None = None
        self._decoder: Decoder[Any] = Decoder(ClientRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_auto_rid = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        self._loaded = load_tokenizer(self.cfg.model.model)
        self._vocab_size = self._loaded.vocab_size
        self._eos_token_ids = list(self._loaded.eos_token_ids)
        self._scheduler = Outbox(self.ctx, self.cfg.endpoints.scheduler_ipc)
        self._clients = ClientSocket(self.ctx, self.cfg.endpoints.zmq_endpoint)
        return f"vocab {self._vocab_size}, eos {self._eos_token_ids}, clients at {self.cfg.endpoints.zmq_endpoint}"

    async def background(self) -> None:
        """The client loop (the inbox loop of the base class serves the scheduler side)."""
        assert self._clients is not None
        while True:
            event = await self._clients.recv()
            if isinstance(event, ClientGone):
                await self._on_client_gone(event.identity)
            else:
                await self._on_client_message(event)

    async def stop(self) -> None:
        # Tell clients still waiting that no answer is coming, rather than leaving them hanging.
        if self._clients is not None:
            for entry in self.table.entries():
                reply = ErrorReply(message="server shutting down", rid=entry.client_rid, code=503)
                try:
                    await self._clients.send(entry.identity, self._encoder.encode(reply))
                except Exception:  # shutting down: best effort
                    pass
            self._clients.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------ scheduler side

    async def handle(self, msg: ToTokenizer, frames: list[Any]) -> None:
        match msg:
            case TokenBatch(outs=outs):
                for out in outs:
                    await self._on_token_out(out)
            case WorkerInfo():
                self._vocab_size = msg.vocab_size
                if not self._eos_token_ids:
                    self._eos_token_ids = list(msg.eos_token_ids)
            case _:
                self.log.warning("unexpected message %s", type(msg).__name__)

    async def _on_token_out(self, out: TokenOut) -> None:
        entry = self.table.get(out.rid)
        if entry is None:
            return  # already finished here (stop string, abort): late outputs are expected
        if out.error:
            self.table.pop(out.rid)
            await self._reply(entry.identity, ErrorReply(message=out.error, rid=entry.client_rid, code=500))
            return
        try:
            step = entry.output.on_token_out(out)
        except Exception as e:
            self.log.error("output of %s failed\n%s", out.rid, traceback.format_exc())
            self.table.pop(out.rid)
            await self._send_scheduler(AbortRequest(rid=out.rid))
            error = ErrorReply(message=f"internal error: {e!r}", rid=entry.client_rid, code=500)
            await self._reply(entry.identity, error)
            return
        if step.finished:
            self.table.pop(out.rid)
        if step.stop_string_hit:
            await self._send_scheduler(StopRequest(rid=out.rid))
        if step.chunk is not None:
            await self._reply(entry.identity, step.chunk)

    # ------------------------------------------------------------ client side

    async def _on_client_message(self, event: ClientMessage) -> None:
        if len(event.frames) != 1:
            await self._reply(event.identity, ErrorReply(message=f"expected 1 payload frame, got {len(event.frames)}"))
            return
        try:
            msg, _ = self._decoder.decode(event.frames)
        except WireError as e:
            payload = event.frames[0].bytes
            await self._reply(event.identity, ErrorReply(message=f"undecodable request: {e}", rid=_rid_of_raw(payload)))
            return
        try:
            match msg:
                case GenerateRequest():
                    await self._on_generate(event.identity, msg)
                case AbortGenerate(rid=rid):
                    await self._on_abort(event.identity, rid)
        except Exception as e:  # a bug here must cost one request, not the front door
            self.log.error("client request failed\n%s", traceback.format_exc())
            rid = getattr(msg, "rid", "")
            entry = self.table.pop(internal_rid(event.identity, rid))
            if entry is not None:
                await self._send_scheduler(AbortRequest(rid=entry.rid))
            await self._reply(event.identity, ErrorReply(message=f"internal error: {e!r}", rid=rid, code=500))

    def _auto_rid(self, identity: bytes) -> str:
        while True:
            self._next_auto_rid += 1
            rid = f"auto-{self._next_auto_rid}"
            if internal_rid(identity, rid) not in self.table:
                return rid

    async def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        assert self._loaded is not None
        client_rid = req.rid or self._auto_rid(identity)
        rid = internal_rid(identity, client_rid)
        if rid in self.table:
            error = ErrorReply(message=f"rid {client_rid!r} is already in flight", rid=client_rid, code=409)
            await self._reply(identity, error)
            return
        limits = RequestLimits(self._vocab_size, self.cfg.model.max_context_len, self.cfg.scheduler.default_max_tokens)
        try:
            prepared = prepare_request(req, self._loaded.tokenizer, limits)
        except ValueError as e:
            await self._reply(identity, ErrorReply(message=str(e), rid=client_rid, code=400))
            return
        output = RequestOutput(
            client_rid,
            self._loaded.tokenizer,
            stream=req.stream,
            stops=list(req.sampling.stop),
            prompt_len=len(prepared.input_ids),
            prompt_token_ids=prepared.input_ids if prepared.prompt_was_text else None,
        )
        self.table.add(RequestEntry(rid, identity, client_rid, output))
        await self._send_scheduler(
            AddRequest(
                rid=rid,
                input_ids=prepared.input_ids,
                sampling=req.sampling,
                max_tokens=prepared.max_tokens,
                eos_token_ids=self._eos_token_ids,
                arrival_time=time.time(),
            )
        )

    async def _on_abort(self, identity: bytes, client_rid: str) -> None:
        entry = self.table.pop(internal_rid(identity, client_rid))
        if entry is None:
            error = ErrorReply(message=f"rid {client_rid!r} is not in flight", rid=client_rid, code=404)
            await self._reply(identity, error)
            return
        await self._send_scheduler(AbortRequest(rid=entry.rid))
        await self._reply(identity, entry.output.finish("abort"))

    async def _on_client_gone(self, identity: bytes) -> None:
        entries = self.table.pop_client(identity)
        if entries:
            self.log.info("client %s went away: aborting %d request(s)", identity.hex(), len(entries))
        for entry in entries:
            await self._send_scheduler(AbortRequest(rid=entry.rid))

    # ------------------------------------------------------------ sending

    async def _send_scheduler(self, msg: AddRequest | AbortRequest | StopRequest) -> None:
        assert self._scheduler is not None
        await self._scheduler.send(msg)

    async def _reply(self, identity: bytes, reply: GenerateChunk | ErrorReply) -> None:
        assert self._clients is not None
        if not await self._clients.send(identity, self._encoder.encode(reply)):
            await self._on_client_gone(identity)
