"""TokenizerService: the front door. Clients in (ROUTER), requests to the scheduler, text back out.

Client side (`cfg.endpoints.zmq_endpoint`): decode `ClientRequest`s, validate and tokenize, send
`AddRequest` / `AbortRequest` to the scheduler, answer every request with `GenerateChunk`s or an
`ErrorReply` (bad input never crashes the service and is never dropped silently). A request with
n > 1 samples is n scheduler requests, sent together; the siblings wait in the scheduler for the
first one's prefill (`samples.py`); an abort or a disconnect ends them all, a failure of one fails the request.
Scheduler side (own inbox): `TokenBatch` outputs are detokenized, checked for stop strings and
streamed back; a completed stop string sends `StopRequest` to the scheduler.
HTTP side (`cfg.http`, see `http/server.py`): each HTTP request is an in-process client with its
own identity (`local_clients.py`), so it takes exactly the ZeroMQ path above.
Observability: the front door's own metrics, the other services' `MetricsReport`s (served
together at /metrics) and their readiness (`Ready`, `WorkerInfo`, reports) for /health.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import resource
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from himamba.common.config import Config
from himamba.common.grammar import GRAMMAR_DEAD_END, spec_key
from himamba.common.messages import (
    MAX_RID_CHARS,
    AbortGenerate,
    AbortRequest,
    AddRequest,
    CacheFlushed,
    ClientRequest,
    Draining,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    GrammarReady,
    Hello,
    MetricsReport,
    PrepareGrammar,
    Ready,
    Stopped,
    StopRequest,
    TokenBatch,
    TokenOut,
    ToTokenizer,
    WorkerInfo,
)
from himamba.common.metrics_exposition import build_info_text, merge_expositions
from himamba.common.metrics_report import MetricsReporter, ServiceMetrics
from himamba.common.transport import Outbox
from himamba.common.types import STATE_SLOTS_PER_SAMPLE, FinishReason, GrammarSpec, Usage
from himamba.common.wire import Decoder, WireError
from himamba.services.actor import Actor
from himamba.services.tokenizer.cache_flush import CacheFlusher
from himamba.services.tokenizer.client_socket import (
    ClientGone,
    ClientMessage,
    ClientSocket,
    CurveServer,
)
from himamba.services.tokenizer.detokenize import markup_token_ids
from himamba.services.tokenizer.generation_defaults import (
    SamplingDefaults,
    load_generation_defaults,
    sent_sampling_fields,
)
from himamba.services.tokenizer.grammars import FrontDoorGrammars
from himamba.services.tokenizer.http.chat_template import (
    ChatTemplate,
    load_chat_template,
)
from himamba.services.tokenizer.http.connections import client_connection_cap
from himamba.services.tokenizer.http.server import HttpServer
from himamba.services.tokenizer.loader import LoadedTokenizer, load_tokenizer
from himamba.services.tokenizer.local_clients import LocalClients, ReplyStream
from himamba.services.tokenizer.output import RequestOutput
from himamba.services.tokenizer.peers import PEERS, PeerTable, Readiness
from himamba.services.tokenizer.prepare import (
    MAX_CHARS_PER_TOKEN,
    RequestLimits,
    check_batch_reply_size,
    prepare_request,
)
from himamba.services.tokenizer.request_metrics import RequestClock, RequestMetrics
from himamba.services.tokenizer.requests import RequestEntry, RequestTable, internal_rid
from himamba.services.tokenizer.samples import sample_requests
from himamba.services.tokenizer.stats_log import StatsLine, parse_samples

# A peer whose metrics reports stop for this many report intervals counts as gone.
_STALE_REPORTS = 5
_MIN_STALE_S = 1.0
_WAITING_LOG_EVERY_S = 10.0
_WAITING_LOG_MAX_S = 300.0
_STOPPED_REMEMBERED = 4096
GRAMMAR_READY_TIMEOUT_S = 60.0  # the longest a request waits for the worker to build its grammar
# A client message larger than this per context token (+1 MiB for the rest) is cut off by ZeroMQ
# (the client is disconnected): a prompt of MAX_CHARS_PER_TOKEN 4-byte characters per token fits.
CLIENT_BYTES_PER_CONTEXT_TOKEN = 4 * MAX_CHARS_PER_TOKEN


class _RidOnly(msgspec.Struct):
    rid: str = ""


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


def _rid_of_raw(payload: bytes) -> str:
    """Best effort: the rid of a payload that did not decode as a ClientRequest ("" if none)."""
    try:
        rid = _rid_decoder.decode(payload).rid
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return ""
    return rid if len(rid) <= MAX_RID_CHARS else ""


class TokenizerService(Actor[ToTokenizer]):
    """The client-facing actor: owns the tokenizer, the request table, the ROUTER socket, the
    HTTP server and the one /metrics endpoint of the server."""

    name = "tokenizer"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.tokenizer_ipc, ToTokenizer)
        self.table = RequestTable()
        self.local = LocalClients()
        self.peers = PeerTable(max(_MIN_STALE_S, _STALE_REPORTS * cfg.metrics.report_interval_s))
        self._reporter = MetricsReporter("tokenizer", None)
        self.metrics: ServiceMetrics = self._reporter.metrics
        self._request_metrics = RequestMetrics(self.metrics)
        self.model_name = cfg.model.served_model_name or Path(cfg.model.model).name
        self.max_context_len = cfg.model.max_context_len
        self.chat_template: ChatTemplate | None = None
        self.sampling_defaults = SamplingDefaults()  # generation_config.json's, for fields a request leaves out
        self._http: HttpServer | None = None
        self._draining = False
        self._drained_from: int | None = None  # requests in flight when the drain began
        self.drain_timeout_s = cfg.http.shutdown_timeout_s
        self._loaded: LoadedTokenizer | None = None
        self._markup_ids: frozenset[int] = frozenset()  # special tokens the output parsers read
        self._vocab_size = 0
        self._eos_token_ids: list[int] = []
        self._scheduler: Outbox | None = None
        self._worker: Outbox | None = None
        self._flusher: CacheFlusher | None = None
        self._cache: Outbox | None = None
        self.worker_info: WorkerInfo | None = None
        # spec_key -> (the grammar, resolved when the worker built it)
        self._grammar_waiters: dict[bytes, tuple[PrepareGrammar, asyncio.Future[None]]] = {}
        self._clients: ClientSocket | None = None
        # identity -> its messages not served yet, and the tasks serving them (_queue_client_event)
        self._client_queues: dict[bytes, deque[ClientMessage | ClientGone]] = {}
        self._client_tasks: set[asyncio.Task[None]] = set()
        self._admitting: set[tuple[bytes, str]] = set()  # (identity, rid) accepted, not yet queued
        self._decoder: Decoder[Any] = Decoder(ClientRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_auto_rid = 0
        self._peer_pids: dict[str, int] = {}
        self._stopped: OrderedDict[str, None] = OrderedDict()  # rids we asked the scheduler to abort

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        m = self.cfg.model
        self._loaded = load_tokenizer(m.model, m.tokenizer or None)
        self._vocab_size = self._loaded.vocab_size
        self._eos_token_ids = list(self._loaded.eos_token_ids)
        self._markup_ids = markup_token_ids(self._loaded.tokenizer)
        tokenizer_json = Path(m.tokenizer or m.model) / "tokenizer.json"
        self._grammars = FrontDoorGrammars(tokenizer_json, lambda: self._vocab_size, lambda: self._eos_token_ids)
        try:
            self.chat_template = load_chat_template(m.tokenizer or m.model, m.chat_template)
        except ValueError as e:  # a broken template costs chat completions, not the server
            self.log.error("%s; /v1/chat/completions will refuse requests", e)
        self.sampling_defaults = load_generation_defaults(m.generation_config, m.model)
        self.log.info("%s", self.sampling_defaults.describe())
        self._scheduler = Outbox(self.ctx, self.cfg.endpoints.scheduler_ipc)
        # A worker that is already up sent its WorkerInfo (model vocab, eos) to an earlier front door.
        self._worker = Outbox(self.ctx, self.cfg.endpoints.worker_ipc)
        await self._worker.send(Hello(service=self.name, pid=os.getpid()))
        self._cache = Outbox(self.ctx, self.cfg.endpoints.cache_ipc)
        self._flusher = CacheFlusher(self._cache, self.cfg.endpoints.tokenizer_ipc)
        max_bytes = CLIENT_BYTES_PER_CONTEXT_TOKEN * self.cfg.model.max_context_len + (1 << 20)
        ep = self.cfg.endpoints
        curve = CurveServer(ep.curve_secret_key_file, ep.curve_clients_dir) if ep.curve_secret_key_file else None
        zmq_cap = client_connection_cap(ep.max_client_connections)
        self._clients = ClientSocket(
            self.ctx,
            ep.zmq_endpoint,
            max_message_bytes=max_bytes,
            send_queue=ep.client_send_queue,
            curve=curve,
            max_connections=zmq_cap,
        )
        detail = f"vocab {self._vocab_size}, eos {self._eos_token_ids}, clients at {self.cfg.endpoints.zmq_endpoint}"
        if self.cfg.http.port:
            self._http = HttpServer(self, self.cfg.http, self.log, reserved_fds=zmq_cap)
            detail += f", HTTP at {await self._http.start()}"
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            detail += f" (at most {self._http.guard.cap} connections, {zmq_cap} ZeroMQ ones; fd limit {soft})"
        return detail

    async def background(self) -> None:
        """The client loop (the inbox loop of the base class serves the scheduler side)."""
        assert self._clients is not None
        self.spawn(self._watch_peers(), "peers")
        if self.cfg.log.stats_interval_s:
            self.spawn(self._log_stats(self.cfg.log.stats_interval_s), "stats")
        while True:
            self._queue_client_event(await self._clients.recv())

    def _queue_client_event(self, event: ClientMessage | ClientGone) -> None:
        """Serve each ZeroMQ client's messages in its own order, apart from other clients': a
        request waiting for its grammar's build (seconds, up to GRAMMAR_READY_TIMEOUT_S) holds only
        its own client's later messages, never every client's."""
        queue = self._client_queues.get(event.identity)
        if queue is not None:
            queue.append(event)
            return
        queue = self._client_queues[event.identity] = deque([event])
        task = asyncio.get_running_loop().create_task(self._serve_client(event.identity, queue))
        self._client_tasks.add(task)
        task.add_done_callback(self._client_tasks.discard)
        task.add_done_callback(self._task_done)  # an unexpected failure is fatal, as a spawned task's

    async def _serve_client(self, identity: bytes, queue: deque[ClientMessage | ClientGone]) -> None:
        try:
            while queue:
                event = queue.popleft()
                if isinstance(event, ClientGone):
                    await self._on_client_gone(identity)
                else:
                    await self._on_client_message(event)
        finally:
            del self._client_queues[identity]

    async def _watch_peers(self) -> None:
        """Log what the front door waits for: at start, when a service goes away, and again
        (less and less often) while it stays away."""
        last: Readiness | None = None
        repeat_s = _WAITING_LOG_EVERY_S
        next_log = 0.0
        while True:
            state = self.readiness()
            now = time.monotonic()
            if state != last:
                if state.ready:
                    self.log.info("all services ready")
                else:
                    self.log.info("waiting for %s", ", ".join(state.not_ready))
                    repeat_s, next_log = _WAITING_LOG_EVERY_S, now + _WAITING_LOG_EVERY_S
                last = state
            elif not state.ready and now >= next_log:
                self.log.info("still waiting for %s", ", ".join(state.not_ready))
                repeat_s = min(2 * repeat_s, _WAITING_LOG_MAX_S)
                next_log = now + repeat_s
            await asyncio.sleep(0.1)

    async def _log_stats(self, interval_s: float) -> None:
        """The periodic stats line (stats_log.py), from this server's own /metrics page."""
        line = StatsLine()
        while True:
            text = line.update(parse_samples(self.metrics_text()), time.monotonic())
            if text is not None:
                self.log.info("%s", text)
            await asyncio.sleep(interval_s)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503) and give the running ones up to `timeout_s` to finish.

        Needs the inbox loop still running (outputs keep arriving); `stop()` aborts the rest.
        """
        self._draining = True
        deadline = time.monotonic() + timeout_s
        self._drained_from = self.table.request_count() + len(self._admitting)
        if self._cache is not None:  # its flush of pending backups gets what this drain leaves
            try:
                await self._cache.send(Draining(deadline=time.time() + timeout_s))
            except Exception as e:  # noqa: BLE001 - the cache may be gone: it then flushes by its own clock
                self.log.debug("could not tell the cache the stop's deadline: %r", e)
        if self._drained_from:
            self.log.info("draining: waiting up to %.1fs for %d request(s)", timeout_s, self._drained_from)
        while (self.table or self._admitting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        # Requests accepted but not queued yet (waiting for their grammar): answered 503 below.
        admitting = set(self._admitting)
        # The client loop is stopped: so is what it was serving (as when it served inline).
        for task in list(self._client_tasks):
            task.cancel()
        await asyncio.gather(*self._client_tasks, return_exceptions=True)
        # Tell clients still waiting that no answer is coming, rather than leaving them hanging,
        # and the scheduler to free what they hold (it may be stopping too: best effort).
        told: set[tuple[bytes, str]] = set()
        aborted = self.table.request_count() + len(admitting)
        if self._drained_from is not None:  # one line for the operator: what the stop did to clients
            summary = (
                f"{self._drained_from} request(s) in flight at SIGTERM, "
                f"{max(0, self._drained_from - aborted)} finished, {aborted} aborted with 503"
            )
            self.log.info("shutdown: %s", summary)
            try:  # the launcher's final line carries it
                self.control.send_nowait(Stopped(service=self.name, pid=os.getpid(), summary=summary))
            except Exception as e:  # noqa: BLE001 - the launcher may be gone: the log line stands
                self.log.debug("could not tell the launcher how the stop went: %r", e)
        for entry in self.table.entries():
            self.table.pop(entry.rid)
            try:
                if (entry.identity, entry.client_rid) not in told:  # one reply per request, not per sample
                    told.add((entry.identity, entry.client_rid))
                    reply = ErrorReply(message="server shutting down", rid=entry.client_rid, code=503)
                    await self._reply(entry.identity, reply)
                await self._send_scheduler(AbortRequest(rid=entry.rid))
            except Exception:  # shutting down: best effort
                pass
        for identity, client_rid in admitting - told:
            try:
                await self._reply(identity, ErrorReply(message="server shutting down", rid=client_rid, code=503))
            except Exception:  # shutting down: best effort
                pass
        if self._http is not None:
            await self._http.stop()
        if self._clients is not None:
            self._clients.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        if self._flusher is not None:
            self._flusher.close()
        if getattr(self, "_grammars", None) is not None:
            self._grammars.close()

    # ------------------------------------------------------------ what the HTTP server uses

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._loaded is not None
        return self._loaded.tokenizer

    def readiness(self) -> Readiness:
        """Whether every other service is up (the tokenizer itself is, if it can answer and is
        not draining)."""
        if self._draining:
            return Readiness(False, ("tokenizer (shutting down)",))
        return self.peers.readiness(time.monotonic())

    def metrics_text(self) -> str:
        """The whole server's metrics: build info, the front door's own, each peer's latest report
        (merged by family, every series labelled with the model name)."""
        parts = [build_info_text(self.cfg), self._reporter.render(), *self.peers.reports(time.monotonic())]
        return merge_expositions(parts, self.model_name)

    async def flush_cache(self) -> CacheFlushed:
        """/flush_cache: the cache controller empties the device and host tiers if it is idle
        (cache_flush.py); TimeoutError when it does not answer."""
        assert self._flusher is not None
        return await self._flusher.flush()

    async def open_stream(self, req: GenerateRequest) -> ReplyStream:
        """Submit `req` as a new in-process client; its replies arrive on the returned stream."""
        identity, queue = self.local.open()
        stream = ReplyStream(identity, queue, self._close_local)
        await self._dispatch(identity, req)
        return stream

    async def _close_local(self, identity: bytes) -> None:
        if self.local.close(identity):
            await self._on_client_gone(identity)

    # ------------------------------------------------------------ scheduler side

    async def handle(self, msg: ToTokenizer, frames: list[Any]) -> None:
        match msg:
            case TokenBatch(outs=outs):
                for out in outs:
                    await self._on_token_out(out)
            case WorkerInfo():
                if self.worker_info is not None and msg.pid != self.worker_info.pid and self._worker is not None:
                    for prepare, _ in list(self._grammar_waiters.values()):  # a new worker: ask it again
                        await self._worker.send(prepare)
                self.worker_info = msg  # the pools' sizes, for /server_info
                self._vocab_size = msg.vocab_size
                if not self._eos_token_ids:
                    self._eos_token_ids = list(msg.eos_token_ids)
                self._note_peer("worker", "WorkerInfo")
            case Ready(service=service, pid=pid):
                self._note_peer(service, "Ready")
                await self._note_pid(service, pid)
            case GrammarReady(key=key):
                _, waiter = self._grammar_waiters.pop(key, (None, None))
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            case CacheFlushed():
                if self._flusher is not None:
                    self._flusher.on_flushed(msg)
            case MetricsReport(service=service, text=text, pid=pid):
                await self._note_pid(service, pid)
                if service in PEERS:
                    self.peers.report(service, text, time.monotonic())
                else:
                    self.log.warning("metrics report from unknown service %r", service)
            case _:
                self.log.warning("unexpected message %s", type(msg).__name__)

    async def _note_pid(self, service: str, pid: int) -> None:
        if not pid or service not in PEERS:
            return
        before = self._peer_pids.get(service)
        self._peer_pids[service] = pid
        if service == "scheduler" and before is not None and before != pid:
            await self._on_scheduler_restart()

    async def _on_scheduler_restart(self) -> None:
        """The scheduler restarted and lost what it ran. Requests that have no output yet are
        sent again (the scheduler drops a copy it already has); the others cannot be resumed
        exactly and fail with a retryable error."""
        resent = failed = 0
        for entry in list(self.table.entries()):
            if entry.rid not in self.table:
                continue  # gone with a failed sibling
            if entry.sent is not None:
                await self._send_scheduler(entry.sent)
                resent += 1
            else:
                message = "the scheduler restarted while this request was running; send it again"
                await self._fail_request(entry, message, abort_failed=False, code=503)
                failed += 1
        self.log.warning("scheduler restarted: %d request(s) sent again, %d failed (they had output)", resent, failed)

    def _note_peer(self, service: str, how: str) -> None:
        if service in PEERS and self.peers.announce(service):
            self.log.info("%s is ready (%s)", service, how)

    def _record_end(self, entry: RequestEntry, reason: FinishReason, usage: Usage | None) -> None:
        self._request_metrics.on_finished(entry.clock, reason, usage, time.monotonic())

    async def _on_token_out(self, out: TokenOut) -> None:
        entry = self.table.get(out.rid)
        if entry is None:
            # Already finished here (stop string, abort: late outputs are expected), or sent by
            # an earlier front door (we restarted): the scheduler should stop it either way.
            if out.finish_reason is None and out.rid not in self._stopped:
                self._stopped[out.rid] = None
                if len(self._stopped) > _STOPPED_REMEMBERED:
                    self._stopped.popitem(last=False)
                await self._send_scheduler(AbortRequest(rid=out.rid))
            return
        entry.sent = None
        if out.error:
            # A grammar the output ran into a dead end of is the request's fault, not the server's.
            code = 400 if out.error.startswith(GRAMMAR_DEAD_END) else 500
            await self._fail_request(entry, out.error, abort_failed=False, code=code)
            return
        self._request_metrics.on_tokens(entry.clock, len(out.token_ids), time.monotonic())
        try:
            step = entry.output.on_token_out(out)
        except Exception:
            self.log.error("output of %s failed\n%s", out.rid, traceback.format_exc())
            await self._fail_request(entry, "internal error (see the server log)", abort_failed=True)
            return
        if step.finished:
            self.table.pop(out.rid)
            chunk = step.chunk
            reason = chunk.finish_reason if chunk is not None and chunk.finish_reason else "stop"
            self._record_end(entry, reason, chunk.usage if chunk is not None else None)
        if step.stop_string_hit:
            await self._send_scheduler(StopRequest(rid=out.rid))
        if step.chunk is not None:
            await self._reply(entry.identity, step.chunk)

    async def _fail_request(self, failed: RequestEntry, message: str, *, abort_failed: bool, code: int = 500) -> None:
        """A sample failed: its whole request fails with one ErrorReply, the other samples are
        aborted (and the failed one too when the scheduler still runs it: `abort_failed`)."""
        for entry in self.table.pop_request(failed.identity, failed.client_rid):
            is_failed = entry is failed
            self._record_end(entry, "error" if is_failed else "abort", None)
            if abort_failed or not is_failed:
                await self._send_scheduler(AbortRequest(rid=entry.rid))
        await self._reply(failed.identity, ErrorReply(message=message, rid=failed.client_rid, code=code))

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
        if isinstance(msg, GenerateRequest) and not self._key_ok(msg.api_key):
            reply = ErrorReply(
                message="invalid or missing api_key (the server was started with --api-key)", rid=msg.rid, code=401
            )
            await self._reply(event.identity, reply)
            return
        if isinstance(msg, GenerateRequest) and self.sampling_defaults.values():
            given = sent_sampling_fields(event.frames[0].bytes)
            msg = msgspec.structs.replace(msg, sampling=self.sampling_defaults.fill(msg.sampling, given))
        await self._dispatch(event.identity, msg)

    def _key_ok(self, key: str) -> bool:
        """ZeroMQ requests carry the key in the request (HTTP ones were checked by the HTTP server)."""
        want = self.cfg.http.api_key
        return not want or hmac.compare_digest(key.encode(), want.encode())

    async def _dispatch(self, identity: bytes, msg: GenerateRequest | AbortGenerate) -> None:
        """Serve one client message (ZeroMQ or in-process alike)."""
        try:
            match msg:
                case GenerateRequest():
                    await self._on_generate(identity, msg)
                case AbortGenerate(rid=rid):
                    await self._on_abort(identity, rid)
        except Exception:  # a bug here must cost one request, not the front door
            self.log.error("client request failed\n%s", traceback.format_exc())
            rid = getattr(msg, "rid", "")
            for entry in self.table.pop_request(identity, rid):
                self._record_end(entry, "error", None)
                await self._send_scheduler(AbortRequest(rid=entry.rid))
            await self._reply(identity, ErrorReply(message="internal error (see the server log)", rid=rid, code=500))

    def _limits(self) -> RequestLimits:
        # --default-max-tokens when set, else generation_config.json's max_new_tokens, else (0) the context.
        default_max_tokens = self.cfg.scheduler.default_max_tokens or self.sampling_defaults.max_tokens or 0
        return RequestLimits(
            self._vocab_size, self.cfg.model.max_context_len, default_max_tokens, self.cfg.model.max_logprobs
        )

    def check_batch_reply_size(self, reqs: Sequence[GenerateRequest]) -> None:
        """ValueError naming the sum when batched prompts (same sampling) would reply with more
        logprob entries in all than one request may; before any of them is queued. Text prompts
        are tokenized for it only when logprobs are asked for (each is tokenized again when
        prepared); a prompt each request would refuse anyway counts nothing here."""
        sampling = reqs[0].sampling
        if self._loaded is None or (sampling.prompt_logprobs is None and not sampling.logprobs):
            return
        limits = self._limits()
        most_chars = MAX_CHARS_PER_TOKEN * limits.max_context_len
        texts = [r.prompt for r in reqs if r.prompt and len(r.prompt) <= most_chars]
        text_lens = iter(len(e.ids) for e in self._loaded.tokenizer.encode_batch(texts, add_special_tokens=True))
        lens = []
        for r in reqs:
            n = len(r.input_ids or []) if r.prompt is None else (next(text_lens) if 0 < len(r.prompt) <= most_chars else 0)
            if 0 < n < limits.max_context_len:
                lens.append(n)
        check_batch_reply_size(sampling, lens, limits)

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """ValueError ("grammar: why") when `spec` does not build for this model (cached)."""
        await self._grammars.check(spec)

    async def _grammar_built(self, grammar: GrammarSpec, lowered: str) -> None:
        """Have the worker build `grammar` (from `lowered`, the check's conversion of it) and wait
        until it has: a request is queued only then, so no step of the worker waits for a build
        (every other request keeps stepping while it runs). A worker that restarts is asked again;
        bounded by GRAMMAR_READY_TIMEOUT_S all the same (the request's first step then waits for the
        build instead)."""
        if self._worker is None:
            return
        prepare = PrepareGrammar(grammar=grammar, lowered=lowered)
        if self.worker_info is None:  # no worker has said it is up: a hint it may read later
            await self._worker.send(prepare)
            return
        key = spec_key(grammar)
        pending = self._grammar_waiters.get(key)
        if pending is not None:
            waiter = pending[1]
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._grammar_waiters[key] = (prepare, waiter)
            await self._worker.send(prepare)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), GRAMMAR_READY_TIMEOUT_S)
        except TimeoutError:
            self.log.warning("the worker did not report a grammar built within %gs", GRAMMAR_READY_TIMEOUT_S)
            if self._grammar_waiters.get(key, (None, None))[1] is waiter:
                del self._grammar_waiters[key]

    def _check_samples_fit(self, n: int) -> None:
        """ValueError naming the limit when the device state pool can never hold `n` samples at
        once (they are admitted together): such a request would wait for room that never comes."""
        info = self.worker_info
        if info is None or not info.num_recurrent_layers or n == 1:
            return
        strategy = "no_buffer" if self.cfg.cache.disable_radix_cache else self.cfg.scheduler.mamba_scheduler_strategy
        per = STATE_SLOTS_PER_SAMPLE[strategy]
        most = info.num_state_slots // per
        if n > most:
            raise ValueError(
                f"n={n} needs {n * per} device state slots at once ({per} a sample under --mamba-scheduler-strategy "
                f"{strategy}); this server has {info.num_state_slots} (--max-mamba-cache-size): n may be at most {most}"
            )

    def _auto_rid(self, identity: bytes) -> str:
        while True:
            self._next_auto_rid += 1
            rid = f"auto-{self._next_auto_rid}"
            if not self.table.in_flight(identity, rid):
                return rid

    async def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        assert self._loaded is not None
        client_rid = req.rid or self._auto_rid(identity)
        if self._draining:
            await self._reply(identity, ErrorReply(message="server shutting down", rid=client_rid, code=503))
            return
        if self.table.in_flight(identity, client_rid):
            error = ErrorReply(message=f"rid {client_rid!r} is already in flight", rid=client_rid, code=409)
            await self._reply(identity, error)
            return
        # --default-max-tokens when set, else generation_config.json's max_new_tokens, else (0) the context.
        # In flight from here, though in the table only once queued: the drain waits for it and the
        # stop answers it 503 while its grammar is checked and built (seconds).
        admitting = (identity, client_rid)
        self._admitting.add(admitting)
        try:
            try:
                prepared = prepare_request(req, self._loaded.tokenizer, self._limits())
                self._check_samples_fit(req.sampling.n)
                lowered = ""
                if req.sampling.grammar is not None:  # off the loop; a 400 before queueing
                    lowered = await self._grammars.check(req.sampling.grammar)
            except ValueError as e:
                await self._reply(identity, ErrorReply(message=str(e), rid=client_rid, code=400))
                return
            if req.sampling.grammar is not None:
                if self.table.in_flight(identity, client_rid):  # the same rid arrived while we checked
                    error = ErrorReply(message=f"rid {client_rid!r} is already in flight", rid=client_rid, code=409)
                    await self._reply(identity, error)
                    return
                await self._grammar_built(req.sampling.grammar, lowered)
        finally:
            self._admitting.discard(admitting)  # no await from here until it is in the table
        n = req.sampling.n
        adds = sample_requests(
            [internal_rid(identity, client_rid, i) for i in range(n)],
            prepared.input_ids,
            req.sampling,
            max_tokens=prepared.max_tokens,
            eos_token_ids=self._eos_token_ids,
            arrival_time=time.time(),
        )
        arrival = time.monotonic()
        for i, add in enumerate(adds):
            output = RequestOutput(
                client_rid,
                self._loaded.tokenizer,
                stream=req.stream,
                stops=list(req.sampling.stop),
                prompt_len=len(prepared.input_ids),
                prompt_token_ids=prepared.input_ids if prepared.prompt_was_text else None,
                index=i,
                keep_special=self._markup_ids,
                eos_ids=frozenset() if req.sampling.ignore_eos else frozenset(self._eos_token_ids),
                stop_token_ids=frozenset(req.sampling.stop_token_ids),
            )
            entry = RequestEntry(
                add.rid,
                identity,
                client_rid,
                output,
                RequestClock(arrival),
                index=i,
                sent=add,
            )
            self.table.add(entry)
        for add in adds:  # siblings wait in the scheduler for sample 0's prefill (samples.py)
            await self._send_scheduler(add)

    async def _on_abort(self, identity: bytes, client_rid: str) -> None:
        entries = self.table.pop_request(identity, client_rid)
        if not entries:
            error = ErrorReply(message=f"rid {client_rid!r} is not in flight", rid=client_rid, code=404)
            await self._reply(identity, error)
            return
        for entry in entries:  # every unfinished sample ends with its own final "abort" chunk
            await self._send_scheduler(AbortRequest(rid=entry.rid))
            final = entry.output.finish("abort")
            self._record_end(entry, "abort", final.usage)
            await self._reply(identity, final)

    async def _on_client_gone(self, identity: bytes) -> None:
        entries = self.table.pop_client(identity)
        if entries:
            self.log.info("client %s went away: aborting %d request(s)", identity.hex(), len(entries))
        for entry in entries:
            self._record_end(entry, "abort", None)
            await self._send_scheduler(AbortRequest(rid=entry.rid))

    # ------------------------------------------------------------ sending

    async def _send_scheduler(self, msg: AddRequest | AbortRequest | StopRequest) -> None:
        assert self._scheduler is not None
        await self._scheduler.send(msg)

    async def _reply(self, identity: bytes, reply: GenerateChunk | ErrorReply) -> None:
        if identity in self.local:
            self.local.deliver(identity, reply)
            return
        assert self._clients is not None
        if not await self._clients.send(identity, self._encoder.encode(reply)):
            await self._on_client_gone(identity)
